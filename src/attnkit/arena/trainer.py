"""A small, deterministic trainer for the arena's tasks.

AdamW (Loshchilov & Hutter, arXiv 1711.05101) with linear warm-up and a cosine decay
(Loshchilov & Hutter, arXiv 1608.03983), gradient clipping, evaluation on held-out
examples every ``eval_every`` steps, an early stop once the held-out accuracy reaches
``target_accuracy``, and checkpoints (safetensors, see checkpoint.py) that resume to the
same weights an uninterrupted run reaches.

Determinism: the batch of step ``t`` is drawn from a generator seeded by (seed, "train",
t) and the held-out set from (seed, "eval", length), so the data do not depend on what
ran before — a resumed run sees exactly the batches the uninterrupted one would.
Throughput is the tokens (batch × positions) of the optimisation steps over the seconds
they took, data generation and evaluation excluded.

Curricula and model selection (what grows a long-context model, see schedule.py):
``schedule`` trains in stages of their own lengths (each with its own warm-up and
cosine, as runs chained by warm starts would have), the batch of step ``t`` drawn at the
length the schedule gives it; ``eval_lengths`` are the lengths every evaluation measures
(default: the training length, or the last stage's lengths with a schedule); the
evaluation's ``score`` is what early stopping and the best checkpoint go by:
``criterion="accuracy"`` the lowest accuracy over the evaluated lengths,
``criterion="cell"`` the lowest over every length × group cell (needle: each depth at
each length), so a model that fails at one depth of one length does not look done.
``keep_best`` ends the run on the weights of its best-scoring evaluation (later
evaluations win ties: they trained longer).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from .checkpoint import load_checkpoint, load_checkpoint_meta, load_weights, save_checkpoint
from .schedule import Stage, as_stages
from .tasks import Batch, Task

CRITERIA = ("accuracy", "cell")


def stream_seed(seed: int, stream: str, index: int) -> int:
    """A 63-bit seed for item ``index`` of a named stream (stable across runs and platforms)."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(seed: int, stream: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(seed, stream, index))


