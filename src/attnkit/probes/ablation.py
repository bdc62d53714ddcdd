"""Do the heads a score ranks first matter? Ablate them and measure the task, beside
random heads ablated the same way (Wu et al. 2024, "Retrieval Head Mechanistically
Explains Long-Context Factuality", arXiv 2404.15574: masking the top retrieval heads
breaks needle retrieval, masking as many random heads barely does).

Each ablation spec is ``topK-SCORE`` (the K heads of highest SCORE, one of the heads
probe's scores, measured on this model first) or ``randomK`` (K heads drawn at random,
``draws`` times, each draw its own seeded set). An ablated head's output is zeroed
(``attnkit.steer.ablate``) while the model answers the task's prompts (the needle or
kv-retrieval probe's), the same prompts for every spec and draw.

Rows: ``exact_match`` per prompt at (ablation, draw, length, depth | pairs, position,
sample); ``accuracy`` per (ablation, draw), the mean over its prompts. ``meta["heads"]``
lists the heads each (ablation, draw) zeroed, ``meta["scores"]`` the ranking used.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence

from ..validate import integer
from .result import ProbeResult
from .retrieval import check_fractions, check_run, run_items
from .tasks import task_items

SPEC = re.compile(r"^(?:top(\d+)-([a-z_]+)|random(\d+))$")


def head_ablation(
    model=None,
    tokenizer=None,
    *,
    ablate: Sequence[str] = ("top2-retrieval", "random2"),
    task: str = "needle",
    draws: int = 5,
    lengths: list[int] | None = None,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    pairs: list[int] | None = None,
    samples: int = 10,
    score_samples: int = 64,
    seed: int = 0,
    batch_size: int = 16,
    progress=None,
) -> ProbeResult:
    """Accuracy with the top-K heads of a score ablated against K random heads (see the
    module docstring).

    Args:
        ablate: specs, ``topK-SCORE`` (SCORE: previous_token, duplicate_token, induction, retrieval, sink)
            or ``randomK``
        task: ``needle`` or ``kv-retrieval`` (the probes' prompts)
        draws: random head sets per ``randomK`` spec
        lengths, depths, pairs: the task's grid (as in kv-curves)
        samples: prompts per cell of the grid
        score_samples: prompts the heads probe scores heads on
        seed: the same seed gives the same prompts, scores and random draws"""
    from .. import steer
    from .heads import SCORES, heads, top_heads

    started = time.perf_counter()
    pm, samples, seed, batch_size, say, _ = check_run(
        model, tokenizer, "head-ablation", samples, seed, batch_size, progress, None
    )
    draws = integer(draws, "draws", 1)
    score_samples = integer(score_samples, "score_samples", 1)
    depths = check_fractions(depths, "depths")
    specs = _specs(ablate, SCORES, pm.layers * pm.heads)
    items, keys, new_tokens = task_items(pm, task, lengths, depths, pairs, samples, seed)

    needed = sorted({score for _, score in specs if score})
    ranking = {}
    if needed:
        say(f"head-ablation: scoring heads ({', '.join(needed)}) on {score_samples} prompts")
        scored = heads(pm, None, scores=needed, samples=score_samples, seed=seed, batch_size=batch_size)
        ranking = {score: top_heads(scored, score, pm.layers * pm.heads) for score in needed}
    every = [[layer, head] for layer in range(pm.layers) for head in range(pm.heads)]
    runs: list[tuple[str, int, list[list[int]]]] = [("none", 0, [])]
    for text, (k, score) in zip(_texts(ablate), specs):
        if score:
            runs.append((text, 0, ranking[score][:k]))
        else:
            for d in range(draws):
                runs.append((text, d, sorted(random.Random(f"head-ablation:{seed}:{text}:{d}").sample(every, k))))

    result = ProbeResult("head-ablation")
    chosen = {}
    for n, (text, draw, ablated) in enumerate(runs, 1):
        say(
            f"head-ablation: {n}/{len(runs)} {text}"
            + (f" draw {draw}" if text.startswith("random") else "")
            + f" ({len(items)} prompts)"
        )
        layers: dict[int, list[int]] = {}
        for layer, head in ablated:
            layers.setdefault(layer, []).append(head)
        if layers:
            with steer.apply(pm.model, steer.ablate(layers)):
                outcomes, _ = run_items(pm, items, new_tokens, batch_size, lambda line: None, "head-ablation")
        else:
            outcomes, _ = run_items(pm, items, new_tokens, batch_size, lambda line: None, "head-ablation")
        for o in outcomes:
            result.add(
                "exact_match",
                o.score,
                ablation=text,
                draw=draw,
                **{k: o.item.params[k] for k in keys},
                sample=o.item.params["sample"],
            )
        result.add("accuracy", sum(o.score for o in outcomes) / len(outcomes), ablation=text, draw=draw)
        chosen[f"{text}#{draw}"] = ablated
    result.meta = {
        "model": pm.name,
        "seconds": time.perf_counter() - started,
        "params": {
            "ablate": _texts(ablate),
            "task": task,
            "draws": draws,
            "lengths": lengths,
            "depths": depths,
            "pairs": pairs,
            "samples": samples,
            "score_samples": score_samples,
            "seed": seed,
        },
        "heads": chosen,
        "scores": ranking,
        "figures": [
            {
                "kind": "bars",
                "x": "ablation",
                "metric": "accuracy",
                "spread": "draw",
                "x_title": "heads ablated",
                "y_title": "accuracy (exact match)",
                "title": "Accuracy with the top heads of a score ablated, beside random heads (mean and s.e. over draws)",
            },
            {
                "kind": "heatmap",
                "rows": keys[1],
                "cols": "ablation",
                "metric": "exact_match",
                "title": f"Accuracy by {keys[1]} and ablation",
            },
        ],
    }
    return result


def _texts(ablate) -> list[str]:
    if isinstance(ablate, str):
        ablate = [a for a in ablate.split(",") if a]
    return [str(a) for a in (ablate or ())]


def _specs(ablate, scores, total: int) -> list[tuple[int, str | None]]:
    """(K, score or None for random) per spec; each bad one named."""
    texts = _texts(ablate)
    if not texts:
        raise ValueError("ablate: expected at least one spec, e.g. top2-retrieval,random2")
    if len(set(texts)) != len(texts):
        raise ValueError(f"ablate: specs repeat in {texts}")
    out = []
    for text in texts:
        m = SPEC.match(text)
        if not m:
            raise ValueError(f"ablate: expected topK-SCORE or randomK (e.g. top2-retrieval, random2), got {text!r}")
        k = int(m.group(1) or m.group(3))
        score = m.group(2)
        if score is not None and score not in scores:
            raise ValueError(f"ablate: unknown score {score!r} in {text!r}; expected one of {', '.join(scores)}")
        if not 1 <= k <= total:
            raise ValueError(f"ablate: {text!r} ablates {k} heads; the model has {total}")
        out.append((k, score))
    return out


__all__ = ["head_ablation"]
