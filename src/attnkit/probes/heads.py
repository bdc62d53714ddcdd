"""The ``heads`` probe: what each attention head does, scored without eager attention.

Five scores per (layer, head), each a mean attention weight read by attnkit meters while
the model runs on attnkit's kernels (O(N) memory per head, never an N x N matrix):

- ``previous_token``: weight from each query on the key just before it;
- ``duplicate_token``: weight on the earlier occurrences of the query's own token;
- ``induction``: from a token in a later copy of a repeated random segment, the weight on
  the key right after that token's earlier occurrence (Olsson et al. 2022, "In-context
  Learning and Induction Heads", arXiv 2209.11895: the repeated-random-tokens test);
- ``sink``: weight on position 0 (the sink score alpha of Gu et al. 2024, arXiv 2410.10781);
- ``retrieval``: while the model copies a needle, the fraction of the copied tokens for
  which the head's top key lies in the needle and holds the token just generated (Wu et
  al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv
  2404.15574).

The first three are TransformerLens' head-detector patterns; here each is the mean over
the query rows the pattern defines (every row with a previous key, with an earlier
duplicate, in a later copy), so rows the pattern does not cover do not dilute the score.
Prompts are token ids: random segments of distinct tokens, written ``repeats`` times
(after the tokenizer's BOS when it has one), drawn from the vocabulary without special
tokens, or, for an arena export, from its task's symbols; retrieval prompts hide a
random needle in a haystack of other tokens and end with the needle's first token, so
the model copies the rest. An arena needle export is probed in its own format: the
answer step after ``Q key`` is the copy, and the needle is the (key, value) cell.

``meta["top"][score]`` lists the top ``top`` heads as ``[[layer, head], ...]``;
``save_head_set`` writes one such list as JSON for steering.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import time

import torch

from ..validate import integer
from .generation import greedy_generate, left_pad
from .meters import StepTopKey
from .model import as_probe_model
from .result import ProbeResult
from .target_mass import TargetMass

Tensor = torch.Tensor

#: heads ``meta["top"]`` lists per score unless ``top`` says otherwise (fewer on a smaller model)
DEFAULT_TOP = 5
SCORES = ("previous_token", "duplicate_token", "induction", "retrieval", "sink")
_TITLES = {
    "previous_token": "previous-token score",
    "duplicate_token": "duplicate-token score",
    "induction": "induction score (repeated random tokens)",
    "retrieval": "retrieval score (Wu et al.)",
    "sink": "sink score (weight on position 0)",
}


# -- parameters -------------------------------------------------------------------------------


def _scores(value) -> tuple[str, ...]:
    if value is None:
        return SCORES
    names = value.split(",") if isinstance(value, str) else value
    try:
        names = [n.strip() if isinstance(n, str) else n for n in names]
    except TypeError:
        names = [value]
    bad = [n for n in names if n not in SCORES]
    if not names or bad:
        raise ValueError(f"scores: expected a non-empty list of {', '.join(SCORES)}, got {value!r}")
    return tuple(dict.fromkeys(names))


# -- what tokens prompts are made of ------------------------------------------------------------


def _task_ids(task: dict) -> tuple[list[int], dict[str, int]]:
    """Ids of the symbols random segments are drawn from (the role ``segment`` when the
    task names one, else every symbol of its families), and every symbol's id."""
    symbols = task.get("symbols")
    if not isinstance(symbols, dict) or not isinstance(symbols.get("tokens"), list):
        raise ValueError("model: its task.json has no symbol table (expected one written by attnkit arena --export)")
    ids = {name: i for i, name in enumerate(symbols["tokens"])}
    roles = symbols.get("roles", {})
    if isinstance(roles.get("segment"), list):
        pool = roles["segment"]
    else:
        pool = [s for family in roles.values() if isinstance(family, list) for s in family]
    pool = list(dict.fromkeys(pool)) or list(symbols["tokens"])
    return [ids[s] for s in pool if s in ids], ids


def _vocabulary(pm) -> list[int]:
    """Token ids a random segment may use: the tokenizer's ids that are rows of the
    model's embedding, without special tokens."""
    size = pm.model.get_input_embeddings().num_embeddings
    try:
        size = min(size, len(pm.tokenizer))
    except TypeError:
        pass
    special = set(getattr(pm.tokenizer, "all_special_ids", None) or [])
    return [i for i in range(size) if i not in special]


