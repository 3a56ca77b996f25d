"""What every nvshare command line shares: `-h`/`--help`, `--version`, one-line errors.

Each tool builds its typer app with `typer.Typer(**APP_SETTINGS, ...)` and gives its top-level
callback (or its single command) a `version: bool = VERSION_OPTION` parameter. Values are
parsed by the `parser=` functions below, so that a refusal is in our words and states what is
allowed; a command whose argument may be a negative number uses `cls=NumbersAsValues`.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, Callable, Iterable, Literal, TypedDict

import typer
from typer.core import TyperCommand

from . import __version__

class AppSettings(TypedDict):
    add_completion: bool
    context_settings: dict[str, Any]
    rich_markup_mode: Literal["markdown", "rich"] | None


APP_SETTINGS: AppSettings = {
    "add_completion": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
    # Plain help: typer's rich help shows every flag as "--fail-open <bool>", which reads as an
    # option taking a value (and `--fail-open true CMD` then runs the command `true`).
    "rich_markup_mode": None,
}


LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str) -> None:
    """Every nvshare daemon logs alike, on stderr: `2026-11-26T07:31:12.345 INFO message`."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S")


def _show_version(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        typer.echo(f"{ctx.find_root().info_name} (nvshare_py) {__version__}")
        raise typer.Exit()


VERSION_OPTION = typer.Option(
    False, "--version", callback=_show_version, is_eager=True, expose_value=True, help="Show the version and exit."
)


def missing_extra(tool: str, extra: str, module: str) -> str:
    """The one line a tool prints when an optional dependency group is not installed."""
    return (f"{tool}: needs the '{extra}' extra ({module} is not installed): from a checkout of nvshare_py, "
            f"run pip install '.[{extra}]'")


def tolerate_narrow_encoding(tool: str) -> None:
    """Where standard output cannot encode the characters the timeline and tables draw with
    (PYTHONIOENCODING=ascii, a C locale), say so in one line and print '?' for them instead of
    failing with UnicodeEncodeError."""
    encoding = sys.stdout.encoding or "ascii"
    try:
        "█▒→—✔".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="replace")
        typer.echo(f"{tool}: warning: the output encoding ({encoding}) cannot show the timeline's characters, so "
                   f"they appear as '?'; use a UTF-8 locale or PYTHONIOENCODING=utf-8 for the full picture", err=True)


# The time quanta a person may set (nvshare-scheduler --tq, nvsharectl set-tq). Below 0.1 s the
# handoffs (a drain of every context each time) would take a noticeable share of the GPU; above
# a day a waiter could as well be refused.
TQ_MIN = 0.1
TQ_MAX = 86400.0


def number_between(low: float, high: float, what: str = "seconds"):
    """A typer `parser`: a float in [low, high], else an error in our words that states the range."""

    def parse(text: str) -> float:
        allowed = f"give {what} from {low:g} to {high:g}"
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number: {allowed}") from None
        if not low <= value <= high:  # also NaN
            raise typer.BadParameter(f"{text} is out of range: {allowed}")
        return value

    return parse


def whole_number(low: int, high: int | None = None, what: str = "a whole number"):
    """A typer `parser`: an int in [low, high], else an error in our words that states the range."""

    def parse(text: str) -> int:
        allowed = f"give {what} from {low}" + (f" to {high}" if high is not None else " up")
        try:
            value = int(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a whole number: {allowed}") from None
        if value < low or (high is not None and value > high):
            raise typer.BadParameter(f"{text} is out of range: {allowed}")
        return value

    return parse


def one_of(choices: Iterable[str], what: str) -> Callable[[str], str]:
    """A typer `parser`: one of `choices` (as given), else an error that lists them."""
    allowed = tuple(choices)

    def parse(text: str) -> str:
        if text not in allowed:
            raise typer.BadParameter(f"{text!r} is not {what}: give {_listed(allowed)}")
        return text

    return parse


def _listed(words: tuple[str, ...]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


_NEGATIVE_NUMBER = re.compile(r"-(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


class NumbersAsValues(TyperCommand):
    """A command whose arguments may be negative numbers: `set-tq -5` is refused as a time
    quantum out of range, not as an unknown option `-5` (the parser takes anything that starts
    with '-' for an option). A negative number that is not the value of an option is moved
    behind '--', where only arguments are read."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        takes_value = {name for param in self.params if param.param_type_name == "option"
                       and not getattr(param, "is_flag", False) and param.nargs > 0 for name in param.opts}
        end = args.index("--") if "--" in args else len(args)
        kept: list[str] = []
        numbers: list[str] = []
        for place, arg in enumerate(args[:end]):
            if _NEGATIVE_NUMBER.fullmatch(arg) and not (place and args[place - 1] in takes_value):
                numbers.append(arg)
            else:
                kept.append(arg)
        if numbers:
            args = [*kept, "--", *numbers, *args[end + 1:]]
        return super().parse_args(ctx, args)
