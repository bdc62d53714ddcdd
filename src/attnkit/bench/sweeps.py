"""Sweep engines: wall time of a grid with 2 local workers against 1 (serial), and what the
local and Ray engines spend per cell beyond the cells' own work.

Speed-up: the same small arena cells (MQAR, one thread each) run by ``LocalEngine``
with 2 workers and with 1, alternately, each into a fresh store; medians over repeats.
The times include starting the workers, as a user's sweep pays it (with one thread each,
on Linux, forked from the bench's process; see sweeps/local.py). Target: ≤ 0.6× the serial time on a 2-core machine.

Overhead per cell: toy cells of known CPU work through an engine; overhead =
(sweep wall − Σ cell seconds / parallel slots) / cells — handing a cell out, getting
its rows back and the store's transaction, plus each engine's start (worker processes;
for Ray, tasks on an instance started beforehand, whose own start is in the note).
Target: under 1 s per cell (a 30 s cell should spend < 1 s in scheduling and storing).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from .harness import Row, run_steps

STEPS = 3


def _arena_cells(count: int, steps: int):
    from ..arena.tasks import make_task
    from ..sweeps.arena import arena_cells

    task = make_task("mqar", seq_len=16, num_kv_pairs=2, vocab_size=16)
    seeds = list(range(count // 2))
    return arena_cells(
        task,
        "softmax,linear_elu",
        [16],
        seeds=seeds,
        overrides={"steps": steps, "batch_size": 32, "eval_every": steps, "eval_examples": 64, "target_accuracy": None},
    )


def _wall(cells, engine) -> tuple[float, float]:
    """(seconds of the whole sweep, Σ seconds of its cells) into a fresh store."""
    from ..sweeps import run_sweep
    from ..sweeps.results import cells as records

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run_sweep(cells, out, engine)
        wall = time.perf_counter() - start
        return wall, sum(c["seconds"] or 0.0 for c in records(out))


def speedup(quick: bool) -> list[Row]:
    from ..sweeps import LocalEngine

    count, steps, repeats = (6, 15, 1) if quick else (16, 100, 3)
    cells = _arena_cells(count, steps)
    two: list[float] = []
    one: list[float] = []
    work_2: list[float] = []
    work_1: list[float] = []
    for _ in range(repeats):  # alternated, so a load change on the shared machine hits both
        for walls, work, workers in ((two, work_2, 2), (one, work_1, 1)):
            wall, cell_s = _wall(cells, LocalEngine(workers=workers, threads=1))
            walls.append(wall)
            work.append(cell_s)
    t2, t1 = statistics.median(two), statistics.median(one)
    # A cell that takes longer on 2 workers than on 1 says the machine had no second core to give.
    per_cell_2, per_cell_1 = (1e3 * statistics.median(w) / count for w in (work_2, work_1))
    return [
        Row(
            "sweeps",
            "local engine, 2 workers",
            f"{count} MQAR cells x {steps} steps",
            1e3 * t2,
            "local engine, 1 worker (serial)",
            1e3 * t1,
            "<= 0.6x",
            t2 <= 0.6 * t1,
            f"{repeats} repeats, 1 thread per worker; mean cell {per_cell_2:.0f} ms on 2 workers, {per_cell_1:.0f} ms on 1",
            {"walls_2": two, "walls_1": one, "cell_seconds_2": work_2, "cell_seconds_1": work_1},
        )
    ]


def overhead(quick: bool) -> list[Row]:
    from ..sweeps import Cell, LocalEngine, RayEngine

    count, work_ms = (6, 200) if quick else (16, 500)
    cells = [Cell("toy", {"id": i, "work_ms": work_ms, "bench": time.time_ns()}) for i in range(count)]
    rows = []
    wall, cell_s = _wall(cells, LocalEngine(workers=2, threads=1))
    per_cell = (wall - cell_s / 2) / count
    rows.append(
        Row(
            "sweeps",
            "local engine overhead per cell",
            f"{count} cells x {work_ms} ms",
            1e3 * per_cell,
            "none",
            None,
            "< 1000 ms",
            per_cell < 1.0,
            "2 workers; includes starting them",
        )
    )
    try:
        import ray
    except ImportError:
        return rows + [
            Row(
                "sweeps",
                "ray engine overhead per cell",
                "",
                None,
                "none",
                None,
                "< 1000 ms",
                None,
                "skipped: pip install 'attnkit[ray]'",
            )
        ]
    start = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    started = time.perf_counter() - start
    try:
        cells = [Cell("toy", {**c.config, "bench": time.time_ns()}) for c in cells]
        wall, cell_s = _wall(cells, RayEngine())
    finally:
        ray.shutdown()
    per_cell = (wall - cell_s / 2) / count
    rows.append(
        Row(
            "sweeps",
            "ray engine overhead per cell",
            f"{count} cells x {work_ms} ms",
            1e3 * per_cell,
            "none",
            None,
            "< 1000 ms",
            per_cell < 1.0,
            f"local Ray, 2 CPUs; its start: {started:.1f} s, not counted",
        )
    )
    return rows


def run(quick: bool = False, progress=None) -> list[Row]:
    return run_steps(
        [("local 2 workers vs serial", lambda: speedup(quick)), ("engine overhead per cell", lambda: overhead(quick))], progress
    )
