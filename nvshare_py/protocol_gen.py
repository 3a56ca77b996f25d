"""Writes what derives from the protocol table (nvshare_py/protocol_table.py), in a checkout:

- the message classes at the end of nvshare_py/protocol.py (between its `generated:` markers),
- interceptor/protocol_table.h (the C codec's X-macro lists),
- the message tables of docs/protocol.md (between its `generated:` markers).

    python -m nvshare_py.protocol_gen           rewrite the stale parts
    python -m nvshare_py.protocol_gen --check   list them and exit 1 if there are any

tests/test_protocol.py runs the check, so a table changed without this command fails the suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Callable, Final

from . import vocabulary
from .protocol_table import (
    MAX_DEVICES,
    MAX_FIELDS,
    MAX_INT,
    MAX_MESSAGE,
    MAX_VALUE,
    MESSAGES,
    NO_DEFAULT,
    SESSION_DIGITS,
    VERSION,
    Field,
    Kind,
    Message,
    Sender,
)

REPO: Final = Path(__file__).resolve().parent.parent
COMMAND: Final = "python -m nvshare_py.protocol_gen"
PYTHON_MODULE: Final = Path("nvshare_py/protocol.py")
C_HEADER: Final = Path("interceptor/protocol_table.h")
DOCS: Final = Path("docs/protocol.md")

_PYTHON_TYPES: Final = {
    Kind.DEVICE: "str", Kind.UINT: "int", Kind.TEXT: "str", Kind.SESSION: "str", Kind.DEVICES: "tuple[str, ...]",
    Kind.FLAG: "bool", Kind.WORD: "str", Kind.JSON: "str",
}
# Hand-written methods of one generated class (nvshare_py/protocol.py defines the base).
_PYTHON_BASES: Final = {"STATUS": "_StatusDocument"}


def _replace_between(text: str, name: str, start_prefix: str, end_prefix: str, body: str, where: Path) -> str:
    """`text` with the lines between the marker lines of `name` replaced by `body`."""
    start = f"{start_prefix}generated: {name}"
    end = f"{end_prefix}end of generated: {name}"
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines) if line.startswith(start)]
    finish = [i for i, line in enumerate(lines) if line.startswith(end)]
    if len(begin) != 1 or len(finish) != 1 or finish[0] < begin[0]:
        raise SystemExit(f"{where}: no single pair of markers '{start}' ... '{end}'")
    return "\n".join(lines[:begin[0] + 1] + body.split("\n") + lines[finish[0]:])


# --- Python ----------------------------------------------------------------------------------


def _python_default(f: Field) -> str:
    if f.default is NO_DEFAULT:
        return ""
    if isinstance(f.default, str):
        return f" = {json.dumps(f.default)}"  # the project's quotes
    return f" = {f.default!r}"


def _python_class(message: Message) -> str:
    base = _PYTHON_BASES.get(message.type, "Message")
    doc = textwrap.fill(message.doc, 100, initial_indent="    \"\"\"", subsequent_indent="    ") + "\"\"\""
    lines = ["@dataclass(frozen=True, slots=True)", f"class {message.python_name}({base}):", doc, "",
             f"    TYPE: ClassVar[str] = {json.dumps(message.type)}"]
    for f in message.fields:
        annotation = _PYTHON_TYPES[f.kind] + (" | None" if f.nullable else "")
        notes = [note for note in (f.doc.replace("`", ""), f.words and f"a word of vocabulary.{f.words.name.upper()}")
                 if note]
        comment = f"  # {'; '.join(notes)}" if notes else ""
        line = f"    {f.name}: {annotation}{_python_default(f)}"
        if len(line + comment) > 120:
            lines.append(f"    # {'; '.join(notes)}")
            comment = ""
        lines.append(line + comment)
    return "\n".join(lines)


def python_part() -> str:
    names = ", ".join(m.python_name for m in MESSAGES)
    classes = "\n\n\n".join(_python_class(m) for m in MESSAGES)
    listing = textwrap.fill(f"MESSAGE_CLASSES: Final[tuple[type[Message], ...]] = ({names})", 115,
                            subsequent_indent=" " * 52, break_on_hyphens=False)
    return f"\n\n{classes}\n\n\n{listing}\n\n"


# --- C ---------------------------------------------------------------------------------------


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _c_default(f: Field) -> str:
    """What an absent optional field reads as (0 or "" where that is all it can be)."""
    numeric = f.kind in (Kind.UINT, Kind.FLAG, Kind.DEVICES, Kind.JSON)
    if not f.optional or f.default is None or f.kind in (Kind.DEVICES, Kind.JSON):
        return "0" if numeric else '""'
    if isinstance(f.default, (bool, int)):
        return str(int(f.default))
    return _c_string(str(f.default))


def _c_presence(f: Field) -> str:
    return "NULLABLE" if f.nullable else "OPTIONAL" if f.optional else "REQUIRED"


def _c_detail(f: Field) -> str:
    if f.kind is Kind.WORD:
        assert f.words is not None
        return f.words.name
    if f.kind is Kind.TEXT and f.c_size:
        return str(f.c_size)
    if f.kind is Kind.JSON:
        return str(f.max_bytes)
    return "0"


def _c_members(messages: list[Message], reading: bool) -> list[str]:
    """The struct's members, each once: (storage, name, detail) in first-use order. A member
    shared by several messages must be stored alike in all of them."""
    members: dict[str, tuple[str, str]] = {}

    def add(storage: str, name: str, detail: str, where: str) -> None:
        if members.setdefault(name, (storage, detail)) != (storage, detail):
            raise SystemExit(f"{where}: C member {name} is already a {members[name]}, not {(storage, detail)}")

    for message in messages:
        for f in message.fields:
            where = f"{message.type}.{f.name}"
            if f.kind is Kind.JSON:
                continue  # read for its form and length, not kept
            if f.kind is Kind.WORD and reading:
                add("WORD_TEXT", f.c_member + "_text", "0", where)
                add("WORD_NUMBER", _c_detail(f), "0", where)
            else:
                add(f.kind.name, f.c_member, _c_detail(f) if f.kind is Kind.TEXT and reading else "0", where)
            if f.nullable:
                add("HAS", "has_" + f.c_member, "0", where)
    return [f"X({storage}, {name}, {detail})" for name, (storage, detail) in members.items()]


def _macro(name: str, parameters: str, items: list[str]) -> str:
    if not items:
        return f"#define {name}({parameters})"
    width = max(len(f"#define {name}({parameters})"), *(len("    " + item) for item in items)) + 1
    lines = [f"#define {name}({parameters})".ljust(width) + "\\"]
    lines += [("    " + item).ljust(width) + "\\" for item in items[:-1]]
    lines.append("    " + items[-1])
    return "\n".join(lines)


def c_header() -> str:
    readers = [m for m in MESSAGES if m.sender is Sender.SCHEDULER]
    writers = [m for m in MESSAGES if m.sender is Sender.CLIENT]
    word_fields = sum(f.kind is Kind.WORD for m in readers for f in m.fields)
    if word_fields > 64:
        raise SystemExit("more than 64 word fields in scheduler messages: struct nvs_msg's unknown_words "
                         "has a bit for each")

    def fields(messages: list[Message]) -> list[str]:
        return [f"F({m.type}, {f.name}, {f.kind.name}, {_c_presence(f)}, {f.c_member}, {_c_detail(f)}, {_c_default(f)})"
                for m in messages for f in m.fields]

    vocabularies = [v for v in vocabulary.VOCABULARIES
                    if any(f.words is v for m in MESSAGES for f in m.fields)]
    parts = [f"""/*
 * The client protocol as the C codec needs it: GENERATED from nvshare_py/protocol_table.py by
 * `{COMMAND}`. Edit the table, not this file: tests/test_protocol.py fails while
 * it is stale.
 *
 * X-macro lists, expanded by message.h (enum nvs_msg_type, the word enums, struct nvs_msg and
 * struct nvs_out) and message.c (the parser's and the builder's field tables):
 *
 *   NVS_<VOCABULARY>_WORDS(W)  W(CONSTANT, "word") for each word of a vocabulary, in order
 *   NVS_VOCABULARIES(V)        V(name, NAME) for each vocabulary a message uses
 *   NVS_SCHEDULER_MESSAGES(M)  M(TYPE) for each message the client reads
 *   NVS_CLIENT_MESSAGES(M)     M(TYPE) for each message the client writes
 *   NVS_SCHEDULER_FIELDS(F)    F(TYPE, key, KIND, PRESENCE, member, detail, default), in each
 *   NVS_CLIENT_FIELDS(F)       message's order
 *   NVS_SCHEDULER_MEMBERS(X)   X(STORAGE, member, detail): the members of struct nvs_msg
 *   NVS_CLIENT_MEMBERS(X)      X(STORAGE, member, detail): the members of struct nvs_out
 *
 * KIND: DEVICE UINT TEXT SESSION DEVICES FLAG WORD JSON (docs/protocol.md, Encoding).
 * PRESENCE: REQUIRED; OPTIONAL (absent, it reads as `default`, and a builder leaves it out
 * while it holds `default`); NULLABLE (absent, it says nothing: has_<member> is 0).
 * detail: a WORD's vocabulary, the bytes a TEXT keeps in struct nvs_msg (NUL included), the
 * byte limit of a JSON value; else 0. A WORD the parser reads is kept twice: its text in
 * <member>_text and its number in the member named after its vocabulary (0: unknown).
 */
