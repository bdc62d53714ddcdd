"""The ``toy`` cell kind: a cell that costs what its config says, for tests and the bench.

Config keys (all optional): ``work_ms`` — milliseconds of real CPU work (float32 matmuls,
one thread), ``sleep_ms`` — milliseconds of waiting, ``fail`` — raise ``RuntimeError``
with this text, ``die_once`` — a file path: the first run of the cell creates it and kills
its own process (``os._exit``), as a worker lost mid-cell would be, and later runs go on;
``log`` — a file path each run appends the cell's ``id`` to (which cells ran, how often).
Its rows: one per ``rows`` (default 2), ``{"id", "i", "value"}`` with ``value`` from
``cell_seed(config)``, so the same config gives the same rows on any node.
"""

from __future__ import annotations

import os
import time

from .cells import cell_seed
from .kinds import report_line


def burn(ms: float) -> None:
    """About ``ms`` milliseconds of one-thread matmuls."""
    import torch

    a = torch.randn(96, 96)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def run_cell(config: dict) -> list[dict]:
    cell_id = config.get("id", 0)
    if config.get("log"):
        with open(config["log"], "a") as f:
            f.write(f"{cell_id}\n")
    report_line(f"toy {cell_id} running")
    if config.get("die_once") and not os.path.exists(config["die_once"]):
        open(config["die_once"], "w").close()
        os._exit(3)
    if config.get("sleep_ms"):
        time.sleep(config["sleep_ms"] / 1000)
    if config.get("work_ms"):
        burn(config["work_ms"])
    if config.get("fail"):
        raise RuntimeError(config["fail"])
    seed = cell_seed(config)
    return [{"id": cell_id, "i": i, "value": (seed >> (8 * i)) % 1000 / 1000} for i in range(config.get("rows", 2))]
