"""Grids of training runs — mechanism × width × sequence length × seed — and their table.

Every run of a grid sees the same data for the same seed (batches and held-out examples
depend only on the seed, the step and the length), and its model is initialised from
the seed, so runs differ only by what the grid varies. A run yields one row per
evaluation length (the needle task tests at 1×, 2× and 4× its training length):

    task, mechanism, d_model, layers, heads, seed, seq_len, eval_len, accuracy,
    eval_loss, steps, stopped_early, train_seconds, tokens_per_s, params

written as CSV, and as JSON together with the per-group accuracies (e.g. MQAR by number
of pairs, needle by depth), each run's learning curve, the settings and the machine.

A run may start from another model's weights (``init``, see warm_start.py) and be built
for a longer context than its task's (``max_len``: default the longest length it trains
or is evaluated at), which is how a 32-token model becomes a 1024-token one.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, replace

import torch

from ..kernels.machine import machine_info
from .models import MechanismSpec, build_model, parse_mechanisms
from .schedule import all_lengths, schedule_text
from .tasks import Task
from .trainer import Evaluation, TrainConfig, Trainer, best_path, stream_seed
from .warm_start import warm_start

COLUMNS = (
    "task",
    "mechanism",
    "d_model",
    "layers",
    "heads",
    "seed",
    "seq_len",
    "eval_len",
    "accuracy",
    "eval_loss",
    "steps",
    "stopped_early",
    "train_seconds",
    "tokens_per_s",
    "params",
)


@dataclass(frozen=True)
class Run:
    """One cell of a grid."""

    task: Task
    mechanism: MechanismSpec
    d_model: int
    layers: int
    heads: int
    seed: int
    max_len: int | None = None
    init: str | None = None

    @property
    def label(self) -> str:
        return f"{self.mechanism.label} d={self.d_model} L={self.layers} N={self.task.seq_len} seed={self.seed}"

    @property
    def file_stem(self) -> str:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in self.mechanism.label)
        return f"{self.task.name}-{safe}-d{self.d_model}-L{self.layers}-h{self.heads}-N{self.task.seq_len}-s{self.seed}"


def plan(
    task: Task,
    mechanisms,
    widths=(64,),
    layers: int | None = None,
    heads: int | None = None,
    seeds=(0,),
    seq_lens=None,
    max_len: int | None = None,
    init: str | None = None,
) -> list[Run]:
    """The runs of a grid, in order (mechanism outermost, so a table fills row by row);
    ``max_len`` and ``init`` (a warm start's weights) are the same for every run."""
    specs = parse_mechanisms(mechanisms)
    layers = (task.fixed_layers or 2) if layers is None else layers
    heads = task.default_heads if heads is None else heads
    for name, values in (("widths", widths), ("seeds", seeds)):
        if not values:
            raise ValueError(f"{name}: expected at least one value")
    for d in widths:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d % heads:
            raise ValueError(f"widths: each must be a positive multiple of heads={heads}, got {d!r}")
    tasks = [task] if not seq_lens else [replace(task, seq_len=n) for n in seq_lens]
    return [
        Run(t, spec, d, layers, heads, seed, max_len, init) for spec in specs for t in tasks for d in widths for seed in seeds
    ]


def train_config(task: Task, seed: int, overrides: dict | None = None) -> TrainConfig:
    """TrainConfig defaults, then the task's own (``task.train_defaults``), then ``overrides``."""
    settings = {**task.train_defaults, **{k: v for k, v in (overrides or {}).items() if v is not None}, "seed": seed}
    return TrainConfig(**settings)


def run_lengths(task: Task, config: TrainConfig) -> tuple[int, ...]:
    """Every length a run trains or is evaluated at, ascending."""
    lengths = {task.seq_len, *task.eval_lengths(), *(config.eval_lengths or ())}
    return tuple(sorted(lengths | set(all_lengths(config.schedule or ()))))


def check_lengths(task: Task, config: TrainConfig, max_len: int | None) -> int:
    """The model's max_len for this run (``max_len``, else the longest length it meets),
    after checking every schedule and evaluation length fits the task and max_len."""
    for option, lengths in (("schedule", all_lengths(config.schedule or ())), ("eval_lengths", config.eval_lengths or ())):
        for n in lengths:
            try:
                replace(task, seq_len=n)
            except ValueError as e:
                raise ValueError(f"{option}: length {n} does not fit the {task.name} task: {e}") from None
    longest = max(run_lengths(task, config))
    if max_len is None:
        return longest
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < longest:
        raise ValueError(
            f"max_len: expected an int >= {longest} (the longest length the run trains or is evaluated at), got {max_len!r}"
        )
    return max_len


def execute(
    run: Run,
    overrides: dict | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    on_eval=None,
    on_snapshot=None,
) -> tuple[list[dict], dict]:
    """Train one run; returns (its rows, its record with the learning curve).
    ``on_snapshot(model, rows, record)``: after each evaluation whose weights the run
    would end on now (see ``Trainer.fit``), with the rows and record so far."""
    config = train_config(run.task, run.seed, overrides)
    max_len = check_lengths(run.task, config, run.max_len)
    torch.manual_seed(stream_seed(run.seed, "model", 0))
    model = build_model(run.task, run.mechanism, run.d_model, run.layers, run.heads, max_len)
    init = warm_start(model, run.init) if run.init else None
    trainer = Trainer(model, run.task, config)
    path = None
    if checkpoint_dir:
        os.makedirs(checkpoint_dir, exist_ok=True)
        path = os.path.join(checkpoint_dir, run.file_stem + ".safetensors")
        if resume and os.path.exists(path):
            trainer.resume(path)
    params = sum(p.numel() for p in model.parameters())
    base = {
        "task": run.task.name,
        "mechanism": run.mechanism.label,
        "d_model": run.d_model,
        "layers": run.layers,
        "heads": run.heads,
        "seed": run.seed,
        "seq_len": run.task.seq_len,
    }
    record = {
        **base,
        "mechanism_name": run.mechanism.name,
        "mechanism_params": run.mechanism.params,
        "config": asdict(config),
        "max_len": max_len,
        "init": init,
        "schedule": schedule_text(config.schedule) if config.schedule else None,
        "checkpoint": path,
        "best_checkpoint": best_path(path) if path and config.keep_best else None,
        "history": trainer.history,
    }

    def rows_of(evaluations, steps, seconds, rate, finished):
        return [
            {
                **base,
                "eval_len": ev.length,
                "accuracy": ev.accuracy,
                "eval_loss": ev.loss,
                "steps": steps,
                "stopped_early": trainer.stopped_early,
                "train_seconds": seconds,
                "tokens_per_s": rate,
                "params": params,
                "groups": ev.groups,
                "finished": finished,
            }
            for ev in evaluations
        ]

    def snapshot(model, latest):
        if on_snapshot is not None:
            evaluations = [_evaluation(n, entry) for n, entry in latest["lengths"].items()]
            rate = trainer.tokens / trainer.train_seconds if trainer.train_seconds > 0 else 0.0
            on_snapshot(model, rows_of(evaluations, latest["step"], latest["seconds"], rate, False), record)

    result = trainer.fit(on_eval=on_eval, checkpoint_path=path, on_snapshot=snapshot)
    rows = rows_of(result.evaluations, result.steps, result.train_seconds, result.tokens_per_s, True)
    record.update(history=result.history, best_step=result.best_step, best_score=result.best_score)
    return rows, record


def _evaluation(length: str, entry: dict) -> Evaluation:
    return Evaluation(int(length), entry["accuracy"], entry["loss"], 0, entry["groups"])


@torch.no_grad()
def check(runs: list[Run]) -> None:
    """Fail before training rather than hours into a grid: every mechanism of the grid
    builds and reads two examples of its task (smallest width, each sequence length)."""
    tried = set()
    for run in sorted(runs, key=lambda r: r.d_model):
        key = (run.mechanism.label, run.task.seq_len)
        if key in tried:
            continue
        tried.add(key)
        try:
            model = build_model(run.task, run.mechanism, run.d_model, run.layers, run.heads, run.max_len)
            model(run.task.sample(2, torch.Generator().manual_seed(0)).inputs)
        except ValueError as e:
            raise ValueError(f"mechanisms: {run.mechanism.label} cannot run the {run.task.name} task: {e}") from None


def run_grid(
    task: Task,
    mechanisms,
    widths=(64,),
    layers: int | None = None,
    heads: int | None = None,
    seeds=(0,),
    seq_lens=None,
    overrides: dict | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    on_eval=None,
    on_run=None,
    max_len: int | None = None,
    init: str | None = None,
    on_snapshot=None,
) -> tuple[list[dict], list[dict]]:
    """Train every run of the grid; returns (rows, run records).

    ``overrides``: TrainConfig fields (None values ignored). ``on_eval(run, record)`` after
    each evaluation, ``on_run(run, rows)`` after each run (progress reporting),
    ``on_snapshot(run, model, rows, record)`` whenever a run's current weights are what it
    would end on (writing results and exports as the run goes)."""
    runs = plan(task, mechanisms, widths, layers, heads, seeds, seq_lens, max_len, init)
    for run in runs:
        check_lengths(run.task, train_config(run.task, run.seed, overrides), run.max_len)
    check(runs)
    rows, records = [], []
    for run in runs:
        hook = None if on_eval is None else (lambda record, run=run: on_eval(run, record))
        snap = None if on_snapshot is None else (lambda model, r, rec, run=run: on_snapshot(run, model, r, rec))
        run_rows, record = execute(run, overrides, checkpoint_dir, resume, hook, snap)
        rows += run_rows
        records.append(record)
        if on_run is not None:
            on_run(run, run_rows)
    return rows, records


# ---------------------------------------------------------------- files


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: list[dict], records: list[dict], meta: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"meta": {**meta, **machine_info()}, "rows": rows, "runs": records}, f, indent=1)


def format_table(rows: list[dict]) -> str:
    """Mean accuracy over seeds (min–max) per mechanism, width and evaluation length."""
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["mechanism"], row["d_model"], row["seq_len"], row["eval_len"]), []).append(row)
    header = f"{'mechanism':<24} {'d_model':>7} {'N':>5} {'eval N':>6} {'accuracy':>9} {'min-max':>13} {'steps':>6} {'tok/s':>8}"
    lines = [header, "-" * len(header)]
    for (mech, d, n, m), group in cells.items():
        acc = [r["accuracy"] for r in group]
        steps = sum(r["steps"] for r in group) / len(group)
        rate = sum(r["tokens_per_s"] for r in group) / len(group)
        spread = f"{min(acc):.3f}-{max(acc):.3f}" if len(acc) > 1 else ""
        lines.append(f"{mech:<24} {d:>7} {n:>5} {m:>6} {sum(acc) / len(acc):>9.3f} {spread:>13} {steps:>6.0f} {rate:>8.0f}")
    return "\n".join(lines)