@dataclass(frozen=True)
class TrainConfig:
    """steps: optimisation steps at most. warmup: steps of linear warm-up (default 5% of
    steps). min_lr: the cosine's floor, as a fraction of lr. eval_every: steps between
    evaluations on ``eval_examples`` held-out examples. target_accuracy: stop once the
    held-out accuracy reaches it (None: never). checkpoint_every: steps between
    checkpoints (0: none). weight_decay defaults to 0: recall tasks hinge on exact token
    embeddings, and decoupled decay at these learning rates erodes them (MQAR, seed 0,
    2000 steps at lr 1e-2: 97.6% with 0.1, 99.3% with 0).

    schedule: stages of lengths (see schedule.py; text, Stage objects or dicts); when
    given, ``steps`` is their sum. eval_lengths: the lengths each evaluation measures.
    criterion: "accuracy" or "cell" (see the module docstring). keep_best: end on the
    best-scoring evaluation's weights."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup: int | None = None
    min_lr: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_examples: int = 256
    target_accuracy: float | None = 0.99
    seed: int = 0
    checkpoint_every: int = 0
    schedule: tuple[Stage, ...] | None = None
    eval_lengths: tuple[int, ...] | None = None
    criterion: str = "accuracy"
    keep_best: bool = False

    def __post_init__(self):
        stages = as_stages(self.schedule)
        object.__setattr__(self, "schedule", stages)
        if stages is not None:
            object.__setattr__(self, "steps", sum(s.steps for s in stages))
        if self.eval_lengths is not None:
            lengths = tuple(self.eval_lengths) if isinstance(self.eval_lengths, (list, tuple)) else (self.eval_lengths,)
            if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
                raise ValueError(f"eval_lengths: expected positive ints, got {self.eval_lengths!r}")
            object.__setattr__(self, "eval_lengths", tuple(sorted(set(lengths))))
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion: expected one of {', '.join(CRITERIA)}, got {self.criterion!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        shortest = min(s.steps for s in stages) if stages else self.steps
        if self.warmup is not None and (not isinstance(self.warmup, int) or not 0 <= self.warmup <= shortest):
            where = f"the shortest stage's steps={shortest}" if stages else f"steps={self.steps}"
            raise ValueError(f"warmup: expected an int in [0, {where}] or None, got {self.warmup!r}")
        if not (self.lr > 0 and 0 <= self.min_lr <= 1 and self.weight_decay >= 0 and self.grad_clip > 0):
            raise ValueError(
                f"lr, min_lr, weight_decay, grad_clip: expected lr > 0, 0 <= min_lr <= 1, weight_decay >= 0, "
                f"grad_clip > 0; got {self.lr}, {self.min_lr}, {self.weight_decay}, {self.grad_clip}"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy: expected in (0, 1] or None, got {self.target_accuracy!r}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected an int >= 0, got {self.checkpoint_every!r}")
        object.__setattr__(self, "betas", tuple(self.betas))

    @property
    def warmup_steps(self) -> int:
        return self._warmup(self.steps)

    def _warmup(self, steps: int) -> int:
        return max(1, steps // 20) if self.warmup is None else self.warmup

    def stage_at(self, step: int) -> tuple[int, int]:
        """(stage index, 0-based step within it) of step ``step`` (1-based); (0, step - 1)
        without a schedule."""
        offset = step - 1
        for index, stage in enumerate(self.schedule or ()):
            if offset < stage.steps:
                return index, offset
            offset -= stage.steps
        return (len(self.schedule) - 1, offset) if self.schedule else (0, offset)

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (1-based): linear warm-up to ``lr``, then a
        half-cosine down to ``min_lr · lr`` at the last step (of each stage, with a schedule)."""
        if self.schedule:
            index, offset = self.stage_at(step)
            step, steps = offset + 1, self.schedule[index].steps
        else:
            steps = self.steps
        w = self._warmup(steps)
        if step <= w:
            return self.lr * step / w
        progress = (step - w) / max(1, steps - w)
        return self.lr * (self.min_lr + (1 - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))

    def length_and_batch(self, step: int, default_length: int) -> tuple[int, int]:
        """(sequence length, batch size) of step ``step``."""
        if not self.schedule:
            return default_length, self.batch_size
        index, offset = self.stage_at(step)
        stage = self.schedule[index]
        length = stage.length_at(offset)
        return length, stage.batch_at(length, self.batch_size)

    def measured_lengths(self, default_length: int) -> tuple[int, ...]:
        """The lengths every evaluation measures."""
        if self.eval_lengths:
            return self.eval_lengths
        return tuple(sorted(self.schedule[-1].lengths)) if self.schedule else (default_length,)


@dataclass
class Evaluation:
    """Held-out accuracy and loss at one sequence length; ``groups`` by example label."""

    length: int
    accuracy: float
    loss: float
    counted: int
    groups: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    """``best_step`` and ``best_score``: the evaluation whose weights the run ended on
    (keep_best), else None."""

    steps: int
    stopped_early: bool
    train_seconds: float
    tokens_per_s: float
    history: list[dict]
    evaluations: list[Evaluation]
    best_step: int | None = None
    best_score: float | None = None


def score(evaluations: list[Evaluation], criterion: str) -> float:
    """The number early stopping and model selection go by (see the module docstring)."""
    if criterion == "cell":
        return min(min(ev.groups.values()) if ev.groups else ev.accuracy for ev in evaluations)
    return min(ev.accuracy for ev in evaluations)


