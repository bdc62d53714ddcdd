"""HeadHunter (arXiv 2506.10978): greedy choice of the attention heads to perturb.

Perturbed-attention guidance works best on some heads and not others; HeadHunter picks
them against the user's own objective. Round by round, every remaining candidate
``(layer, head)`` is added to the heads chosen so far, the pipeline samples every
prompt x seed with PAG (or SoftPAG, ``strength`` < 1) on that set, the objective scores
each output, and the candidate with the best mean score joins the set.

Sampling dominates the cost, so every evaluated set is written to a JSON cache as soon
as it is scored: a rerun (after an interruption, or with more rounds) skips what is
there. The file holds a fingerprint of the settings (scale, strength, prompts, seeds,
call arguments, objective name) and a run with other settings refuses it rather than mix
scores. It is read with ``json`` only and checked entry by entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..files import write_json_atomic
from .guidance import pag
from .layers import select_layers
from .switch import denoiser

Tensor = torch.Tensor
Pair = tuple[str, int]
CACHE_VERSION = 1


@dataclass(frozen=True)
class HuntStep:
    """One evaluation, as ``progress`` sees it: round (0 first), position among the
    round's candidates, the candidate added, the whole set scored, its mean score and
    whether it came from the cache."""

    round: int
    index: int
    total: int
    candidate: Pair
    selection: tuple[Pair, ...]
    score: float
    cached: bool


@dataclass
class HuntResult:
    """``selected``: the chosen (layer, head) pairs in the order they joined;
    ``scores``: the mean objective after each round; ``rounds``: per round, every
    candidate tried and its score; ``evaluations``: how many sets were sampled now (not
    read from the cache)."""

    selected: list[Pair]
    scores: list[float]
    rounds: list[list[tuple[Pair, float]]] = field(default_factory=list)
    evaluations: int = 0


def head_candidates(model_or_pipeline, layers: Iterable[str] | None = None) -> list[Pair]:
    """Every (module path, head) of the self- and joint-attention layers of a model (or
    of the named ``layers``, exact module paths), in module order."""
    found = select_layers(denoiser(model_or_pipeline), layers, ("self", "joint"))
    return [(layer.name, h) for layer in found for h in range(int(layer.module.heads))]  # type: ignore[arg-type]  # nn.Module.__getattr__: Tensor | Module


def print_progress(step: HuntStep) -> None:
    """A ready ``progress`` callback: one line per evaluation on stderr."""
    layer, head = step.candidate
    note = " (cached)" if step.cached else ""
    print(
        f"headhunter round {step.round + 1} [{step.index + 1}/{step.total}] {layer}:{head} score {step.score:.6g}{note}",
        file=sys.stderr,
        flush=True,
    )


def hunt(
    pipeline,
    objective: Callable,
    prompts: Sequence,
    seeds: Sequence[int] = (0,),
    *,
    candidates: Sequence[Pair] | None = None,
    rounds: int = 1,
    scale: float = 3.0,
    strength: float = 1.0,
    text: str = "identity",
    cfg: bool | None = None,
    maximize: bool = True,
    cache: str | os.PathLike | None = None,
    progress: Callable[[HuntStep], None] | None = None,
    whole_set: bool = False,
    **call_kwargs,
) -> HuntResult:
    """Greedy HeadHunter selection of heads for perturbed-attention guidance.

    Args:
        pipeline: a diffusers pipeline; it is called as
            ``pipeline(**call_kwargs, **prompt, generator=...)`` under ``pag``.
        objective: ``objective(output, prompt, seed) -> float`` on the pipeline's
            output (use ``output_type="latent"`` in ``call_kwargs`` to score latents).
        prompts: strings (passed as ``prompt=``) or dicts of call arguments (e.g.
            ``prompt_embeds``); each is sampled with every seed of ``seeds``.
        candidates: (module path, head) pairs to choose from (default: every head of
            every self- and joint-attention layer, ``head_candidates``).
        rounds: how many heads to choose.
        scale, strength, text, cfg: PAG's scale, SoftPAG's u, joint text handling,
            CFG batching (as for ``pag``).
        maximize: whether a higher objective is better.
        cache: a JSON file of evaluated sets, read first and written after each one.
        progress: called with a ``HuntStep`` after each evaluation (``print_progress``).
        whole_set: the objective scores the whole prompt x seed set at once (a
            distribution metric): ``objective([(output, prompt, seed), ...]) -> float``.
    """
    if not callable(objective):
        raise ValueError(f"objective: expected a callable (output, prompt, seed) -> float, got {type(objective).__name__}")
    prompts = list(prompts) if not isinstance(prompts, (str, dict)) else [prompts]
    if not prompts or any(not isinstance(p, (str, dict)) for p in prompts):
        raise ValueError("prompts: expected a non-empty list of prompt strings or dicts of call arguments")
    seeds = [seeds] if isinstance(seeds, int) else list(seeds)
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) for s in seeds):
        raise ValueError(f"seeds: expected a non-empty list of integers, got {seeds!r}")
    if "generator" in call_kwargs:
        raise ValueError("call_kwargs: hunt makes each call's generator from seeds; do not pass generator=")
    pool = head_candidates(pipeline) if candidates is None else _check_pairs(candidates, pipeline)
    settings = dict(
        scale=scale,
        strength=strength,
        text=text,
        cfg=cfg,
        whole_set=whole_set,
        prompts=prompts,
        seeds=seeds,
        call=call_kwargs,
        objective=getattr(objective, "__qualname__", type(objective).__name__),
    )
    fingerprint = _fingerprint(settings)

    def evaluate(selection: tuple[Pair, ...]) -> float:
        outputs: list[tuple[Any, Any, int]] = []  # whole_set: (output, prompt, seed) for one objective call
        values: list[float] = []
        for prompt in prompts:
            arguments = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
            clash = sorted(set(arguments) & set(call_kwargs))
            if clash:
                raise ValueError(f"prompts: {clash[0]!r} is given both in a prompt and as a call argument")
            for seed in seeds:
                with torch.no_grad(), pag(pipeline, list(selection), scale, strength=strength, text=text, cfg=cfg):
                    output = pipeline(**call_kwargs, **arguments, generator=torch.Generator().manual_seed(seed))
                if whole_set:
                    outputs.append((output, prompt, seed))
                else:
                    values.append(_number(objective(output, prompt, seed), selection, seed))
        if whole_set:
            return _number(objective(outputs), selection, None)
        return sum(values) / len(values)

    return greedy(pool, evaluate, rounds=rounds, maximize=maximize, cache=cache, fingerprint=fingerprint, progress=progress)


def _number(value, selection, seed) -> float:
    """An objective's value as a finite float, or a ValueError saying what came back."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"objective: returned a tensor of shape {tuple(value.shape)}; expected one number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        where = "" if seed is None else f", seed {seed}"
        raise ValueError(f"objective: returned {value!r} for heads {list(selection)}{where}; expected a finite number")
    return float(value)