def _bos(pm) -> list[int]:
    if pm.task is not None:  # arena models were trained without one
        return []
    bos = getattr(pm.tokenizer, "bos_token_id", None)
    return [bos] if isinstance(bos, int) else []


# -- repeated random segments -------------------------------------------------------------------


def repeated_prompts(
    pool: list[int], length: int, repeats: int, samples: int, rng: random.Random, prefix: list[int]
) -> list[list[int]]:
    """``samples`` prompts: ``prefix`` then a segment of ``length`` distinct tokens of
    ``pool``, written ``repeats`` times."""
    return [prefix + rng.sample(pool, length) * repeats for _ in range(samples)]


def head_targets(batch: int, offset: int, length: int, repeats: int) -> dict[str, Tensor]:
    """The key positions each query row's score reads, (B, N, T) with -1 for none, for
    prompts of ``offset`` prefix tokens then ``repeats`` copies of a ``length``-token
    segment of distinct tokens."""
    n = offset + length * repeats
    previous = torch.full((n, 1), -1, dtype=torch.long)
    previous[1:, 0] = torch.arange(n - 1)
    sink = torch.zeros((n, 1), dtype=torch.long)
    duplicate = torch.full((n, repeats - 1), -1, dtype=torch.long)
    induction = torch.full((n, repeats - 1), -1, dtype=torch.long)
    for copy in range(1, repeats):
        for j in range(length):
            q = offset + copy * length + j
            for earlier in range(copy):
                duplicate[q, earlier] = offset + earlier * length + j
                induction[q, earlier] = offset + earlier * length + j + 1
    expand = lambda t: t.unsqueeze(0).expand(batch, -1, -1).contiguous()  # noqa: E731
    return {
        "previous_token": expand(previous),
        "duplicate_token": expand(duplicate),
        "induction": expand(induction),
        "sink": expand(sink),
    }


def _forward(model, ids: Tensor, observers) -> None:
    from .. import hf

    accepted = set(inspect.signature(model.forward).parameters)
    kwargs: dict[str, object] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1  # the logits are never read
    if "use_cache" in accepted:
        kwargs["use_cache"] = False
    with torch.no_grad(), hf.use(model, observers=observers):
        model(**kwargs)


def _pattern_scores(
    pm, prompts: list[list[int]], offset: int, length: int, repeats: int, names, batch_size: int, progress
) -> dict[str, Tensor]:
    """(L, H) mean weight on each pattern's targets over every row that has one."""
    sums: dict[str, Tensor] = {}  # every name's, from the first batch on
    counts = dict.fromkeys(names, 0.0)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for i, chunk in enumerate(batches):
        ids = torch.tensor(chunk, dtype=torch.long)
        targets = {k: v for k, v in head_targets(len(chunk), offset, length, repeats).items() if k in names}
        meter = TargetMass(targets)
        _forward(pm.model, ids, [meter])
        for name in names:
            rows = float((targets[name] >= 0).any(-1).sum())  # the rows the meter averaged over
            part = meter.score(name) * rows
            sums[name] = sums[name] + part if name in sums else part
            counts[name] += rows
        if progress is not None:
            progress(f"heads: patterns, batch {i + 1}/{len(batches)}")
    return {name: sums[name] / counts[name] for name in names}


# -- retrieval ----------------------------------------------------------------------------------


def copy_prompts(
    pool: list[int], context: int, needle: int, samples: int, rng: random.Random, prefix: list[int]
) -> tuple[list[list[int]], list[tuple[int, int]], list[list[int]]]:
    """Needle-copy prompts of ``context`` tokens: ``prefix``, a haystack of random tokens
    not in the needle, ``needle`` distinct random tokens at a random depth, then the
    needle's first token as the cue. Returns (prompts, needle spans [start, end), the
    tokens the model should copy: the needle after its first token)."""
    prompts, spans, answers = [], [], []
    hay = context - len(prefix) - needle - 1
    for _ in range(samples):
        chosen = rng.sample(pool, needle)
        rest = [t for t in pool if t not in set(chosen)]
        haystack = [rng.choice(rest) for _ in range(hay)]
        at = rng.randint(0, hay)
        start = len(prefix) + at
        prompts.append(prefix + haystack[:at] + chosen + haystack[at:] + chosen[:1])
        spans.append((start, start + needle))
        answers.append(chosen[1:])
    return prompts, spans, answers


