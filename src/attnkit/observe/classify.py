"""Name what each head does, from the meters' rows.

Labels, in the order they take precedence for a head's main label:

- ``sink``: sink score (mean attention on key 0) above epsilon — Gu et al. 2024
  (arXiv 2410.10781), epsilon = 0.3 there;
- ``previous-token``: most of the mass at distance exactly 1 (for a bidirectional
  model that is either neighbour) — the previous-token heads of Olsson et al. 2022
  (arXiv 2209.11895);
- ``local``: most of the mass within a small window (distance < ``local_window``), and
  not spread evenly (a uniform head over a short context also has its mass nearby);
- ``span-focused``: a named span takes much more than a uniform head would give it;
- ``broad``: high normalised entropy, attention spread over most visible keys;
- ``mixed``: none of the above.

A head can satisfy several; ``HeadClass.labels`` lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .distance import parse_bin_label

LABELS = ("sink", "previous-token", "local", "span-focused", "broad", "mixed")


@dataclass(frozen=True)
class HeadClass:
    label: str
    labels: tuple[str, ...]
    evidence: dict = field(default_factory=dict)  # the numbers that decided


def classify_heads(
    rows,
    *,
    sink_epsilon: float = 0.3,
    previous_min: float = 0.5,
    local_window: int = 8,
    local_min: float = 0.5,
    span_min: float = 0.3,
    span_lift: float = 2.0,
    broad_min: float = 0.7,
) -> dict[tuple, HeadClass]:
    """{(layer, head): HeadClass} for every head that appears in ``rows``
    (``(layer, head, metric, value)`` tuples from the meters)."""
    for name, value in (
        ("sink_epsilon", sink_epsilon),
        ("previous_min", previous_min),
        ("local_min", local_min),
        ("span_min", span_min),
        ("broad_min", broad_min),
    ):
        if not 0.0 < float(value) <= 1.0:
            raise ValueError(f"{name}: expected a fraction in (0, 1], got {value!r}")
    if local_window < 2:
        raise ValueError(f"local_window: expected an int >= 2, got {local_window!r}")
    if span_lift < 1.0:
        raise ValueError(f"span_lift: expected a ratio >= 1, got {span_lift!r}")
    heads: dict[tuple, dict[str, float]] = {}
    for layer, head, metric, value in rows:
        heads.setdefault((layer, head), {})[metric] = value
    out = {}
    for key, m in heads.items():
        evidence, labels = {}, []
        if "sink.score" in m:
            evidence["sink.score"] = m["sink.score"]
            if m["sink.score"] > sink_epsilon:
                labels.append("sink")
        even = m.get("entropy.norm", 0.0) >= broad_min
        bins = {
            parse_bin_label(name[len("distance.") :]): v
            for name, v in m.items()
            if name.startswith("distance.") and name != "distance.mean"
        }
        if bins:
            prev = bins.get((1, 2), 0.0)
            local = sum(v for (lo, hi), v in bins.items() if hi is not None and hi <= local_window)
            evidence["distance.1"], evidence[f"distance<{local_window}"] = prev, local
            if prev >= previous_min:
                labels.append("previous-token")
            if local >= local_min and not even:
                labels.append("local")
        best = None
        for name, mass in m.items():
            if name.startswith("span.") and not name.endswith(".uniform"):
                uniform = m.get(f"{name}.uniform", 0.0)
                lift = mass / uniform if uniform > 0 else 0.0
                if mass >= span_min and lift >= span_lift and (best is None or lift > best[1]):
                    best = (name, lift)
        if best is not None:
            evidence[f"{best[0]}.lift"] = best[1]
            labels.append("span-focused")
        if "entropy.norm" in m:
            evidence["entropy.norm"] = m["entropy.norm"]
            if even:
                labels.append("broad")
        labels = labels or ["mixed"]
        out[key] = HeadClass(labels[0], tuple(labels), evidence)
    return out
