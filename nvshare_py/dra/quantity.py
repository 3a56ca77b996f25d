"""Kubernetes quantities (`4Gi`, `16G`, `1.5Gi`, `500M`, `1e9`, `4294967296`) as integers,
the way the API server reads them: decimal suffixes are powers of 1000 (`16G` is 16·10⁹ bytes,
unlike nvshare's own size grammar), binary ones powers of 1024, and a fraction of a byte rounds
up. https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/
"""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|([a-zA-Z]*))$")
_SUFFIXES = {
    "": Fraction(1), "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}


def parse_quantity(text: object) -> int:
    """The quantity as a whole number (rounded up); ValueError if it is not one. Integers (as a
    JSON document may carry them) are taken as they are."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a quantity")
    if isinstance(text, int):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a quantity")
    match = _QUANTITY.match(text.strip())
    if not match or (match.group(3) or "") not in _SUFFIXES:
        raise ValueError(f"{text!r} is not a quantity such as 4Gi, 512Mi or 4294967296")
    number, exponent, suffix = match.groups()
    value = Fraction(number) * (Fraction(10) ** int(exponent[1:]) if exponent else _SUFFIXES[suffix or ""])
    return -((-value.numerator) // value.denominator)  # the ceiling
