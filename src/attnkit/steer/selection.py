"""Which heads to steer: a fast ranking by attention mass, and PASTA's exact profiling.

PASTA (Zhang et al. 2023, arXiv 2311.02262) picks the heads to steer by *model
profiling*: steer each head alone on a small set of examples and keep the heads whose
steering scores best — one run per head and example (issue #1 of its repository: 1000
examples x 32 x 32 heads for a 7B model; its authors found 100 examples rank closely).

- ``rank_heads(model, tokenizer, prompts, spans)`` is the fast stand-in: one forward pass
  per prompt through attnkit's kernels (O(N) memory), measuring with a meter how much
  attention each head already puts on the spans; heads are ranked by that mass.
- ``profile_heads(model, tokenizer, examples, score_fn)`` is the paper's procedure: for
  each head, steer it alone (``emphasize`` by default, any intervention factory
  otherwise), score every example, and rank by the mean. It reports progress and keeps
  a resumable cache (a JSON file rewritten after each head), since it is long.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..files import write_json_atomic
from .targets import model_shape

Tensor = torch.Tensor

QUERIES = ("after", "last")
CACHE_FORMAT = "attnkit.steer.profile"


@dataclass
class HeadRanking:
    """``scores`` (layers, heads) float64, NaN for heads not measured; higher ranks first.
    ``metric`` names what was measured; ``meta`` carries the rest (baseline score, sizes)."""

    scores: Tensor
    metric: str
    meta: dict = field(default_factory=dict)

    def order(self) -> list[tuple[int, int]]:
        """Every measured (layer, head), best first (ties: lower layer, then lower head)."""
        flat = self.scores.flatten().tolist()
        heads = self.scores.shape[1]
        keep = [i for i, v in enumerate(flat) if not math.isnan(v)]
        return [divmod(i, heads) for i in sorted(keep, key=lambda i: -flat[i])]

    def top(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` best (layer, head) pairs, usable as ``heads=`` of any intervention."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected an int >= 1, got {k!r}")
        return self.order()[:k]

    def rows(self) -> list[dict]:
        """Tidy rows ``{"layer", "head", "metric", "value"}`` of the measured heads."""
        return [
            {"layer": layer, "head": head, "metric": self.metric, "value": float(self.scores[layer, head])}
            for layer, head in self.order()
        ]


# -- rank_heads -------------------------------------------------------------------------------


def _prompt_and_spans(tokenizer, prompt, spans, i: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, token ranges) of prompt ``i``: a string (spans: substrings or token
    ranges of ``tokenizer(prompt)``) or a list of token ids (spans: token ranges)."""
    from .emphasize import _token_spans

    if isinstance(spans, (str, tuple)):
        spans = [spans]
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"spans: prompt {i} needs a substring, a (start, end) token range or a list of them, got {spans!r}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompts: prompt {i} is empty")
        ids = list(tokenizer(prompt)["input_ids"])
        ranges = _token_spans(spans, prompt, tokenizer, None).spans
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(isinstance(s, str) for s in spans):
            raise ValueError(f"spans: prompt {i} is given as token ids, so its spans must be (start, end) token ranges")
        ranges = _token_spans(spans, None, None, None).spans
    else:
        raise ValueError(f"prompts: prompt {i} must be a non-empty string or a list of token ids, got {type(prompt).__name__}")
    for a, b in ranges:
        if b > len(ids):
            raise ValueError(f"spans: ({a}, {b}) of prompt {i} ends past its {len(ids)} tokens")
    return ids, ranges


