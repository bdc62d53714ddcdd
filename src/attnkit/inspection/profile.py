"""AttentionProfile: what the meters measured in one model on one input, as tidy rows.

One row per (layer, head, metric, value) — the shape pandas, R and spreadsheets read
without reshaping — plus the tokens, what was run (``meta``) and the per-query arrays
(top keys, entropy per token) the report's token view is drawn from.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..observe import classify_heads

Row = tuple  # (layer, head, metric, value)


def _array_to_json(data: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}


def _array_from_json(data: dict) -> dict:
    return {k: (torch.tensor(v) if isinstance(v, list) else v) for k, v in data.items()}


def written(text: str, path: str | None) -> str:
    """``text``, also written to ``path`` (UTF-8, newlines as they are) when one is given."""
    if path is not None:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return text


@dataclass
class AttentionProfile:
    rows: list[Row]
    tokens: list[str] | None = None
    meta: dict = field(default_factory=dict)
    #: {name: {(layer, head): {field: tensor or number}}}, e.g. "top_keys", "entropy"
    arrays: dict = field(default_factory=dict)

    def __post_init__(self):
        self._index = {(layer, head, metric): value for layer, head, metric, value in self.rows}

    # -- reading ------------------------------------------------------------------------------

    @property
    def metrics(self) -> list[str]:
        """Metric names in the order they first appear."""
        return list(dict.fromkeys(m for _, _, m, _ in self.rows))

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _, _, _ in self.rows})

    @property
    def heads(self) -> list[tuple[int, int]]:
        return sorted({(layer, head) for layer, head, _, _ in self.rows})

    def value(self, layer: int, head: int, metric: str) -> float:
        try:
            return self._index[(layer, head, metric)]
        except KeyError:
            raise KeyError(f"no {metric!r} for layer {layer}, head {head}; metrics: {', '.join(self.metrics)}") from None

    def has(self, layer: int, head: int, metric: str) -> bool:
        return (layer, head, metric) in self._index

    def values(self, metric: str) -> dict[tuple[int, int], float]:
        """{(layer, head): value} of one metric."""
        return {(layer, head): v for (layer, head, m), v in self._index.items() if m == metric}

    def head_metrics(self, layer: int, head: int) -> dict[str, float]:
        """{metric: value} of one head."""
        return {m: v for (lay, h, m), v in self._index.items() if lay == layer and h == head}

    def table(self, metric: str) -> torch.Tensor:
        """(layers, heads) float64 grid of one metric; NaN marks heads it was not measured on."""
        if metric not in self.metrics:
            raise ValueError(f"metric: {metric!r} is not in this profile; it has {', '.join(self.metrics)}")
        n_layers = max(self.layers) + 1
        n_heads = max(h for _, h in self.heads) + 1
        out = torch.full((n_layers, n_heads), math.nan, dtype=torch.float64)
        for (layer, head, m), v in self._index.items():
            if m == metric:
                out[layer, head] = v
        return out

    def classify(self, **thresholds) -> dict:
        """{(layer, head): HeadClass}: sink, previous-token, local, span-focused, broad or
        mixed (see ``attnkit.observe.classify_heads`` for the thresholds)."""
        if "sink_epsilon" not in thresholds and "sink" in self.meta.get("meters", {}):
            thresholds["sink_epsilon"] = self.meta["meters"]["sink"].get("epsilon", 0.3)
        return classify_heads(self.rows, **thresholds)

    def compare(self, other: AttentionProfile, **kwargs):
        """Per-head change from this profile to ``other`` (see ``attnkit.inspection.compare``)."""
        from .compare import compare

        return compare(self, other, **kwargs)

    # -- writing ------------------------------------------------------------------------------

    def to_csv(self, path: str | None = None) -> str:
        """Rows as CSV (header ``layer,head,metric,value``); written to ``path`` if given."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["layer", "head", "metric", "value"])
        for layer, head, metric, value in self.rows:
            writer.writerow([layer, head, metric, repr(float(value))])
        return written(buf.getvalue(), path)

    def to_json(self, path: str | None = None) -> str:
        """Everything — rows, tokens, meta, arrays — as JSON; ``from_json`` reads it back."""
        arrays = {
            name: {f"{layer}.{head}": _array_to_json(data) for (layer, head), data in per_head.items()}
            for name, per_head in self.arrays.items()
        }
        doc = {
            "format": "attnkit.AttentionProfile/1",
            "meta": self.meta,
            "tokens": self.tokens,
            "rows": [[layer, head, metric, float(value)] for layer, head, metric, value in self.rows],
            "arrays": arrays,
        }
        return written(json.dumps(doc), path)

    @classmethod
    def from_json(cls, text: str) -> AttentionProfile:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != "attnkit.AttentionProfile/1":
            raise ValueError("text: not an attnkit AttentionProfile JSON document (format attnkit.AttentionProfile/1)")
        arrays: dict[str, dict[tuple[int, int], Any]] = {}
        for name, per_head in doc["arrays"].items():
            arrays[name] = {}
            for key, data in per_head.items():
                layer, head = key.split(".")
                arrays[name][(int(layer), int(head))] = _array_from_json(data)
        return cls([tuple(r) for r in doc["rows"]], doc["tokens"], doc["meta"], arrays)

    def __repr__(self) -> str:
        n = len(self.tokens) if self.tokens is not None else self.meta.get("tokens", "?")
        return f"AttentionProfile({len(self.layers)} layers, {len(self.heads)} heads, {len(self.metrics)} metrics, {n} tokens)"
