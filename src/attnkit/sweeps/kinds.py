"""The registry of cell kinds: a name -> a function ``fn(config: dict) -> list[dict]`` of tidy rows.

A kind's function must be importable by its module and name (a top-level function of
a module, not a lambda or a closure): the engines send it to worker processes and Ray
nodes by reference, and the worker imports it there. Built-in kinds are named lazily as
``"module:function"`` so that registering them imports nothing heavy; a user's kind is
registered with the function itself:

    from attnkit.sweeps import register_cell_kind
    register_cell_kind("kv_curve", kv_curve_cell)     # kv_curve_cell(config) -> rows

``report_line(text)`` inside a kind's function shows ``text`` as the cell's last line on
the sweep's progress line (local engine; elsewhere it is dropped).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

CellFn = Callable[[dict], list]

_KINDS: dict[str, CellFn | str] = {
    "arena": "attnkit.sweeps.arena:run_cell",
    "kv_curve": "attnkit.probes.kv_curves:kv_curve_cell",
    "probe": "attnkit.probes.cells:probe_cell",
    "organism": "attnkit.organisms.cells:organism_cell",
    "toy": "attnkit.sweeps.toy:run_cell",
}


def register_cell_kind(name: str, fn: CellFn | str, replace: bool = False) -> None:
    """Register ``fn`` (a function or ``"module:function"``) as the cell kind ``name``.
    A second registration of a name under another function is refused unless ``replace``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected an identifier such as 'kv_curve', got {name!r}")
    if isinstance(fn, str):
        if fn.count(":") != 1:
            raise ValueError(f"fn: expected a function or 'module:function', got {fn!r}")
    elif not callable(fn) or "<" in getattr(fn, "__qualname__", "<"):  # <lambda>, <locals>
        raise ValueError(f"fn: expected a top-level function (workers import it by name), got {fn!r}")
    old = _KINDS.get(name)
    if old is not None and old is not fn and old != fn and not replace:
        raise ValueError(f"name: the cell kind {name!r} is registered already (to {_describe(old)}); pass replace=True")
    _KINDS[name] = fn


def cell_kinds() -> list[str]:
    return sorted(_KINDS)


def cell_function(name: str) -> CellFn:
    """The function of the cell kind ``name`` (imported now for a lazy one)."""
    if name not in _KINDS:
        raise ValueError(f"kind: unknown cell kind {name!r}; registered: {', '.join(cell_kinds())}")
    fn = _KINDS[name]
    if isinstance(fn, str):
        module, attr = fn.split(":")
        fn = getattr(importlib.import_module(module), attr)
    return fn


def _describe(fn) -> str:
    return fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"


# -- the last line of the running cell ---------------------------------------------------------

_reporter: Callable[[str], None] | None = None


def report_line(text: str) -> None:
    """Show ``text`` as the running cell's last line (a no-op outside a local worker)."""
    if _reporter is not None:
        _reporter(str(text))


def set_reporter(fn: Callable[[str], None] | None) -> None:
    """Where ``report_line`` sends lines in this process (the engines set it)."""
    global _reporter
    _reporter = fn