def rank_heads(
    model, tokenizer, prompts: Sequence, spans: Sequence, *, queries: str = "after", progress: Callable[[str], None] | None = None
) -> HeadRanking:
    """Rank every head by the mean attention mass it puts on ``spans``, one forward pass
    per prompt through attnkit's kernels (a meter, never the attention matrix).

    Args:
        prompts: strings (tokenized with special tokens, as the model reads them) or
            lists of token ids.
        spans: one per prompt: a substring, a (start, end) token range or a list of
            them (their masses add up).
        queries: which query rows are measured: ``"after"`` every row after the last
            span ends (the rows that read the whole span), ``"last"`` the prompt's last
            row (the one that predicts the answer).

    Returns a ``HeadRanking`` of the mass (mean over rows, then over prompts), metric
    "span_mass".
    """
    from .. import hf
    from ..probes.meters import RowSpanMass

    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a non-empty list of prompts")
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence) or len(spans) != len(prompts):
        raise ValueError(
            f"spans: expected one entry per prompt ({len(prompts)}), got "
            f"{len(spans) if isinstance(spans, Sequence) and not isinstance(spans, str) else type(spans).__name__}"
        )
    if queries not in QUERIES:
        raise ValueError(f"queries: expected one of {', '.join(QUERIES)}, got {queries!r}")
    layers, heads = model_shape(model)
    accepted = set(inspect.signature(model.forward).parameters)
    # only attention is read: no KV cache, and no N x vocab logits at long context
    extra = {k: v for k, v in (("use_cache", False), ("logits_to_keep", 1)) if k in accepted}
    total = torch.zeros(layers, heads, dtype=torch.float64)
    for i, (prompt, span) in enumerate(zip(prompts, spans)):
        ids, ranges = _prompt_and_spans(tokenizer, prompt, span, i)
        q_lo = max(b for _, b in ranges) if queries == "after" else len(ids) - 1
        if q_lo >= len(ids):
            raise ValueError(
                f"spans: the span of prompt {i} ends at its last token, so no query row after it reads "
                "the whole span; use queries='last' or end the prompt after the span"
            )
        meter = RowSpanMass({f"s{j}": [r] for j, r in enumerate(ranges)}, q_lo)
        with torch.no_grad(), hf.use(model, observers=[meter]):
            model(input_ids=torch.tensor([ids]), **extra)
        if len(meter.layers_seen) != layers:
            raise ValueError(f"model: observed {len(meter.layers_seen)} attention layers, its config declares {layers}")
        total += sum(meter.per_example(f"s{j}")[0] for j in range(len(ranges)))
        if progress:
            progress(f"prompt {i + 1}/{len(prompts)}")
    return HeadRanking(total / len(prompts), "span_mass", {"prompts": len(prompts), "queries": queries})


# -- profile_heads ----------------------------------------------------------------------------


def _default_make(alpha: float):
    from .emphasize import emphasize

    def make(head, example, tokenizer):
        if not isinstance(example, Mapping) or "prompt" not in example or "span" not in example:
            raise ValueError(
                "examples: the default intervention (PASTA's emphasize) needs each example as a dict with "
                "'prompt' (text) and 'span' (a substring or (start, end) token range); pass make= otherwise"
            )
        return emphasize(example["span"], [head], alpha, text=example["prompt"], tokenizer=tokenizer)

    return make


