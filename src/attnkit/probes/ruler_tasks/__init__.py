"""Generators of RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654), one module
per family: ``niah`` (eight needle tasks), ``variable_tracking`` (vt), ``common_words``
(cwe) and ``frequent_words`` (fwe).

``make_sample(task, tokenizer, budget, rng)`` -> a ``Sample``: the prompt's token ids (at
most ``budget``), the references, the needle spans. The same ``rng`` state gives the
same prompt. RULER's two QA tasks need reading-comprehension data sets that attnkit does
not ship, so they are not here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .common import NEEDLE, NOISE, Sample
from .common_words import make_cwe
from .frequent_words import make_fwe
from .niah import NIAH, make_niah
from .variable_tracking import make_vt


@dataclass(frozen=True)
class TaskSpec:
    """A task: its generator and how many tokens RULER lets the model answer with."""

    make: Callable[..., Sample]
    max_new_tokens: int
    family: str


TASKS: dict[str, TaskSpec] = {name: TaskSpec(make_niah, 128, "niah") for name in NIAH}
TASKS["vt"] = TaskSpec(make_vt, 30, "variable tracking")
TASKS["cwe"] = TaskSpec(make_cwe, 120, "aggregation")
TASKS["fwe"] = TaskSpec(make_fwe, 50, "aggregation")

#: every task, in RULER's order
ALL = tuple(TASKS)


def make_sample(task: str, tokenizer, budget: int, rng: random.Random) -> Sample:
    """One prompt of ``task`` with at most ``budget`` tokens (niah and vt: exactly)."""
    if task not in TASKS:
        raise ValueError(f"task: unknown task {task!r}; expected one of {', '.join(ALL)}")
    return TASKS[task].make(task, tokenizer, budget, rng)


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """The random source of one sample: fixed by (seed, task, length, index), so any one
    prompt can be rebuilt alone (a string seed is hashed with SHA-512, the same on every
    run and platform)."""
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


__all__ = ["ALL", "NEEDLE", "NIAH", "NOISE", "TASKS", "Sample", "TaskSpec", "make_sample", "sample_rng"]