def greedy(
    candidates: Sequence[Pair],
    score: Callable[[tuple[Pair, ...]], float],
    *,
    rounds: int = 1,
    maximize: bool = True,
    cache: str | os.PathLike | None = None,
    fingerprint: str = "",
    progress: Callable[[HuntStep], None] | None = None,
) -> HuntResult:
    """HeadHunter's greedy loop on any ``score(selection) -> float`` of a sorted tuple of
    (layer, head) pairs: each round adds the candidate whose set scores best (the first
    in candidate order among equals). ``cache``/``fingerprint``: the resumable JSON
    cache (see the module docstring); ``hunt`` scores sets by sampling."""
    pool = []
    for c in candidates:
        if not (
            isinstance(c, (tuple, list))
            and len(c) == 2
            and isinstance(c[0], str)
            and isinstance(c[1], int)
            and not isinstance(c[1], bool)
            and c[1] >= 0
        ):
            raise ValueError(f"candidates: expected (module path, head) pairs, got {c!r}")
        if (c[0], c[1]) not in pool:
            pool.append((c[0], c[1]))
    if not pool:
        raise ValueError("candidates: expected at least one (module path, head) pair")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= len(pool):
        raise ValueError(f"rounds: expected an integer in [1, {len(pool)}] (one head per round), got {rounds!r}")
    store = _Cache(cache, fingerprint)
    result = HuntResult([], [])
    for r in range(rounds):
        remaining = [c for c in pool if c not in result.selected]
        tried = []
        for i, candidate in enumerate(remaining):
            selection = tuple(sorted([*result.selected, candidate]))
            value = store.get(selection)
            cached = value is not None
            if value is None:
                value = float(score(selection))
                if not math.isfinite(value):
                    raise ValueError(f"score: {value} for heads {list(selection)}; expected a finite number")
                store.put(selection, value)
                result.evaluations += 1
            tried.append((candidate, value))
            if progress is not None:
                progress(HuntStep(r, i, len(remaining), candidate, selection, value, cached))
        best = (max if maximize else min)(tried, key=lambda item: item[1])
        result.selected.append(best[0])
        result.scores.append(best[1])
        result.rounds.append(tried)
    return result


