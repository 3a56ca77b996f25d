"""What every nvshare command line shares: `-h`/`--help`, `--version`, one-line errors.

Each tool builds its typer app with `typer.Typer(**APP_SETTINGS, ...)` and gives its top-level
callback (or its single command) a `version: bool = VERSION_OPTION` parameter.
"""

from __future__ import annotations

import sys

import typer

from . import __version__

APP_SETTINGS = {
    "add_completion": False,
    "context_settings": {"help_option_names": ["-h", "--help"]},
    # Plain help: typer's rich help shows every flag as "--fail-open <bool>", which reads as an
    # option taking a value (and `--fail-open true CMD` then runs the command `true`).
    "rich_markup_mode": None,
}


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
