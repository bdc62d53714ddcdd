"""``ProbeResult``: what a probe measured, as tidy rows.

One row per measurement: the probe's name, the parameters that locate it (length,
depth, task, layer, head, position, steering ...), a metric name and its value. That is
the shape pandas, R and spreadsheets read without reshaping, and what the report and
``attnkit probe --json`` are drawn from. ``table`` pivots two parameters against each
other for one metric (a needle grid: depth x length).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field

#: columns every row has, in this order; a probe's parameters come between probe and metric
FIXED = ("probe", "metric", "value")


def _plain(value):
    """A JSON- and CSV-safe scalar (ints stay ints, floats stay floats, the rest is text)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value
    if hasattr(value, "item"):
        return _plain(value.item())
    return str(value)


@dataclass
class Table:
    """A pivot of one metric: ``values[i][j]`` at ``row_labels[i]``, ``col_labels[j]``
    (NaN where nothing was measured)."""

    metric: str
    row_name: str
    col_name: str
    row_labels: list
    col_labels: list
    values: list[list[float]]

    def __str__(self) -> str:
        head = [f"{self.row_name} \\ {self.col_name}"] + [str(c) for c in self.col_labels]
        body = [[str(r)] + ["" if math.isnan(v) else f"{v:.3g}" for v in row] for r, row in zip(self.row_labels, self.values)]
        widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
        lines = [f"{self.metric}", "  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in body]
        return "\n".join(lines)


@dataclass
class ProbeResult:
    """Rows (dicts with ``probe``, parameter columns, ``metric``, ``value``) and ``meta``
    (the model, the probe's arguments, seed, timings: whatever a reader needs to rerun it)."""

    probe: str
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add(self, metric: str, value, **params) -> None:
        """Append one measurement located by ``params`` (e.g. length=512, depth=0.5)."""
        row = {"probe": self.probe}
        row.update({k: _plain(v) for k, v in params.items()})
        row["metric"] = metric
        row["value"] = _plain(value)
        self.rows.append(row)

    def extend(self, other: ProbeResult, **params) -> None:
        """Add ``other``'s rows, each also located by ``params`` (e.g. steered=True)."""
        for row in other.rows:
            merged = {k: v for k, v in row.items() if k not in FIXED}
            merged.update(params)
            self.add(row["metric"], row["value"], **merged)

    # -- reading --------------------------------------------------------------------------

    @property
    def columns(self) -> list[str]:
        """``probe``, then every parameter column in order of first appearance, then
        ``metric`` and ``value``."""
        params = dict.fromkeys(k for row in self.rows for k in row if k not in FIXED)
        return ["probe", *params, "metric", "value"]

    @property
    def metrics(self) -> list[str]:
        return list(dict.fromkeys(row["metric"] for row in self.rows))

    def select(self, metric: str | None = None, **params) -> list[dict]:
        """Rows with this metric (any when None) whose parameters equal ``params``."""
        return [
            row
            for row in self.rows
            if (metric is None or row["metric"] == metric) and all(row.get(k) == v for k, v in params.items())
        ]

    def value(self, metric: str, **params):
        """The one value of ``metric`` at ``params``; an error when there is not exactly one."""
        found = self.select(metric, **params)
        if len(found) != 1:
            raise KeyError(f"{self.probe}: {len(found)} rows of {metric!r} at {params}, expected exactly one")
        return found[0]["value"]

    def mean(self, metric: str, **params) -> float:
        """Mean of ``metric`` over the rows at ``params`` (NaN when there are none)."""
        values = [row["value"] for row in self.select(metric, **params) if isinstance(row["value"], (int, float))]
        return sum(values) / len(values) if values else math.nan

    def table(self, rows: str, cols: str, metric: str, **where) -> Table:
        """Pivot ``metric`` with parameter ``rows`` down and ``cols`` across, averaging
        rows that share a cell (e.g. samples), restricted to ``where``."""
        found = [r for r in self.select(metric, **where) if rows in r and cols in r]
        if not found:
            raise ValueError(f"table: no {metric!r} rows with both {rows!r} and {cols!r} (columns: {', '.join(self.columns)})")
        row_labels = sorted(dict.fromkeys(r[rows] for r in found), key=_sort_key)
        col_labels = sorted(dict.fromkeys(r[cols] for r in found), key=_sort_key)
        sums: dict = {}
        for r in found:
            key = (r[rows], r[cols])
            total, count = sums.get(key, (0.0, 0))
            sums[key] = (total + float(r["value"]), count + 1)
        values = [[sums[(a, b)][0] / sums[(a, b)][1] if (a, b) in sums else math.nan for b in col_labels] for a in row_labels]
        return Table(metric, rows, cols, row_labels, col_labels, values)

    # -- writing --------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"probe": self.probe, "meta": self.meta, "columns": self.columns, "rows": self.rows}

    def to_json(self, path=None) -> str:
        """The result as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=True, default=_plain)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def to_csv(self, path=None) -> str:
        """The rows as CSV (one column per parameter, empty where a row has none)."""
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        text = buffer.getvalue()
        if path is not None:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path) -> ProbeResult:
        """Read what ``to_json`` wrote (JSON text, or the path of a file holding it)."""
        text = text_or_path
        if not isinstance(text_or_path, str) or not text_or_path.lstrip().startswith("{"):  # a path (str or PathLike)
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        data = json.loads(text)
        if not isinstance(data, dict) or "probe" not in data or not isinstance(data.get("rows"), list):
            raise ValueError("probe result: expected a JSON object with 'probe' and 'rows' (as ProbeResult.to_json writes)")
        return cls(data["probe"], data["rows"], data.get("meta", {}))


def _sort_key(value):
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))