def _check_pairs(candidates, pipeline) -> list[Pair]:
    valid = set(head_candidates(pipeline))
    pairs = []
    for c in candidates:
        if not (
            isinstance(c, (tuple, list))
            and len(c) == 2
            and isinstance(c[0], str)
            and isinstance(c[1], int)
            and not isinstance(c[1], bool)
        ):
            raise ValueError(f"candidates: expected (module path, head) pairs, got {c!r}")
        pair = (c[0], int(c[1]))
        if pair not in valid:
            raise ValueError(f"candidates: {pair!r} is not a head of a self- or joint-attention layer of the model")
        if pair not in pairs:
            pairs.append(pair)
    if not pairs:
        raise ValueError("candidates: expected at least one (module path, head) pair")
    return pairs


def _digest(value, h) -> None:
    """Feeds a stable description of ``value`` to the hash ``h`` (tensors by content)."""
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _digest(value[k], h)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _digest(v, h)
        h.update(b"]")
    elif value is None or isinstance(value, (str, int, float, bool)):
        h.update(repr(value).encode())
    else:  # an object whose repr may carry its address: its type only
        h.update(f"<{type(value).__module__}.{type(value).__qualname__}>".encode())


def _fingerprint(settings: dict) -> str:
    h = hashlib.sha256()
    _digest(settings, h)
    return h.hexdigest()


def _key(selection: tuple[Pair, ...]) -> str:
    return json.dumps([[name, head] for name, head in selection])


class _Cache:
    """Evaluated sets -> mean score, in memory and (when ``path`` is set) in a JSON file."""

    def __init__(self, path, fingerprint: str):
        self.path, self.fingerprint, self.scores = path, fingerprint, {}
        if path is None or not os.path.exists(path):
            return
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cache: {os.fspath(path)!r} is not a readable HeadHunter JSON cache ({e})") from None
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("scores"), dict):
            raise ValueError(f"cache: {os.fspath(path)!r} is not a HeadHunter cache (version {CACHE_VERSION})")
        if data.get("fingerprint") != fingerprint:
            raise ValueError(
                f"cache: {os.fspath(path)!r} was made with other settings (scale, strength, prompts, seeds, "
                "call arguments or objective); use another file"
            )
        for key, score in data["scores"].items():
            try:
                pairs = json.loads(key)
                ok = isinstance(pairs, list) and all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int) for p in pairs
                )
            except ValueError:
                ok = False
            if not ok or isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise ValueError(f"cache: {os.fspath(path)!r} has a malformed entry {key!r}: {score!r}")
            self.scores[key] = float(score)

    def get(self, selection: tuple[Pair, ...]) -> float | None:
        return self.scores.get(_key(selection))

    def put(self, selection: tuple[Pair, ...], score: float) -> None:
        self.scores[_key(selection)] = score
        if self.path is None:
            return
        write_json_atomic(self.path, {"version": CACHE_VERSION, "fingerprint": self.fingerprint, "scores": self.scores}, indent=1)


__all__ = ["HuntResult", "HuntStep", "greedy", "head_candidates", "hunt", "print_progress"]