def arena_needle_prompts(task: dict, ids: dict[str, int], context: int, samples: int, rng: random.Random):
    """Prompts in the arena needle task's format (``attnkit.arena`` Needle: two-token
    (key, value) cells in random filler, ``distractors`` other pairs, ``Q key`` at the
    end; the answer is the needle's value), the needle at evenly cycled depths. Returns
    (prompts, needle cell spans, [[value]])."""
    params = task.get("params", {})
    roles = task["symbols"]["roles"]
    distractors = int(params.get("distractors", 0))
    depths = int(params.get("num_depths", 5))
    cells = (context - 2) // 2
    if cells < distractors + 1:
        raise ValueError(f"context: {context} tokens hold {cells} cells, fewer than the needle and its {distractors} distractors")
    prompts, spans, answers = [], [], []
    for s in range(samples):
        depth = (s % depths) / (depths - 1) if depths > 1 else 0.0
        cell = round(depth * (cells - 1))
        others = rng.sample([c for c in range(cells) if c != cell], distractors)
        keys = rng.sample(roles["keys"], distractors + 1)
        values = rng.sample(roles["values"], distractors + 1)
        tokens = [ids[rng.choice(roles["filler"])] for _ in range(context)]
        for c, k, v in zip([cell, *others], keys, values):
            tokens[2 * c], tokens[2 * c + 1] = ids[k], ids[v]
        tokens[-2], tokens[-1] = ids[roles["query"]], ids[keys[0]]
        prompts.append(tokens)
        spans.append((2 * cell, 2 * cell + 2))
        answers.append([ids[values[0]]])
    return prompts, spans, answers


def retrieval_scores(pm, prompts, spans, answers, batch_size: int, progress) -> tuple[Tensor, float, dict]:
    """(L, H) retrieval scores, mean over prompts: Wu et al.'s rule at every generated
    token (the head's top key lies in the needle span and holds the token just
    generated: + 1 / tokens to copy); also the fraction of answer tokens copied right
    and what was generated, with ``standard_error`` (L, H): the scores' standard error
    over the prompts (sample standard deviation / sqrt(prompts))."""
    steps = len(answers[0])
    total: Tensor | None = None
    squares: Tensor | None = None
    correct, generated = 0, []
    batches = range(0, len(prompts), batch_size)
    for i, lo in enumerate(batches):
        chunk, chunk_spans = prompts[lo : lo + batch_size], spans[lo : lo + batch_size]
        batch = left_pad(chunk, 0)
        top = StepTopKey(q_lo=batch.length - 1)
        gen = greedy_generate(pm.model, pm.tokenizer, batch, steps, observers=[top], stop_at_eos=False)
        full = torch.cat([batch.input_ids, gen.tokens], dim=1)
        hits = []
        for layer in top.layers_seen:
            keys = top.top_keys(layer)  # (B, H, steps)
            start = torch.tensor([a + p for (a, _), p in zip(chunk_spans, batch.pads)]).view(-1, 1, 1)
            end = torch.tensor([e + p for (_, e), p in zip(chunk_spans, batch.pads)]).view(-1, 1, 1)
            at = full.gather(1, keys.clamp_min(0).flatten(1)).view_as(keys)
            copied = (keys >= start) & (keys < end) & (at == gen.tokens.unsqueeze(1))
            hits.append(copied.double().sum(-1) / steps)  # (B, H)
        per_prompt = torch.stack(hits, dim=1)  # (B, L, H)
        part, square = per_prompt.sum(0), per_prompt.square().sum(0)
        total = part if total is None else total + part
        squares = square if squares is None else squares + square
        expected = torch.tensor([a for a in answers[lo : lo + batch_size]])
        correct += int((gen.tokens == expected).sum())
        generated += gen.tokens.tolist()
        if progress is not None:
            progress(f"heads: retrieval, batch {i + 1}/{len(batches)}")
    assert total is not None and squares is not None  # at least one prompt, so one batch ran
    n = len(prompts)
    mean = total / n
    variance = ((squares - n * mean.square()) / (n - 1)).clamp_min(0) if n > 1 else torch.full_like(mean, float("nan"))
    return mean, correct / (n * steps), {"generated": generated, "standard_error": (variance / n).sqrt()}


