"""The ``ruler`` probe: RULER's synthetic tasks (Hsieh et al. 2024, arXiv 2404.06654) on any
local causal language model, with the attention the answer pays to its needles.

Eleven tasks (``ruler_tasks``): eight needle-in-a-haystack variants (niah_single_1/2/3,
niah_multikey_1/2/3, niah_multivalue, niah_multiquery), variable tracking (vt) and two
aggregation tasks (cwe, fwe). Every prompt is built to a token ``length`` that counts
the prompt *and* the answer budget, as RULER's ``max_seq_length`` does: the prompt holds
``length - max_new_tokens`` tokens (RULER's budgets: 128 for niah, 30 for vt, 120 for cwe,
50 for fwe). The model answers greedily; each answer scores ``100 x string_match_all``
(the share of references found, case-insensitive).

Rows:

- ``score`` per (task, length, sample); ``accuracy`` per (task, length), their mean, and
  for ``task="average"`` the mean over tasks (RULER's headline number);
- ``effective_length`` per task and for the average: the longest length whose accuracy
  reaches ``threshold`` (the paper's 85.6 is Llama-2-7B's average at 4k), 0 when none does;
- ``needle_mass`` per (task, length, layer, head) for the needle tasks and vt: the mean
  attention that the answer's query rows (the last prompt row and every generated row)
  put on the needles the answer reads (the union of their token spans), averaged over
  samples; ``needle_mass_best`` per (task, length): the largest of those, with its
  layer and head.

RULER's QA tasks need reading-comprehension data sets that are not shipped; its
templates here are attnkit's own wording.
"""

from __future__ import annotations

import numbers
import time
from typing import cast

import torch

from ..validate import integer
from .generation import greedy_generate, left_pad, pad_id
from .meters import RowSpanMass
from .model import as_probe_model
from .result import ProbeResult
from .ruler_tasks import ALL, TASKS, make_sample, sample_rng
from .scoring import string_match_all

#: RULER's context lengths
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
#: the paper's threshold: Llama-2-7B's average score at 4k tokens
THRESHOLD = 85.6
AVERAGE = "average"


def ruler(
    model=None,
    tokenizer=None,
    *,
    tasks=ALL,
    lengths=None,
    samples: int = 20,
    seed: int = 0,
    threshold: float = THRESHOLD,
    batch_size: int = 4,
    max_new_tokens: int | None = None,
    progress=None,
) -> ProbeResult:
    """Run RULER's synthetic tasks on a causal LM: accuracy per task and length, the
    effective length, and the attention the answers pay to their needles.

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer, a model directory, or
            a ``ProbeModel``.
        tasks: task names (a list, or one comma-separated string; "all" for every task).
        lengths: token lengths (prompt plus answer budget); default: RULER's 4k..128k
            that fit the model's positions.
        samples: prompts per task and length (RULER uses 500).
        seed: fixes every prompt (each one is rebuilt alone from (seed, task, length, index)).
        threshold: accuracy (0..100) a length must reach to count towards the effective length.
        batch_size: prompts per forward pass.
        max_new_tokens: answer budget for every task (default: RULER's per-task budgets).
        progress: called with one line of text per task and length.
    """
    started = time.perf_counter()
    tasks = _check_tasks(tasks)
    samples = integer(samples, "samples", 1)
    batch_size = integer(batch_size, "batch_size", 1)
    seed = integer(seed, "seed", None)
    threshold = _check_threshold(threshold)
    if max_new_tokens is not None:
        max_new_tokens = integer(max_new_tokens, "max_new_tokens", 1)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable taking one line of text, got {type(progress).__name__}")
    explicit = lengths is not None
    if explicit:
        lengths = _check_lengths(lengths)

    pm = as_probe_model(model, tokenizer)
    if pm.task is not None:
        raise ValueError(
            f"model: the ruler probe asks English questions about English text (RULER's templates), "
            f"which have no form in the symbol vocabulary of the arena task {pm.task['task']!r} that "
            f"{pm.name or 'this model'} was trained on; pass a natural-language causal LM with --model"
        )
    pm.require("causal", "ruler")
    if not explicit:
        lengths = tuple(n for n in LENGTHS if pm.max_positions is None or n <= pm.max_positions)
        if not lengths:
            raise ValueError(
                f"lengths: none of RULER's lengths ({', '.join(map(str, LENGTHS))}) fits the "
                f"{pm.max_positions} positions of {pm.name or 'the model'}; give --lengths"
            )
    for length in lengths:
        pm.check_length(length, "lengths")
    budgets = {task: max_new_tokens or TASKS[task].max_new_tokens for task in tasks}
    for task, new in budgets.items():
        if min(lengths) <= new:
            raise ValueError(
                f"lengths: {min(lengths)} tokens leave no room for a {task} prompt after its {new}-token answer budget"
            )
        for length in lengths:  # a length too short for a task fails now, not after hours of others
            make_sample(task, pm.tokenizer, length - new, sample_rng(seed, task, length, 0))

    result = ProbeResult("ruler")
    result.meta = {
        "model": pm.name,
        "params": {
            "tasks": list(tasks),
            "lengths": list(lengths),
            "samples": samples,
            "seed": seed,
            "threshold": threshold,
            "batch_size": batch_size,
            "max_new_tokens": budgets,
        },
        "examples": [],
    }
    for task in tasks:
        for length in lengths:
            accuracy = _run_cell(pm, result, task, length, budgets[task], samples, seed, batch_size)
            if progress is not None:
                progress(f"ruler: {task} at {length} tokens: accuracy {accuracy:.1f}")
    for length in lengths:
        result.add(
            "accuracy",
            sum(result.value("accuracy", task=t, length=length) for t in tasks) / len(tasks),
            task=AVERAGE,
            length=length,
        )
    for task in (*tasks, AVERAGE):
        result.add("effective_length", effective_length(result, threshold, task), task=task)
    result.meta["figures"] = _figures(result)
    result.meta["seconds"] = time.perf_counter() - started
    return result


