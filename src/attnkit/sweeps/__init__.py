"""Sweeps: a grid as independent cells, run by an engine, into one resumable results store.

    from attnkit.sweeps import Cell, LocalEngine, run_sweep, load
    cells = [Cell("toy", {"id": i, "work_ms": 50}) for i in range(8)]
    run_sweep(cells, "sweep-out", LocalEngine(workers=2))
    rows = load("sweep-out")                      # tidy rows, each with its cell hash

- ``cells.py`` — a cell is a kind and a JSON config, named by its content hash; a grid's
  hash covers its cells; seeds come from the config (``cell_seed``), so a cell gives the
  same numbers on any node.
- ``kinds.py`` — the registry of cell kinds, ``register_cell_kind(name, fn)`` with
  ``fn(config: dict) -> list[dict]`` (tidy rows). Built in: ``arena`` (one arena run,
  arena.py) and ``toy`` (tests, bench). A new kind is one top-level function and one line,
  e.g. for KV curves and probes::

      def kv_curve_cell(config):          # {"model": ..., "policy": ..., "budget": ...}
          result = ...                    # a ProbeResult, or the curve's rows
          return result.rows
      register_cell_kind("kv_curve", kv_curve_cell)
      cells = [Cell("kv_curve", {"policy": p, "budget": b}) for p in policies for b in budgets]

  The function must be importable by name (workers and Ray nodes import it), so
  register it in the module that defines it and import that module before the sweep.
  ``report_line(text)`` inside it shows a line on the sweep's progress line.
- ``local.py`` — ``LocalEngine(workers, threads)``: worker processes (spawn) on this
  machine, threads per worker = cores // workers; a worker that dies mid-cell is
  replaced and its cell given again.
- ``on_ray.py`` — ``RayEngine(address, connect_timeout)``: cells as Ray tasks; a local
  Ray instance when no address, or a cluster (``auto``, ``host:port``, ``ray://host:port``)
  reached within the timeout or refused naming the address. Needs ``attnkit[ray]``.
- ``store.py`` — SQLite (WAL, one transaction per finished cell): cells with status,
  error, traceback, seconds, attnkit version and grid hash; rows keyed by cell hash. A
  store of another version or grid is refused with the reason.
- ``run.py`` — ``run_sweep(cells, out, engine, rerun, max_failures, on_status)``: skips
  finished cells (resume), records failures and goes on, reports progress.
- ``results.py`` — ``load``, ``load_frame`` (pandas), ``cells``, CSV and text tables
  (``attnkit results DIR``).

Nothing here schedules work across machines by itself: across machines is Ray's job.
"""

from .cells import Cell, cell_hash, cell_seed, grid_hash
from .kinds import cell_function, cell_kinds, register_cell_kind, report_line
from .local import LocalEngine
from .on_ray import RayEngine
from .results import cells, load, load_frame
from .run import SweepResult, SweepStatus, run_sweep

__all__ = [
    "Cell",
    "LocalEngine",
    "RayEngine",
    "SweepResult",
    "SweepStatus",
    "cell_function",
    "cell_hash",
    "cell_kinds",
    "cell_seed",
    "cells",
    "grid_hash",
    "load",
    "load_frame",
    "register_cell_kind",
    "report_line",
    "run_sweep",
]
