"""Two profiles side by side: per-head change of every metric, and attention drift.

Before/after a mechanism swap or a weight edit, the question is which heads moved. Every
metric measured in both gets ``after - before``; each head also gets the KL divergence
KL(before || after) between its two distance profiles (mass by |i - j|, normalised).
This is the per-head drift of the attention distribution that knowledge-editing work
measures and restricts (Wang et al. 2025, "Revealing and Mitigating Over-Attention in
Knowledge Editing", arXiv 2502.14838: edits that make heads over-attend to the edited
entity, "attention drift"), summarised by distance so it needs no N x N matrix.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass

from ..observe.distance import parse_bin_label
from .profile import AttentionProfile, written


def distance_profile(profile: AttentionProfile, layer: int, head: int) -> dict[str, float]:
    """{bin label: mass} of one head (empty when the DistanceProfile meter did not run)."""
    return {
        m[len("distance.") :]: v
        for m, v in profile.head_metrics(layer, head).items()
        if m.startswith("distance.") and m != "distance.mean"
    }


def kl_divergence(p: dict[str, float], q: dict[str, float], epsilon: float = 1e-9) -> float:
    """KL(p || q) in nats of two histograms over (the union of) their bins, each floored
    at ``epsilon`` and renormalised, so an empty bin gives a large finite value, not inf."""
    bins = sorted(set(p) | set(q), key=lambda b: parse_bin_label(b)[0])
    a = [max(p.get(b, 0.0), 0.0) + epsilon for b in bins]
    c = [max(q.get(b, 0.0), 0.0) + epsilon for b in bins]
    sa, sc = sum(a), sum(c)
    return sum((x / sa) * math.log((x / sa) / (y / sc)) for x, y in zip(a, c))


@dataclass
class ProfileComparison:
    #: (layer, head, metric, before, after, after - before)
    rows: list[tuple]
    #: {(layer, head): KL(before || after) of the distance profiles}
    drift: dict

    def largest(self, metric: str, n: int = 10) -> list[tuple]:
        """The ``n`` rows of ``metric`` with the largest absolute change."""
        return sorted((r for r in self.rows if r[2] == metric), key=lambda r: -abs(r[5]))[:n]

    def to_csv(self, path: str | None = None) -> str:
        """CSV with header ``layer,head,metric,before,after,change``; drift rows have the
        metric ``distance.kl`` and the divergence as ``change``."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["layer", "head", "metric", "before", "after", "change"])
        for layer, head, metric, before, after, change in self.rows:
            w.writerow([layer, head, metric, repr(before), repr(after), repr(change)])
        for (layer, head), kl in sorted(self.drift.items()):
            w.writerow([layer, head, "distance.kl", "", "", repr(kl)])
        return written(buf.getvalue(), path)

    def to_json(self, path: str | None = None) -> str:
        doc = {
            "rows": [list(r) for r in self.rows],
            "drift": [[layer, head, kl] for (layer, head), kl in sorted(self.drift.items())],
        }
        return written(json.dumps(doc), path)


def compare(before: AttentionProfile, after: AttentionProfile, *, epsilon: float = 1e-9) -> ProfileComparison:
    """Per-head change from ``before`` to ``after`` for every metric both measured, and
    KL(before || after) of each head's distance profile."""
    for name, profile in (("before", before), ("after", after)):
        if not isinstance(profile, AttentionProfile):
            raise ValueError(f"{name}: expected an AttentionProfile, got {type(profile).__name__}")
    if not 0.0 < epsilon < 1e-3:
        raise ValueError(f"epsilon: expected a small positive floor for empty bins, got {epsilon!r}")
    rows = []
    for layer, head, metric, b in before.rows:
        if after.has(layer, head, metric):
            a = after.value(layer, head, metric)
            rows.append((layer, head, metric, b, a, a - b))
    if not rows:
        raise ValueError("before, after: the profiles share no (layer, head, metric); were they measured on the same model?")
    drift = {}
    for layer, head in sorted(set(before.heads) & set(after.heads)):
        p, q = distance_profile(before, layer, head), distance_profile(after, layer, head)
        if p and q:
            drift[(layer, head)] = kl_divergence(p, q, epsilon)
    return ProfileComparison(rows, drift)
