"""An arena grid as cells: each cell's JSON config rebuilds its run, with the rows run_grid gives."""

import pytest
import torch
from helpers_sweeps import comparable

from attnkit.arena import make_task, run_grid
from attnkit.sweeps.arena import FIGURE, arena_cells, figure_cells, run_cell


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cells_give_run_grids_rows():
    task = make_task("mqar", seq_len=16, num_kv_pairs=2, vocab_size=16)
    overrides = {"steps": 4, "batch_size": 4, "eval_every": 2, "eval_examples": 8, "schedule": None}
    grid = dict(mechanisms="softmax,neighborhood:kernel=4:causal=true", widths=[8], layers=1, heads=2, seeds=[0, 1])
    cells = arena_cells(task, overrides=overrides, **grid)
    assert len(cells) == 4 and len({c.hash for c in cells}) == 4
    assert cells[0].label == "softmax d=8 L=1 N=16 seed=0"
    rows, _ = run_grid(task, overrides=overrides, **grid)
    from_cells = [row for cell in cells for row in run_cell(cell.config)]
    drop = ("cell", "train_seconds", "tokens_per_s", "finished")
    assert comparable(from_cells, drop) == comparable(rows, drop)


def test_the_figure_grid_is_zoologys_shape():
    cells = figure_cells()
    mechanisms = {c.config["mechanism"] for c in cells}
    assert mechanisms == set(FIGURE["mechanisms"].split(",")) and len(mechanisms) == 5
    assert {c.config["d_model"] for c in cells} == {16, 32, 64} and {c.config["seed"] for c in cells} == {0, 1}
    assert all(c.config["task"] == "mqar" for c in cells) and len(cells) == 30
