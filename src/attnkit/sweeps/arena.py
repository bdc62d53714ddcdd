"""The ``arena`` cell kind: one run of an arena grid (``attnkit.arena.runner.Run``) as a cell.

A cell's config names everything the run depends on — task and its parameters,
mechanism, width, layers, heads, seed, max_len, init, and the training settings — so
its hash changes when any of them does, and the run is the same wherever it executes
(the arena's batches, held-out examples and initialisation derive from the seed alone,
see arena/trainer.py). Its rows are the arena table's rows (``runner.COLUMNS`` plus the
per-group accuracies), one per evaluation length.
"""

from __future__ import annotations

from typing import Any, TypedDict

from ..arena.models import MechanismSpec
from ..arena.runner import Run, execute, plan
from ..arena.schedule import schedule_text
from ..arena.tasks import make_task
from .cells import Cell
from .kinds import report_line


class _Figure(TypedDict):
    """The keys of ``FIGURE``."""

    task: str
    task_params: dict[str, Any]
    mechanisms: str
    widths: list[int]
    seeds: int
    overrides: dict[str, Any]


#: ``attnkit arena sweep``'s default grid: the shape of Zoology's MQAR figure (Arora et
#: al., arXiv 2312.04927, Fig. 2: accuracy against model width, attention against
#: sub-quadratic mixers), shrunk to minutes on two cores: 16 tokens, 2 key-value pairs,
#: 16 symbols; softmax, linear attention with elu+1 features (Katharopoulos et al.,
#: arXiv 2006.16236), DeltaNet (arXiv 2406.06484), sigmoid (arXiv 2409.04431) and a causal
#: sliding window of 4 keys; widths 16-64, 2 seeds, at most 1000 steps of 64 examples
#: (stopping at 99% held-out accuracy).
FIGURE: _Figure = {
    "task": "mqar",
    "task_params": {"seq_len": 16, "num_kv_pairs": 2, "vocab_size": 16},
    "mechanisms": "softmax,linear_elu,deltanet,sigmoid,neighborhood:kernel=4:causal=true",
    "widths": [16, 32, 64],
    "seeds": 2,
    "overrides": {"steps": 1000, "batch_size": 64, "lr": 3e-3, "eval_every": 100, "eval_examples": 128, "target_accuracy": 0.99},
}


def figure_cells() -> list[Cell]:
    """The cells of ``FIGURE`` (what ``attnkit arena sweep`` runs with no grid options)."""
    task = make_task(FIGURE["task"], **FIGURE["task_params"])
    return arena_cells(
        task, FIGURE["mechanisms"], FIGURE["widths"], seeds=list(range(FIGURE["seeds"])), overrides=FIGURE["overrides"]
    )


def arena_cells(
    task,
    mechanisms,
    widths=(64,),
    layers: int | None = None,
    heads: int | None = None,
    seeds=(0,),
    seq_lens=None,
    overrides: dict | None = None,
    max_len: int | None = None,
    init: str | None = None,
) -> list[Cell]:
    """The cells of an arena grid, in ``plan``'s order (same arguments as ``run_grid``)."""
    runs = plan(task, mechanisms, widths, layers, heads, seeds, seq_lens, max_len, init)
    settings = {
        k: (schedule_text(v) if k == "schedule" and v is not None and not isinstance(v, str) else v)
        for k, v in (overrides or {}).items()
        if v is not None
    }
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    return [run_cell_of(run, settings) for run in runs]


def run_cell_of(run: Run, overrides: dict) -> Cell:
    task_params = {k: list(v) if isinstance(v, tuple) else v for k, v in run.task.params().items()}
    config = {
        "task": run.task.name,
        "task_params": task_params,
        "mechanism": run.mechanism.label,
        "d_model": run.d_model,
        "layers": run.layers,
        "heads": run.heads,
        "seed": run.seed,
        "max_len": run.max_len,
        "init": run.init,
        "overrides": overrides,
    }
    return Cell("arena", config, run.label)


def run_of(config: dict) -> Run:
    task = make_task(config["task"], **config["task_params"])
    return Run(
        task,
        MechanismSpec.parse(config["mechanism"]),
        config["d_model"],
        config["layers"],
        config["heads"],
        config["seed"],
        config.get("max_len"),
        config.get("init"),
    )


def run_cell(config: dict) -> list[dict]:
    """Train the cell's run; its rows (``groups``: accuracy by group, e.g. MQAR pairs)."""
    run = run_of(config)

    def on_eval(record):
        report_line(f"step {record['step']} acc {record['accuracy']:.3f}")

    rows, _ = execute(run, config.get("overrides") or {}, on_eval=on_eval)
    return [{k: v for k, v in row.items() if k != "finished"} for row in rows]