#ifndef NVSHARE_PROTOCOL_TABLE_H
#define NVSHARE_PROTOCOL_TABLE_H

#define NVS_PROTOCOL_VERSION {VERSION}
#define NVS_MESSAGE_MAX {MAX_MESSAGE}
#define NVS_VALUE_MAX {MAX_VALUE}
#define NVS_FIELDS_MAX {MAX_FIELDS}
#define NVS_UINT_MAX {MAX_INT}ULL
#define NVS_DEVICES_MAX {MAX_DEVICES}
#define NVS_SESSION_DIGITS {SESSION_DIGITS}
#define NVS_DEVICE_ID_MAX {vocabulary.DEVICE_ID_MAX}
#define NVS_WORD_MAX {vocabulary.WORD_MAX}
#define NVS_TYPE_MAX 16"""]
    for v in vocabularies:
        items = [f"W(NVS_{v.name.upper()}_{word.upper().replace('-', '_')}, {_c_string(word)})" for word in v.words]
        parts.append(_macro(f"NVS_{v.name.upper()}_WORDS", "W", items))
    parts.append(_macro("NVS_VOCABULARIES", "V", [f"V({v.name}, {v.name.upper()})" for v in vocabularies]))
    parts.append(_macro("NVS_SCHEDULER_MESSAGES", "M", [f"M({m.type})" for m in readers]))
    parts.append(_macro("NVS_CLIENT_MESSAGES", "M", [f"M({m.type})" for m in writers]))
    parts.append(_macro("NVS_SCHEDULER_FIELDS", "F", fields(readers)))
    parts.append(_macro("NVS_CLIENT_FIELDS", "F", fields(writers)))
    parts.append(_macro("NVS_SCHEDULER_MEMBERS", "X", _c_members(readers, reading=True)))
    parts.append(_macro("NVS_CLIENT_MEMBERS", "X", _c_members(writers, reading=False)))
    parts.append("#endif\n")
    return "\n\n".join(parts)