def _arity(fn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _fingerprint(model, examples, score_fn, make, alpha) -> str:
    """What a cache must match to be resumed: the model's config, the examples, the
    score function, the intervention factory and alpha."""
    config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else repr(model.config)
    params = list(model.parameters())
    # a cheap look at the weights: another checkpoint of the same config must not resume this one
    weights = [repr(float(p.detach().double().sum())) for p in params[:2] + params[-2:]]
    parts = [
        type(model).__name__,
        getattr(model.config, "_name_or_path", ""),
        config,
        *weights,
        repr(list(examples)),
        getattr(score_fn, "__qualname__", repr(score_fn)),
        "default" if make is None else getattr(make, "__qualname__", repr(make)),
        repr(alpha),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _read_cache(path: str, key: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cache: cannot read {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        raise ValueError(f'cache: {path} is not a head-profile cache (no "format": "{CACHE_FORMAT}")')
    if data.get("key") != key:
        raise ValueError(
            f"cache: {path} holds a profile of another model, examples, score_fn or intervention; remove it or give another path"
        )
    return data


def profile_heads(
    model,
    tokenizer,
    examples: Sequence,
    score_fn: Callable,
    *,
    heads="all",
    make: Callable | None = None,
    alpha: float = 0.01,
    cache: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> HeadRanking:
    """PASTA's model profiling: steer each head alone and score.

    Args:
        examples: what ``score_fn`` scores (any objects; with the default ``make``, dicts
            with "prompt" and "span").
        score_fn: ``score_fn(model, tokenizer, example) -> float`` (higher is better); it
            runs the model as usual, the head's intervention is in force around it.
        heads: the heads to profile, as interventions take them (default "all").
        make: intervention factory, ``make(head)`` or ``make(head, example)`` ->
            intervention, ``head`` a (layer, head) pair; default PASTA's
            ``emphasize(example["span"], [head], alpha)`` on the example's prompt.
        cache: a JSON file; scores are written after every head and a rerun with the same
            model, examples, score function and factory resumes where it stopped.
        progress: called once per head with a one-line summary.

    Returns a ``HeadRanking`` of the mean score per head (NaN for heads not profiled),
    metric "profile_score", with ``meta["baseline"]`` the unsteered mean score.
    """
    from .apply import apply
    from .targets import resolve_heads

    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence) or not examples:
        raise ValueError("examples: expected a non-empty list of examples")
    if not callable(score_fn):
        raise ValueError(f"score_fn: expected a callable score_fn(model, tokenizer, example) -> float, got {score_fn!r}")
    if make is not None and not callable(make):
        raise ValueError(f"make: expected a callable make(head) -> intervention, got {make!r}")
    if make is None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0):
        raise ValueError(f"alpha: expected a number in (0, 1] (the weight kept outside the spans), got {alpha!r}")
    if cache is not None and not os.path.isdir(os.path.dirname(os.path.abspath(os.fspath(cache)))):
        raise ValueError(f"cache: the directory of {os.fspath(cache)} does not exist")
    layers, n_heads = model_shape(model)
    chosen = [(layer, h) for layer, hs in resolve_heads(heads, layers, n_heads).items() for h in hs]
    factory = _default_make(alpha) if make is None else make
    with_example = make is None or _arity(make) >= 2
    path = None if cache is None else os.fspath(cache)
    key = _fingerprint(model, examples, score_fn, make, alpha)
    state = _read_cache(path, key) if path else {}
    state = {"format": CACHE_FORMAT, "key": key, "baseline": state.get("baseline"), "scores": dict(state.get("scores", {}))}

    def mean_score(head) -> float:
        total = 0.0
        for i, example in enumerate(examples):
            if head is None:
                value = score_fn(model, tokenizer, example)
            else:
                iv = (
                    factory(head, example, tokenizer)
                    if make is None
                    else (factory(head, example) if with_example else factory(head))
                )
                with apply(model, iv):
                    value = score_fn(model, tokenizer, example)
            if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)) or not math.isfinite(float(value)):
                raise ValueError(f"score_fn: expected a finite number for example {i}, got {value!r}")
            total += float(value)
        return total / len(examples)

    if state["baseline"] is None:
        state["baseline"] = mean_score(None)
        if path:
            write_json_atomic(path, state)
    done = 0
    for layer, h in chosen:
        name = f"{layer},{h}"
        if name in state["scores"]:
            done += 1
            if progress:
                progress(f"head {done}/{len(chosen)}: layer {layer} head {h} score {state['scores'][name]:.4g} (cached)")
            continue
        state["scores"][name] = mean_score((layer, h))
        done += 1
        if path:
            write_json_atomic(path, state)
        if progress:
            progress(
                f"head {done}/{len(chosen)}: layer {layer} head {h} score {state['scores'][name]:.4g} "
                f"(baseline {state['baseline']:.4g})"
            )
    scores = torch.full((layers, n_heads), math.nan, dtype=torch.float64)
    for layer, h in chosen:
        scores[layer, h] = state["scores"][f"{layer},{h}"]
    return HeadRanking(scores, "profile_score", {"baseline": state["baseline"], "examples": len(examples), "heads": len(chosen)})
