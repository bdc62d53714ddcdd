"""Building an organism: its recipe's arena runs in order, the last one exported, measured
and carded.

Each stage runs as ``attnkit arena`` would (``runner.execute`` with the stage's settings,
checkpoints in a work folder, exported by ``export.export_run``), starting from the
export of the stage before. Training is deterministic given the recipe's seed, and runs
on one thread (the models are tiny: a second thread only waits). The result is a folder
with the transformers export and its card (cards.py), written under a temporary name and
renamed, so a build cut off leaves no half-written organism.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from ..arena.export import TASK_FILE, export_run
from ..arena.runner import execute, plan, train_config
from ..arena.schedule import all_lengths, as_stages
from ..arena.tasks import make_task
from ..kernels.machine import cpu_name, machine_info
from .cards import make_card
from .evaluate import measure
from .recipes import Recipe
from .store import CARD_FILE


def run_stages(recipe: Recipe, work_dir: str, on_eval=None) -> tuple[str, list[dict]]:
    """Train every stage of ``recipe`` under ``work_dir``; returns (the last stage's export
    directory, per-stage records). ``on_eval(stage, record, config)`` after each evaluation."""
    previous: str | None = None
    stages: list[dict[str, Any]] = []
    for stage in recipe.stages:
        task = make_task(stage.task, **stage.params)
        [run] = plan(
            task,
            recipe.mechanism,
            [recipe.d_model],
            recipe.layers,
            recipe.heads,
            [recipe.seed],
            max_len=stage.max_len,
            init=previous,
        )
        config = train_config(task, recipe.seed, stage.train)
        hook = None if on_eval is None else (lambda record, stage=stage, config=config: on_eval(stage, record, config))
        folder = os.path.join(work_dir, stage.name)
        rows, record = execute(run, dict(stage.train), os.path.join(folder, "checkpoints"), on_eval=hook)
        directory = export_run(run, record, rows, dict(stage.train), os.path.join(folder, "export"))
        _name_the_init(directory, stages[-1]["name"] if stages else None)
        stages.append(
            {
                "name": stage.name,
                "task": stage.task,
                "steps": rows[0]["steps"],
                "seconds": round(rows[0]["train_seconds"], 1),
                "best_step": record.get("best_step"),
                "stopped_early": rows[0]["stopped_early"],
                "accuracy": {str(r["eval_len"]): round(r["accuracy"], 4) for r in rows},
            }
        )
        previous = directory
    assert previous is not None  # a recipe has stages
    return previous, stages


def _name_the_init(directory: str, previous: str | None) -> None:
    """task.json's warm start names the stage it came from, not the build's work folder."""
    path = os.path.join(directory, TASK_FILE)
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    init = record.get("training", {}).get("init")
    if init:
        init["init"] = f"stage {previous}"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def build(recipe: Recipe, out_dir: str, work_dir: str | None = None, on_eval=None, on_measure=None) -> dict:
    """Build ``recipe`` into ``out_dir`` (the export and its card.json); returns the card.
    ``work_dir`` keeps the stages' runs (default: a temporary folder, removed after)."""
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    own_work = work_dir is None
    work_dir = tempfile.mkdtemp(prefix=f"attnkit-{recipe.name}-") if work_dir is None else work_dir
    out_dir = os.path.normpath(out_dir)
    staging = out_dir + ".building"
    try:
        final, stages = run_stages(recipe, work_dir, on_eval)
        trained = time.perf_counter() - started
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(final, staging)
        if on_measure is not None:
            on_measure(recipe)
        measuring = time.perf_counter()
        accuracy = measure(staging, recipe.card_lengths, recipe.card_examples)
        task = make_task(recipe.stages[-1].task, **recipe.stages[-1].params)
        with open(os.path.join(staging, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        model_info = {
            "architecture": "LlamaForCausalLM",
            "mechanism": recipe.mechanism,
            "d_model": recipe.d_model,
            "layers": recipe.layers,
            "heads": recipe.heads,
            "max_len": config["max_position_embeddings"],
            "vocab_size": config["vocab_size"],
            "parameters": _parameters(staging),
            "trained_up_to": trained_up_to(recipe),
        }
        training = {
            "steps": sum(s["steps"] for s in stages),
            "seconds": round(sum(s["seconds"] for s in stages), 1),
            "wall_seconds": round(trained, 1),
            "card_seconds": round(time.perf_counter() - measuring, 1),
            "stages": stages,
        }
        machine = {**machine_info(), "cpu": cpu_name(), "threads_used": 1}
        card = json.loads(json.dumps(make_card(recipe, task, model_info, accuracy, training, machine, staging)))
        with open(os.path.join(staging, CARD_FILE), "w", encoding="utf-8") as f:
            json.dump(card, f, indent=1)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
        return card
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(staging, ignore_errors=True)
        if own_work:
            shutil.rmtree(work_dir, ignore_errors=True)


def trained_up_to(recipe: Recipe) -> int:
    """The longest length the last stage trains at (its schedule's, else its task's)."""
    last = recipe.stages[-1]
    schedule = as_stages(last.train.get("schedule"))
    return max(all_lengths(schedule)) if schedule else make_task(last.task, **last.params).seq_len


def _parameters(directory: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def compare(card: dict, reference: dict) -> dict:
    """How far ``card`` lands from ``reference`` (e.g. a rebuild against the shipped card):
    per length and group, the difference in accuracy, and the largest."""
    diffs = {}
    for n, entry in reference["accuracy"].items():
        mine = card["accuracy"].get(n)
        if mine is None:
            continue
        cells = {"all": mine["accuracy"] - entry["accuracy"]}
        cells.update({g: mine["groups"][g] - a for g, a in entry["groups"].items() if g in mine["groups"]})
        diffs[n] = {k: round(v, 4) for k, v in cells.items()}
    largest = max((abs(v) for cells in diffs.values() for v in cells.values()), default=0.0)
    return {"differences": diffs, "largest": largest}


__all__ = ["build", "compare", "run_stages"]