def _run_cell(
    pm, result: ProbeResult, task: str, length: int, new_tokens: int, samples: int, seed: int, batch_size: int
) -> float:
    """All samples of one (task, length): score rows, the accuracy row and the needle
    mass rows; returns the accuracy."""
    tokenizer = pm.tokenizer
    built = [make_sample(task, tokenizer, length - new_tokens, sample_rng(seed, task, length, i)) for i in range(samples)]
    scores, mass_sum, layers = [], None, None
    for lo in range(0, samples, batch_size):
        batch = built[lo : lo + batch_size]
        prompts = left_pad([s.ids for s in batch], pad_id(tokenizer))
        observers, meter = [], None
        if batch[0].spans:
            spans = {
                f"needle{j}": [(pad + a, pad + e) for pad, s in zip(prompts.pads, batch) for a, e in [s.spans[j]]]
                for j in range(len(batch[0].spans))
            }
            meter = RowSpanMass(spans, q_lo=prompts.length - 1)
            observers.append(meter)
        generation = greedy_generate(pm.model, tokenizer, prompts, new_tokens, observers=observers)
        for offset, (sample, text) in enumerate(zip(batch, generation.texts)):
            score = 100.0 * string_match_all(text, sample.answers)
            scores.append(score)
            result.add("score", score, task=task, length=length, sample=lo + offset)
            if lo + offset == 0:
                result.meta["examples"].append(
                    {
                        "task": task,
                        "length": length,
                        "prompt_tokens": len(sample.ids),
                        "answer": text,
                        "references": sample.answers,
                    }
                )
        if meter is not None:
            # the needles' spans are disjoint, so the mass on their union is the sum
            # (L, H) summed over the batch; a sample with spans has at least one (``batch[0].spans``)
            mass = cast(torch.Tensor, sum(meter.per_example(name) for name in spans)).sum(0)
            mass_sum = mass if mass_sum is None else mass_sum + mass
            layers = meter.layers_seen
    accuracy = sum(scores) / len(scores)
    result.add("accuracy", accuracy, task=task, length=length)
    if mass_sum is not None and layers is not None:  # set together, by a batch with a meter
        mean = mass_sum / samples
        for i, layer in enumerate(layers):
            for head in range(mean.shape[1]):
                result.add("needle_mass", float(mean[i, head]), task=task, length=length, layer=layer, head=head)
        flat = int(torch.argmax(mean))
        i, head = divmod(flat, mean.shape[1])
        result.add("needle_mass_best", float(mean[i, head]), task=task, length=length, layer=layers[i], head=head)
    return accuracy


def effective_length(result: ProbeResult, threshold: float = THRESHOLD, task: str = AVERAGE) -> int:
    """RULER's effective length of ``task`` in ``result``: the longest length whose
    ``accuracy`` is at least ``threshold``; 0 when no length reaches it."""
    threshold = _check_threshold(threshold)
    rows = result.select("accuracy", task=task)
    if not rows:
        raise ValueError(f"task: the result has no accuracy rows for {task!r}")
    passing = [row["length"] for row in rows if row["value"] >= threshold]
    return max(passing) if passing else 0


def _figures(result: ProbeResult) -> list[dict]:
    figures = [
        {
            "kind": "heatmap",
            "rows": "task",
            "cols": "length",
            "metric": "accuracy",
            "title": "RULER accuracy (0-100) by task and length",
        },
        {
            "kind": "curve",
            "x": "length",
            "metric": "accuracy",
            "series": "task",
            "title": "RULER accuracy against length, one line per task",
        },
    ]
    if result.select("needle_mass_best"):
        figures.append(
            {
                "kind": "heatmap",
                "rows": "task",
                "cols": "length",
                "metric": "needle_mass_best",
                "title": "Largest attention mass of one head on the needles, by task and length",
            }
        )
    return figures


# -- validation ---------------------------------------------------------------------------


def _check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) <= 100:
        raise ValueError(f"threshold: expected an accuracy in (0, 100], got {value!r}")
    return float(value)


def _check_tasks(tasks) -> tuple[str, ...]:
    if isinstance(tasks, str):
        tasks = ALL if tasks.strip() == "all" else [t.strip() for t in tasks.split(",")]
    try:
        tasks = list(tasks)
    except TypeError:
        raise ValueError(f"tasks: expected task names, got {tasks!r}") from None
    if tasks == ["all"]:  # the command line's --tasks all arrives as a list of one name
        tasks = list(ALL)
    if not tasks:
        raise ValueError(f"tasks: expected at least one of {', '.join(ALL)}")
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"tasks: unknown task {task!r}; expected one of {', '.join(ALL)}")
        if tasks.count(task) > 1:
            raise ValueError(f"tasks: {task!r} is given more than once")
    return tuple(tasks)


def _check_lengths(lengths) -> tuple[int, ...]:
    if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
        lengths = [lengths]
    if isinstance(lengths, str):
        raise ValueError(f"lengths: expected token counts, got the text {lengths!r}")
    try:
        lengths = list(lengths)
    except TypeError:
        raise ValueError(f"lengths: expected positive int token counts, got {lengths!r}") from None
    if not lengths:
        raise ValueError("lengths: expected at least one token count")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"lengths: expected positive int token counts, got {n!r}")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths: a length is given more than once in {lengths!r}")
    return tuple(sorted(int(n) for n in lengths))


__all__ = ["AVERAGE", "LENGTHS", "THRESHOLD", "effective_length", "ruler"]