# --- docs --------------------------------------------------------------------------------------


def _doc_field(f: Field) -> str:
    notes: list[str] = []
    if f.kind is Kind.WORD:
        assert f.words is not None
        notes.append(", ".join(f"`{word}`" for word in f.words.words))
    elif f.kind is not Kind.UINT and f.kind is not Kind.TEXT:
        notes.append(f.kind.value)
    if f.doc:
        notes.append(f.doc)
    if not f.optional:
        notes.insert(0, "req.")
    elif f.nullable:
        notes.append("absent: not said")
    elif f.default not in ("", (), False):
        notes.append(f"absent: `{f.default}`")
    return f"`{f.name}`" + (f" ({'; '.join(notes)})" if notes else "")


def docs_table(sender: Sender) -> str:
    rows = ["| type | fields | meaning |", "|---|---|---|"]
    for m in MESSAGES:
        if m.sender is sender:
            fields = ", ".join(_doc_field(f) for f in m.fields) or "—"
            rows.append(f"| `{m.type}` | {fields} | {m.doc} |")
    return "\n".join(rows)


def docs_words() -> str:
    rows = ["| vocabulary | word | meaning |", "|---|---|---|"]
    for v in vocabulary.VOCABULARIES:
        for word, meaning in v.meanings.items():
            rows.append(f"| {v.name.replace('_', ' ')} | `{word}` | {meaning} |")
    return "\n".join(rows)


# --- the parts -------------------------------------------------------------------------------


def _parts(root: Path) -> dict[Path, Callable[[str], str]]:
    """Each derived file and how to bring its text up to date."""
    return {
        PYTHON_MODULE: lambda text: _replace_between(text, "messages", "# ", "# ", python_part(), PYTHON_MODULE),
        C_HEADER: lambda text: c_header(),
        DOCS: lambda text: _replace_between(
            _replace_between(
                _replace_between(text, "client messages", "<!-- ", "<!-- ", docs_table(Sender.CLIENT), DOCS),
                "scheduler messages", "<!-- ", "<!-- ", docs_table(Sender.SCHEDULER), DOCS),
            "words", "<!-- ", "<!-- ", docs_words(), DOCS),
    }


def stale(root: Path = REPO) -> list[Path]:
    """The derived files whose text is not what the table gives."""
    out = []
    for path, update in _parts(root).items():
        current = (root / path).read_text() if (root / path).exists() else ""
        if update(current) != current:
            out.append(path)
    return out


def write(root: Path = REPO) -> list[Path]:
    written = []
    for path, update in _parts(root).items():
        target = root / path
        current = target.read_text() if target.exists() else ""
        wanted = update(current)
        if wanted != current:
            target.write_text(wanted)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="only list the stale parts; exit 1 if any")
    args = parser.parse_args(argv)
    if not (REPO / C_HEADER).parent.is_dir():
        print(f"{COMMAND} works in a checkout of nvshare_py (no {C_HEADER.parent}/ beside {REPO / 'nvshare_py'})",
              file=sys.stderr)
        return 2
    if args.check:
        parts = stale()
        for path in parts:
            print(f"{path} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if parts else 0
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
