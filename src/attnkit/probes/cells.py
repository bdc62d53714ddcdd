"""Probe grids as sweep cells (``attnkit.sweeps``): the ``probe`` cell kind runs one probe
call, ``{"probe": NAME, "model": PATH or organism, "params": {...}}``, and returns its
tidy rows, each with the call's parameters as columns, so a grid's rows from many cells
land in one store without losing which call made them.

    from attnkit.probes.cells import probe_cells
    from attnkit.sweeps import LocalEngine, run_sweep, load
    cells = probe_cells("needle", "needle-1k", {"lengths": [[512], [1024]], "samples": [10]})
    run_sweep(cells, "needle-grid", LocalEngine(workers=2))
"""

from __future__ import annotations

import itertools
import json
import os


def probe_cell(config: dict) -> list[dict]:
    """The ``probe`` cell kind: ``run(config["probe"], config["model"], **config["params"])``'s rows."""
    from . import run

    params = dict(config.get("params") or {})
    result = run(config["probe"], config["model"], **params)
    columns = {f"param_{k}": json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in params.items()}
    return [{**columns, **row} for row in result.rows]


def probe_cells(probe: str, model, grid: dict) -> list:
    """One cell per combination of ``grid``'s values (``{keyword: [value, ...]}``) for
    probe ``probe`` on ``model`` (a directory or an organism name: workers load it)."""
    from ..sweeps import Cell
    from . import PROBES

    if probe not in PROBES:
        raise ValueError(f"probe: unknown probe {probe!r}; expected one of {', '.join(PROBES)}")
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError("model: a sweep's workers load the model themselves: give a directory or an organism name")
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ValueError("grid: expected {keyword: [value, ...]} with at least one value per keyword")
    keys = list(grid)
    cells = []
    for values in itertools.product(*(grid[k] for k in keys)):
        params = dict(zip(keys, values))
        label = f"{probe} " + " ".join(f"{k}={v}" for k, v in params.items())
        cells.append(Cell("probe", {"probe": probe, "model": os.fspath(model), "params": params}, label=label))
    return cells


__all__ = ["probe_cell", "probe_cells"]
