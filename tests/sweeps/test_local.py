"""The local engine: worker processes, a worker killed mid-cell, failures, resume after a kill."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers_sweeps import ran, toy_cells

from attnkit.sweeps import Cell, LocalEngine, cells, load, run_sweep
from attnkit.sweeps.store import Store


@pytest.mark.parametrize("threads", [1, 2], ids=["forked workers", "fresh interpreters"])
def test_a_sweep_runs_every_cell_once_through_a_killed_worker_and_a_failure(tmp_path, threads):
    log, marker = tmp_path / "log", tmp_path / "died"
    grid = toy_cells(5, log=str(log))
    grid[2] = Cell("toy", {"id": 2, "log": str(log), "die_once": str(marker)})  # its worker dies mid-cell, once
    grid[3] = Cell("toy", {"id": 3, "log": str(log), "fail": "no such thing"})
    lines = []
    result = run_sweep(
        grid, str(tmp_path / "out"), LocalEngine(workers=2, threads=threads), on_status=lambda s: lines.append(s.line())
    )
    assert marker.exists()
    assert sorted(ran(log)) == [0, 1, 2, 2, 3, 4]  # cell 2 twice: once in the worker that died
    rows = load(str(tmp_path / "out"))
    by_cell = {}
    for row in rows:
        by_cell.setdefault(row["id"], []).append(row["i"])
    assert by_cell == {0: [0, 1], 1: [0, 1], 2: [0, 1], 4: [0, 1]}  # every finished cell's rows exactly once
    records = {c["config"]["id"]: c for c in cells(str(tmp_path / "out"))}
    assert records[2]["status"] == "done" and records[2]["attempts"] == 2
    assert records[3]["status"] == "failed" and records[3]["error"] == "RuntimeError: no such thing"
    assert "raise RuntimeError" in records[3]["traceback"]
    assert result.failed == [grid[3].hash] and len(result.computed) == 4 and not result.stopped
    assert any("worker died (exit code 3)" in line for line in lines)
    assert lines[-1].startswith("4/5 done, 0 running, 1 failed")


def test_max_failures_stops_the_sweep_the_next_run_goes_on_and_rerun_recomputes(tmp_path):
    out, log = str(tmp_path / "out"), tmp_path / "log"
    grid = [Cell("toy", {"id": i, "log": str(log), **({"fail": "bad"} if i < 2 else {})}) for i in range(5)]
    result = run_sweep(grid, out, LocalEngine(workers=1), max_failures=1)
    assert result.stopped and len(result.failed) == 2 and ran(log) == [0, 1]
    # The next run retries the failed cells and computes the rest.
    again = run_sweep(grid, out, LocalEngine(workers=1))
    assert ran(log) == [0, 1, 0, 1, 2, 3, 4] and len(again.computed) == 3 and len(again.failed) == 2
    first = sorted(load(out), key=lambda r: (r["cell"], r["i"]))
    # --rerun computes every cell again (here in another order, on 2 workers): the same rows, once each.
    rerun = run_sweep(grid[::-1], out, LocalEngine(workers=2), rerun=True)
    assert len(rerun.computed) == 3 and sorted(ran(log)[7:]) == [0, 1, 2, 3, 4]
    assert sorted(load(out), key=lambda r: (r["cell"], r["i"])) == first and len(first) == 6


SWEEP_SCRIPT = """
import sys
from helpers_sweeps import toy_cells
from attnkit.sweeps import LocalEngine, run_sweep
run_sweep(toy_cells(8, log=sys.argv[2], sleep_ms=400), sys.argv[1], LocalEngine(workers=1))
"""


def test_resume_after_the_sweep_is_killed_computes_only_what_was_missing(tmp_path):
    out, log = tmp_path / "out", tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    sweep = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SWEEP_SCRIPT), str(out), str(log)], env=env)
    try:
        deadline = time.monotonic() + 120
        done: set[str] = set()
        while len(done) < 3:
            assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended before it was killed"
            time.sleep(0.1)
            if (out / "sweep.sqlite").exists():
                with Store.read(str(out)) as store:
                    done = {h for h, s in store.status().items() if s == "done"}
        sweep.send_signal(signal.SIGKILL)  # no cleanup at all: the store must hold up by its transactions
    finally:
        sweep.kill()
        sweep.wait()
    with Store.read(str(out)) as store:
        done = {h for h, s in store.status().items() if s == "done"}
    assert 3 <= len(done) < 8
    first = len(ran(log))
    grid = toy_cells(8, log=str(log), sleep_ms=400)
    result = run_sweep(grid, str(out), LocalEngine(workers=1))
    missing = {c.hash for c in grid} - done
    assert set(result.computed) == missing and set(result.skipped) == done
    assert sorted(ran(log)[first:]) == sorted(int(c.config["id"]) for c in grid if c.hash in missing)
    rows = load(str(out))
    assert len(rows) == 16 and len({(r["cell"], r["i"]) for r in rows}) == 16  # each cell once


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(workers=0), "workers: expected a positive int, got 0"),
        (dict(workers=2, threads=0), "threads: expected a positive int or None, got 0"),
    ],
)
def test_engine_arguments_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        LocalEngine(**bad)