class Trainer:
    """Train ``model`` on ``task`` with ``config``; ``fit()`` runs to the end (or the target)."""

    def __init__(self, model: nn.Module, task: Task, config: TrainConfig):
        self.model, self.task, self.config = model, task, config
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        # Matrices and embeddings decay; gains, biases and per-head scalars do not (nanoGPT).
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=config.lr,
            betas=config.betas,
        )
        self.step = 0
        self.train_seconds = 0.0
        self.tokens = 0
        self.stopped_early = False
        self.history: list[dict] = []
        self._held_out: dict[int, Batch] = {}
        self._tasks: dict[int, Task] = {}
        #: the best-scoring evaluation so far: {"step", "score", "state"} (keep_best only)
        self.best: dict | None = None

    # ------------------------------------------------------------------ training

    def fit(self, on_eval=None, checkpoint_path: str | None = None, on_snapshot=None) -> TrainResult:
        """Train until ``config.steps`` or the target accuracy. ``on_eval(record)`` is called
        after each evaluation; ``on_snapshot(model, record)`` after each evaluation whose
        weights are what the run would end on now (every one; with keep_best each new
        best), so a caller can write them as the run goes. With ``checkpoint_path`` a
        checkpoint is written every ``config.checkpoint_every`` steps and at the end
        (and with keep_best the best weights beside it, see ``best_path``)."""
        c = self.config
        losses: list[float] = []
        while self.step < c.steps and not self.stopped_early:
            self.step += 1
            losses.append(self.train_step())
            record = None
            if self.step % c.eval_every == 0 or self.step == c.steps:
                record = self._record(sum(losses) / len(losses))
                losses = []
                if c.target_accuracy is not None and record["score"] >= c.target_accuracy:
                    self.stopped_early = self.step < c.steps
                if c.keep_best and (self.best is None or record["score"] >= self.best["score"]):
                    self.best = {
                        "step": self.step,
                        "score": record["score"],
                        "state": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                    }
                    record["best"] = True
                    if checkpoint_path:
                        self.save(best_path(checkpoint_path))
            if checkpoint_path and c.checkpoint_every and self.step % c.checkpoint_every == 0:
                self.save(checkpoint_path)
            if record is not None and on_eval is not None:
                on_eval(record)
            if record is not None and on_snapshot is not None and (record.get("best") or not c.keep_best):
                on_snapshot(self.model, record)
        if checkpoint_path:
            self.save(checkpoint_path)
        if c.keep_best and self.best is not None:
            self.model.load_state_dict(self.best["state"])
        return self.result()

    def task_at(self, length: int) -> Task:
        """The task at sequence length ``length`` (the same task otherwise)."""
        if length == self.task.seq_len:
            return self.task
        if length not in self._tasks:
            self._tasks[length] = replace(self.task, seq_len=length)
        return self._tasks[length]

    def train_step(self) -> float:
        c = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = c.lr_at(self.step)
        length, batch_size = c.length_and_batch(self.step, self.task.seq_len)
        batch = self.task_at(length).sample(batch_size, generator(c.seed, "train", self.step))
        start = time.perf_counter()
        self.model.train()
        loss = self.task.loss(self.model(batch.inputs), batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.optimizer.step()
        self.train_seconds += time.perf_counter() - start
        self.tokens += batch.inputs.shape[0] * batch.inputs.shape[1]
        return float(loss.detach())

    def _record(self, train_loss: float) -> dict:
        """One evaluation at every measured length. ``accuracy`` is the score (with one
        length and criterion "accuracy", that length's accuracy); ``lengths`` has each
        length's accuracy, loss and groups; ``stage`` the schedule's stage (0-based)."""
        c = self.config
        evaluations = [self.evaluate(n) for n in c.measured_lengths(self.task.seq_len)]
        value = score(evaluations, c.criterion)
        record = {
            "step": self.step,
            "seconds": self.train_seconds,
            "train_loss": train_loss,
            "accuracy": value,
            "score": value,
            "eval_loss": sum(ev.loss for ev in evaluations) / len(evaluations),
            "stage": c.stage_at(self.step)[0],
            "lengths": {str(ev.length): {"accuracy": ev.accuracy, "loss": ev.loss, "groups": ev.groups} for ev in evaluations},
        }
        self.history.append(record)
        return record

    # ------------------------------------------------------------------ evaluation

    def held_out(self, length: int) -> Batch:
        """The fixed held-out examples at ``length`` (drawn once, from the "eval" stream)."""
        if length not in self._held_out:
            self._held_out[length] = self.task_at(length).held_out(
                self.config.eval_examples, generator(self.config.seed, "eval", length)
            )
        return self._held_out[length]

    @torch.no_grad()
    def evaluate(self, length: int | None = None) -> Evaluation:
        """Accuracy and loss on the held-out examples at ``length`` (default: the training length)."""
        length = self.task.seq_len if length is None else length
        data = self.held_out(length)
        names = self.task.group_names
        right = torch.zeros(max(1, len(names)), dtype=torch.float64)
        total = torch.zeros_like(right)
        loss_sum = 0.0
        self.model.eval()
        # As many tokens per forward as a training batch at the task's length.
        step = max(1, self.config.batch_size * self.task.seq_len // length)
        for start in range(0, len(data), step):
            batch = data.slice(start, start + step)
            outputs = self.model(batch.inputs)
            correct, counted = self.task.scored(outputs, batch)
            loss_sum += float(self.task.loss(outputs, batch)) * int(batch.mask.sum())
            group = torch.zeros(len(batch), dtype=torch.long) if batch.group is None else batch.group
            right.index_add_(0, group, correct.sum(dim=1).double())
            total.index_add_(0, group, counted.sum(dim=1).double())
        counted_all = int(total.sum())
        if counted_all == 0:
            raise ValueError(f"task: the held-out examples at length {length} have no scored positions")
        groups = {name: float(right[i] / total[i]) for i, name in enumerate(names) if total[i] > 0}
        return Evaluation(length, float(right.sum() / counted_all), loss_sum / int(data.mask.sum()), counted_all, groups)

    def result(self) -> TrainResult:
        """The final evaluation, at ``config.eval_lengths`` when given, else the task's test lengths."""
        lengths = self.config.eval_lengths or self.task.eval_lengths()
        evaluations = [self.evaluate(length) for length in lengths]
        rate = self.tokens / self.train_seconds if self.train_seconds > 0 else 0.0
        best = self.best or {}
        return TrainResult(
            self.step,
            self.stopped_early,
            self.train_seconds,
            rate,
            list(self.history),
            evaluations,
            best.get("step"),
            best.get("score"),
        )

    # ------------------------------------------------------------------ checkpoints

    def _identity(self) -> dict:
        return {"task": self.task.name, "task_params": _jsonable(self.task.params()), "config": _jsonable(asdict(self.config))}

    def save(self, path: str) -> None:
        meta = {
            **self._identity(),
            "step": self.step,
            "train_seconds": self.train_seconds,
            "tokens": self.tokens,
            "stopped_early": self.stopped_early,
            "history": self.history,
        }
        save_checkpoint(path, self.model, self.optimizer, meta)

    def resume(self, path: str) -> None:
        """Continue from a checkpoint written by ``save`` for the same task and config."""
        meta = load_checkpoint(path, self.model, self.optimizer)
        mine = self._identity()
        differ = [key for key in mine if meta.get(key) != mine[key]]
        if differ:
            raise ValueError(
                f"path: checkpoint {path} was written for another {' and '.join(differ)} "
                f"({', '.join(f'{k}={meta.get(k)}' for k in differ)})"
            )
        self.step, self.train_seconds, self.tokens = meta["step"], meta["train_seconds"], meta["tokens"]
        self.stopped_early, self.history = meta["stopped_early"], meta["history"]
        self.best = None
        if self.config.keep_best and os.path.isfile(best_path(path)):
            best_meta = load_checkpoint_meta(best_path(path))
            self.best = {
                "step": best_meta["step"],
                "score": best_meta["history"][-1]["score"],
                "state": load_weights(best_path(path)),
            }


def best_path(checkpoint_path: str) -> str:
    """Where a run keeping its best weights writes them: ``run.safetensors`` -> ``run.best.safetensors``."""
    stem = checkpoint_path[: -len(".safetensors")] if checkpoint_path.endswith(".safetensors") else checkpoint_path
    return stem + ".best.safetensors"


def _jsonable(value):
    """Tuples as lists, as they come back from JSON (so identities compare equal)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


__all__ = ["CRITERIA", "Evaluation", "TrainConfig", "TrainResult", "Trainer", "best_path", "generator", "score", "stream_seed"]
