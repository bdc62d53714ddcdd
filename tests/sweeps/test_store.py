"""The results store: one transaction per cell, concurrent writers, refusing another grid or version."""

import subprocess
import sys
import textwrap

import pytest
from helpers_sweeps import toy_cells

from attnkit.sweeps import Cell, LocalEngine, cell_hash, cell_seed, grid_hash, run_sweep
from attnkit.sweeps.store import Store


def test_hashes_and_seeds_come_from_the_config_alone():
    a, b = Cell("toy", {"x": 1, "y": [1, 2]}), Cell("toy", {"y": [1, 2], "x": 1})
    assert a.hash == b.hash == cell_hash("toy", {"x": 1, "y": [1, 2]}) and len(a.hash) == 16
    assert Cell("arena", {"x": 1, "y": [1, 2]}).hash != a.hash
    assert cell_seed({"x": 1}) == cell_seed({"x": 1}) != cell_seed({"x": 2})
    assert grid_hash([a, Cell("toy", {"x": 2})]) == grid_hash([Cell("toy", {"x": 2}), a])


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Cell("toy", {"f": object()}), "config: 'f' is not a JSON value"),
        (lambda: Cell("toy", {"nan": float("nan")}), "config: 'nan' is not a JSON value"),
        (lambda: Cell("", {}), "kind: expected a registered cell kind's name"),
        (lambda: run_sweep([], "x"), "cells: expected at least one cell"),
        (
            lambda: run_sweep([Cell("nope", {})], "x"),
            "kind: unknown cell kind 'nope'; registered: arena, kv_curve, organism, probe, toy",
        ),
        (lambda: run_sweep(toy_cells(1) * 2, "x"), "cells: 'toy 0' appears twice"),
        (lambda: run_sweep(toy_cells(1), "x", max_failures=-1), "max_failures: expected an int >= 0 or None, got -1"),
    ],
)
def test_bad_cells_are_refused_naming_the_argument(make, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        make()


def test_a_store_of_another_grid_or_version_is_refused_with_the_reason(tmp_path):
    out = str(tmp_path / "out")
    Store.open(out, grid_hash(toy_cells(2)), "0.1.0").close()
    with pytest.raises(
        ValueError, match=r"out: .*sweep.sqlite holds another grid \(grid hash [0-9a-f]{16}, this grid [0-9a-f]{16}\)"
    ):
        run_sweep(toy_cells(3), out, LocalEngine(workers=1))
    with pytest.raises(
        ValueError, match=r"out: .* was written by attnkit 0.1.0, this is 9.9: results of two versions are not comparable"
    ):
        Store.open(out, grid_hash(toy_cells(2)), "9.9")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "sweep.sqlite").write_text("not a database" * 100)
    with pytest.raises(ValueError, match="out: .* is not a sweep store"):
        Store.open(str(tmp_path / "junk"), "x")
    with pytest.raises(FileNotFoundError, match="DIR: no sweep store at"):
        Store.read(str(tmp_path / "nothing"))


WRITER = """
import os, sys, time
from attnkit.sweeps import Cell
from attnkit.sweeps.store import Store
grid, me, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cells = [Cell("toy", {"id": i}) for i in range(60)]
with Store.open(out, grid) as store:
    open(os.path.join(out, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(out, f"ready-{1 - me}")):  # both write at once from here
        time.sleep(0.01)
    for c in (cells if me == 0 else cells[::-1]):  # every cell by both writers, as two --rerun sweeps would
        store.record_done(c, [{"id": c.config["id"], "i": i, "writer": me} for i in range(5)], 0.0, replace=True)
"""


def test_two_writers_at_once_keep_every_cell_once(tmp_path):
    out = str(tmp_path / "out")
    grid = grid_hash([Cell("toy", {"id": i}) for i in range(60)])
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), grid, str(me), out]) for me in (0, 1)]
    assert [p.wait(120) for p in procs] == [0, 0]
    with Store.read(out) as store:
        rows = store.rows()
        assert store.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert len(store.cells()) == 60
    assert len(rows) == 300
    for i in range(60):  # one writer's rows per cell, never a mix of both
        mine = [r for r in rows if r["id"] == i]
        assert sorted(r["i"] for r in mine) == [0, 1, 2, 3, 4] and len({r["writer"] for r in mine}) == 1


def test_a_cell_finished_by_another_sweep_is_not_computed_again(tmp_path):
    out, log = str(tmp_path / "out"), tmp_path / "log"
    grid = toy_cells(3, log=str(log))
    with Store.open(out, grid_hash(grid)) as store:  # as if a second sweep on the same --out finished cell 1
        store.record_done(grid[1], [{"id": 1, "i": 0, "value": 0.5}], 0.1)
    result = run_sweep(grid, out, LocalEngine(workers=1))
    assert sorted(int(x) for x in log.read_text().split()) == [0, 2] and result.skipped == [grid[1].hash]


def test_rows_that_are_not_dicts_write_nothing(tmp_path):
    cell = toy_cells(1)[0]
    with Store.open(str(tmp_path / "out"), grid_hash([cell])) as store:
        with pytest.raises(ValueError, match="rows: a cell kind returns a list of dicts"):
            store.record_done(cell, [{"i": 0}, "not a row"], 0.1)
        assert store.rows() == [] and store.cells() == []
