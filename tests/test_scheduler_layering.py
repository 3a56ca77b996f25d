"""The scheduler's modules import each other one way, and its lock core stays pure: everything
core.py reaches imports no clock, no I/O and no sockets, only the protocol's words and a few
computing modules of the standard library (docs/architecture.md, "The lock core's files")."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parents[1] / "nvshare_py" / "scheduler"

# What the core's modules may import from outside nvshare_py.scheduler.
PURE_IMPORTS = {"__future__", "collections", "dataclasses", "heapq", "itertools", "json", "math", "random",
                "typing", "nvshare_py.protocol", "nvshare_py.vocabulary"}


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(the scheduler's modules, the other modules) that `path` imports, anywhere in it."""
    own: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            other.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                other.add(node.module or "")
            elif node.level == 1:
                own.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
            else:  # from .. import protocol, from ..vocabulary import ...
                base = "nvshare_py"
                other.update([f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names])
    return own, other


def graph() -> dict[str, tuple[set[str], set[str]]]:
    return {path.stem: imports(path) for path in sorted(SCHEDULER.glob("*.py"))}


def test_the_scheduler_modules_import_each_other_without_a_circle():
    modules = graph()
    order = list(graphlib.TopologicalSorter({name: own for name, (own, _) in modules.items()}).static_order())
    # The entry point is above the lock, the lock above what it calls back through LockRules.
    assert order.index("turns") < order.index("lock") < order.index("core")
    assert order.index("swapping") < order.index("lock")
    assert order.index("lock") < order.index("control_requests") < order.index("core")


def test_everything_the_lock_core_reaches_is_pure():
    modules = graph()
    reached, todo = set(), ["core"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(modules[name][0])
    assert {"lock", "turns", "swapping", "admitting", "control_requests", "registry", "records"} <= reached
    impure = {name: other - PURE_IMPORTS for name, (own, other) in modules.items()
              if name in reached and other - PURE_IMPORTS}
    assert not impure, f"the lock core imports what is not pure: {impure}"
    # Nor does it reach the daemon's rooms (sockets, logs, metrics, what the daemon shows).
    assert not reached & {"daemon", "connections", "zmtp", "logs", "metrics", "views", "control", "runtime"}