# -- the probe ----------------------------------------------------------------------------------


def heads(
    model=None,
    tokenizer=None,
    *,
    length: int | None = None,
    repeats: int | None = None,
    samples: int = 64,
    needle: int | None = None,
    context: int | None = None,
    scores: list[str] | None = None,
    top: int | None = None,
    seed: int = 0,
    progress=None,
    batch_size: int = 8,
) -> ProbeResult:
    """Score every (layer, head) of a causal LM as previous-token, duplicate-token,
    induction, retrieval and sink head (see the module docstring for the definitions).

    Args:
        length: tokens per random segment (``--length``; default 32, or the arena
            induction task's segment).
        repeats: copies of each segment (``--repeats``; default 2, or the task's).
        samples: prompts per kind (``--samples``; default 64: a retrieval score, a mean of per-prompt
            fractions in [0, 1], then has a standard error of at most 0.5 / sqrt(64) = 0.0625, and
            ``retrieval_se`` rows give each head's own).
        needle: needle tokens for the retrieval prompts (``--needle``, default 8;
            an arena needle export has a one-token answer and takes no ``needle``).
        context: tokens per retrieval prompt (``--context``; default: 128, the task's
            ``seq_len`` or the model's positions, less the tokens copied).
        scores: which scores to compute (``--scores``; default all of ``SCORES``).
        top: how many heads ``meta["top"]`` lists per score (``--top``; default 5, or every
            head of a model with fewer).

    Rows: metric = score name, at (layer, head), and ``retrieval_se``, the retrieval score's standard
    error over the prompts. ``meta["copy_accuracy"]``: fraction of
    needle tokens the model copied right during the retrieval prompts."""
    started = time.perf_counter()
    pm = as_probe_model(model, tokenizer)
    pm.require("causal", "heads")
    names = _scores(scores)
    samples = integer(samples, "samples", 1, "the number of prompts")
    batch_size = integer(batch_size, "batch_size", 1, "prompts per forward pass")
    seed = integer(seed, "seed", None)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable taking a line of text, got {type(progress).__name__}")
    n_heads = pm.layers * pm.heads
    top = min(DEFAULT_TOP, n_heads) if top is None else integer(top, "top", 1, "how many heads to list per score")
    if top > n_heads:
        raise ValueError(f"top: expected at most the model's {n_heads} heads ({pm.layers} layers x {pm.heads}), got {top}")

    task = pm.task
    params = task.get("params", {}) if task is not None else {}
    arena_needle = task is not None and task.get("task") == "needle"
    if task is not None:
        pool, symbol_ids = _task_ids(task)
    else:
        pool, symbol_ids = _vocabulary(pm), {}
    prefix = _bos(pm)

    if length is None:
        length = int(params["seq_len"]) // int(params["repeats"]) if task is not None and task.get("task") == "induction" else 32
        length = min(length, len(pool))
    length = integer(length, "length", 2, "tokens per random segment")
    if length > len(pool):
        raise ValueError(
            f"length: a segment of {length} distinct tokens needs as many tokens to draw from; "
            f"{pm.name or 'the model'} offers {len(pool)}"
        )
    if repeats is None:
        repeats = int(params.get("repeats", 2)) if task is not None and task.get("task") == "induction" else 2
    repeats = integer(repeats, "repeats", 2, "copies of each segment")
    # Every parameter is checked, and every prompt built, before the model runs.
    pattern_names = [n for n in names if n != "retrieval"]
    if pattern_names:
        pm.check_length(len(prefix) + length * repeats, "length")
    if "retrieval" in names:
        retrieval_rng = random.Random(f"{seed}-retrieval")  # the same needles whatever else is scored
        if arena_needle and task is not None:  # (an arena needle model has a task)
            context = int(params["seq_len"]) if context is None else context
            if needle is not None:
                raise ValueError("needle: the arena needle task's answer is one value token; leave --needle unset")
            context = integer(context, "context", 2 * (int(params.get("distractors", 0)) + 2), "tokens per retrieval prompt")
            if context % 2:
                raise ValueError(f"context: the needle task is written in two-token cells, so it must be even, got {context}")
            pm.check_length(context, "context")
            needles = arena_needle_prompts(task, symbol_ids, context, samples, retrieval_rng)
        else:
            needle = integer(
                8 if needle is None else needle, "needle", 2, "needle tokens (the first is the cue, the rest are copied)"
            )
            if needle >= len(pool):
                raise ValueError(
                    f"needle: a needle of {needle} distinct tokens needs a haystack of other tokens; "
                    f"{pm.name or 'the model'} offers {len(pool)} tokens in all"
                )
            if context is None:  # the prompt and the copied tokens fit the positions the model was trained on
                longest = int(params["seq_len"]) if "seq_len" in params else min(128, pm.max_positions or 128)
                context = max(longest - (needle - 1), len(prefix) + needle + 2)
            context = integer(
                context, "context", len(prefix) + needle + 2, "tokens per retrieval prompt (haystack, needle and cue)"
            )
            pm.check_length(context + needle - 1, "context")
            needles = copy_prompts(pool, context, needle, samples, retrieval_rng, prefix)

    values: dict[str, Tensor] = {}
    record: dict = {}
    if pattern_names:
        prompts = repeated_prompts(pool, length, repeats, samples, random.Random(seed), prefix)
        values.update(_pattern_scores(pm, prompts, len(prefix), length, repeats, pattern_names, batch_size, progress))
        record["repeated"] = prompts
    copy_accuracy = None
    if "retrieval" in names:
        prompts, spans, answers = needles
        values["retrieval"], copy_accuracy, generated = retrieval_scores(pm, prompts, spans, answers, batch_size, progress)
        values["retrieval_se"] = generated.pop("standard_error")
        record["needle"] = {"prompts": prompts, "spans": [list(s) for s in spans], "answers": answers, **generated}

    result = ProbeResult("heads")
    for name in [*names, *(["retrieval_se"] if "retrieval" in names else [])]:
        grid = values[name]
        for layer in range(grid.shape[0]):
            for head in range(grid.shape[1]):
                result.add(name, float(grid[layer, head]), layer=layer, head=head)
    result.meta = {
        "model": pm.name,
        "params": {
            "length": length,
            "repeats": repeats,
            "samples": samples,
            "needle": needle,
            "context": context,
            "scores": list(names),
            "top": top,
            "seed": seed,
            "batch_size": batch_size,
        },
        "seconds": time.perf_counter() - started,
        "figures": [
            {"kind": "heatmap", "rows": "layer", "cols": "head", "metric": name, "title": _TITLES[name]} for name in names
        ],
        "top": {name: top_heads(result, name, top) for name in names},
        "copy_accuracy": copy_accuracy,
        "prompts": record,
    }
    return result


def top_heads(result: ProbeResult, score: str, k: int) -> list[list[int]]:
    """The ``k`` heads of highest ``score`` as ``[[layer, head], ...]``, best first (ties
    in layer, head order; NaN scores never listed)."""
    rows = [r for r in result.select(score) if isinstance(r["value"], float) and not math.isnan(r["value"])]
    if not rows:
        raise ValueError(f"score: the result has no {score!r} rows (scores: {', '.join(result.metrics)})")
    rows.sort(key=lambda r: (-r["value"], r["layer"], r["head"]))
    return [[r["layer"], r["head"]] for r in rows[:k]]


def save_head_set(result: ProbeResult, path, score: str, k: int | None = None) -> dict:
    """Write the top ``k`` heads of ``score`` (default: as many as the probe listed) as
    JSON: ``{"score", "model", "heads": [[layer, head], ...], "layers": {layer: [heads]}}``
    (``layers`` is the per-layer form steering configurations take). Returns the dict."""
    if k is None:
        k = len(result.meta.get("top", {}).get(score, [])) or 5
    chosen = top_heads(result, score, integer(k, "k", 1, "how many heads"))
    layers: dict[str, list[int]] = {}
    for layer, head in chosen:
        layers.setdefault(str(layer), []).append(head)
    data = {
        "format": "attnkit.head-set",
        "version": 1,
        "score": score,
        "model": result.meta.get("model", ""),
        "heads": chosen,
        "layers": layers,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return data
