"""The probe report: one self-contained HTML page for a ``ProbeResult``.

What to draw comes from the result itself: ``meta["figures"]`` lists figure specs. Every
spec has a ``"kind"`` and may add ``"title": TEXT``, ``"where": {PARAM: VALUE}`` (draw a
slice of the rows) and ``"range": [lo, hi]`` (fix the colour or y scale; default: [0, 1]
for values in it that reach 0.5, else the data's range).

- ``{"kind": "heatmap", "rows": PARAM, "cols": PARAM, "metric": METRIC}``: the pivot
  ``result.table(rows, cols, metric)`` (cells averaged over everything else, e.g.
  samples) as a viridis heatmap of cells at least 40×26 px (narrower only past about
  1100 px of columns), the value of each cell on hover. Optional:

  - ``"x_title"`` / ``"y_title"``: the axis titles (default the ``cols`` / ``rows`` names);
  - ``"values"``: write each value inside its cell (default: when there are at most 12
    columns).

- ``{"kind": "curve", "x": PARAM, "metric": METRIC or [METRICS], "series": PARAM or None}``:
  the mean of each metric against ``x``, one line per value of ``series``, every point's
  value on hover. Optional:

  - ``"x_title"`` / ``"y_title"``: the axis titles (default the ``x`` name / the metric's,
    "value" for several metrics);
  - ``"split": PARAM``: one panel per value of that column, side by side, all on one y
    scale;
  - ``"spread": PARAM``: the rows repeat over that column (``"sample"``, ``"draw"``): each
    point is the mean over its values (rows that share one are averaged first), drawn
    with a shaded band of ± one standard error of that mean (``stdev / sqrt(n)``, n the
    number of values; no band where n = 1); the hover text gives mean ± s.e. and n;
  - ``"reference": {PARAM: VALUE}``: the rows matching it are drawn as a dashed line and
    not as a series: a horizontal line at their mean when they sit at one x (the full KV
    cache at budget 1.0 beside policies at smaller budgets), else a dashed series over x;
    named in the legend. With ``"split"``, a panel's reference is the reference rows of
    its value when there are any, else all of them.

- ``{"kind": "bars", "x": PARAM, "metric": METRIC, "series": PARAM or None, "spread": PARAM
  or None}``: vertical bars of the mean per category of ``x`` (in the order the rows give,
  numbers sorted), grouped by ``series``; with ``"spread"``, error bars of ± one standard
  error (as for curves), one dot per value of the spread column (its mean), and mean,
  s.e. and n on hover. Optional ``"x_title"`` / ``"y_title"`` (default the ``x`` / metric
  names). E.g. a head-ablation study: ``{"kind": "bars", "x": "ablation", "metric":
  "accuracy", "spread": "draw"}``.

When the rows carry a ``steered`` column with more than one value (a steered run beside
the plain one), each figure is drawn once per value, side by side, on one colour or y
scale. A spec that cannot be drawn becomes a one-line note (and a warning), never an
error.

When ``meta["examples"]`` is a list of dicts each holding ``"answer"``, ``"output"`` and
``"score"`` (what the retrieval probes record per prompt), the Examples section shows
them as a sortable table, failures (score < 1) first: the grid parameters (every other
field), an excerpt of ``"prompt"`` around the answer when there is one, expected, output,
and correct (✓/✗); at most ``MAX_EXAMPLES`` rows, with a note. Other ``examples`` stay in
the Run section's key/value table.

Then a sortable table of the rows (the first ``max_rows``, with a note; results.csv
holds all) and the run's meta: model, parameters, seconds. Inline CSS, JS and SVG,
nothing fetched; every string from the result (parameter values, metric names, the
model's name, the examples' prompts and outputs) is escaped, so a value holding
``<script>`` shows as text.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from html import escape
from typing import Any, Literal, TypeGuard, overload

from .chart import bar_chart, line_chart
from .html import _asset
from .svg import fmt, heatmap

#: the column that marks a steered run beside a plain one (drawn side by side)
SPLIT = "steered"
ALL = object()  # "no split": one panel of every row
MAX_ROWS = 2000
MAX_EXAMPLES = 200
#: heatmap cells: at least this size (px), narrower only when the columns pass GRID_WIDTH
CELL = (40, 26)
GRID_WIDTH = 1100
VALUES_MAX_COLS = 12
#: the fields of an example that are not grid parameters
_EXAMPLE_FIELDS = ("prompt", "answer", "output", "score")

_CSS = """
table.results td.text, table.kv td, table.examples td.text { text-align: left; }
table.kv { border-collapse: collapse; font-size: 13px; }
table.kv th { text-align: left; padding: 3px 12px 3px 0; color: var(--muted); font-weight: 600; vertical-align: top; }
table.kv td { padding: 3px 0; white-space: pre-wrap; word-break: break-word; max-width: 70em; }
table.examples td.text { white-space: pre-wrap; word-break: break-word; min-width: 8em; max-width: 36em; vertical-align: top; }
table.examples th[data-type="text"] { text-align: left; }
table.examples td.prompt { max-width: 44em; color: var(--muted); }
table.examples td.prompt mark { background: #fde9a9; color: var(--fg); }
table.examples td.ok { color: #1b7837; font-weight: 600; text-align: center; }
table.examples td.bad { color: #a4262c; font-weight: 600; text-align: center; }
table.examples tr.fail td { background: #fff6f6; }
.panels { display: flex; flex-wrap: wrap; gap: 12px 18px; }
p.warn { color: #a4262c; }
.panel .panel-title { font-size: 13px; font-weight: 600; margin: 0 0 2px 4px; max-width: 42em; }
.panel svg text.svg-title { display: none; }  /* the panel's HTML title wraps; the SVG's would be clipped */
svg text.axis { font-size: 11px; }
svg text.axis-title { font-size: 12px; font-weight: 600; fill: var(--fg); }
svg text.cell-value { font-size: 11px; }
svg .point:hover, svg .dot:hover { stroke: #000; stroke-width: 1.5; }
"""


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sort_key(value):
    return (0, value, "") if _is_number(value) else (1, 0, str(value))


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _split_values(result, metrics=None, where=None) -> list:
    """The values of the ``steered`` column among the rows of ``metrics`` (all when None)
    at ``where``, when there are several (None for rows without the column); else [None]:
    one panel of every row."""
    rows = [
        r
        for r in result.rows
        if (metrics is None or r["metric"] in metrics) and all(r.get(k) == v for k, v in (where or {}).items())
    ]
    values = sorted(dict.fromkeys(r.get(SPLIT) for r in rows), key=_sort_key)
    return values if len(values) > 1 else [ALL]


def _panel_title(title: str, split, column: str = SPLIT) -> str:
    if split is ALL:
        return title
    return f"{title} — " + (f"without {column}" if split is None else f"{column}={_label(split)}")


def _where(spec: dict, split) -> dict:
    where = dict(spec.get("where") or {})
    if split is not ALL:
        where[SPLIT] = split  # None selects the rows without the column (ProbeResult.select reads row.get)
    return where


def _range(values: list[float], spec: dict) -> tuple[float, float]:
    """The colour (or y) scale: the spec's ``"range": [lo, hi]`` when given; [0, 1] when
    every value lies in it and some reach 0.5 or all are equal (accuracies: panels and runs
    compare on one scale); else the data's range, so that small differences (head scores
    of a few percent) still show."""
    fixed = spec.get("range")
    if fixed is not None:
        if (
            not isinstance(fixed, (list, tuple))
            or len(fixed) != 2
            or not all(_is_number(v) for v in fixed)
            or not fixed[0] < fixed[1]
        ):
            raise ValueError(f"'range' must be [lo, hi] with lo < hi, got {fixed!r}")
        return float(fixed[0]), float(fixed[1])
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if lo >= 0 and hi <= 1 and (hi >= 0.5 or hi == lo):
        return 0.0, 1.0
    return (lo, hi) if hi > lo else (lo - abs(lo) / 2 - 0.5, hi + abs(hi) / 2 + 0.5)  # one value: a band around it


@overload
def _param(spec: dict, key: str, kind: str, required: Literal[True]) -> str: ...


@overload
def _param(spec: dict, key: str, kind: str, required: bool = False) -> str | None: ...


def _param(spec: dict, key: str, kind: str, required: bool = False) -> str | None:
    value = spec.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind}: {key!r} must name a parameter{'' if required else ' or be None'}, got {value!r}")
    return value


def _title_of(spec: dict, key: str, default: str) -> str:
    value = spec.get(key)
    return default if value is None else str(value)


class Stats:
    """The mean of a cell's rows; with a spread column, over that column's values (rows
    sharing a value are averaged first), with n and the standard error of the mean."""

    def __init__(self, rows: list[dict], spread: str | None):
        if spread is None:
            values = [float(r["value"]) for r in rows]
            self.points, self.labels = [], []
        else:
            groups: dict = {}
            for r in rows:
                groups.setdefault(r.get(spread), []).append(float(r["value"]))
            keys = sorted(groups, key=_sort_key)
            values = [sum(groups[k]) / len(groups[k]) for k in keys]
            self.points, self.labels = values, keys
        self.n = len(values)
        self.mean = sum(values) / self.n if self.n else math.nan
        finite = all(math.isfinite(v) for v in values)
        self.se = statistics.stdev(values) / math.sqrt(self.n) if spread and self.n >= 2 and finite else None

    def text(self) -> str:
        if self.se is not None:
            return f"{fmt(self.mean)} ± {fmt(self.se)} s.e. (n = {self.n})"
        if self.points:  # a spread column with one value
            return f"{fmt(self.mean)} (n = {self.n})"
        return fmt(self.mean)


def _heatmap_figure(result, spec: dict, splits: list) -> list[str]:
    rows, cols, metric = spec.get("rows"), spec.get("cols"), spec.get("metric")
    for key, value in (("rows", rows), ("cols", cols), ("metric", metric)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"heatmap: {key!r} must name a {'metric' if key == 'metric' else 'parameter'}, got {value!r}")
    assert isinstance(rows, str) and isinstance(cols, str)  # checked just above
    title = str(spec.get("title") or f"{metric}: {rows} × {cols}")
    tables = []
    for split in splits:
        try:
            tables.append((split, result.table(rows, cols, metric, **_where(spec, split))))
        except ValueError:
            if split is ALL:
                raise
    if not tables:
        raise ValueError(f"heatmap: no {metric!r} rows with both {rows!r} and {cols!r}")
    lo, hi = _range([v for _, t in tables for row in t.values for v in row], spec)
    x_title, y_title = _title_of(spec, "x_title", cols), _title_of(spec, "y_title", rows)
    out = []
    for split, t in tables:
        labels_r, labels_c = [_label(v) for v in t.row_labels], [_label(v) for v in t.col_labels]
        tip = lambda r, c, v, lr=labels_r, lc=labels_c: f"{rows} {lr[r]}, {cols} {lc[c]}: {metric} = {fmt(v)}"
        cw = max(CELL[0], min(64, 7 * max(len(s) for s in labels_c) + 8))
        if cw * len(labels_c) > GRID_WIDTH:  # a very wide grid (a layer × head map of many heads): narrower cells
            cw = max(14, GRID_WIDTH // len(labels_c))
        values = spec.get("values")
        values = len(labels_c) <= VALUES_MAX_COLS and cw >= 30 if values is None else bool(values)
        name = _panel_title(title, split)
        out.append(
            _panel(
                name,
                heatmap(
                    t.values,
                    labels_r,
                    labels_c,
                    name,
                    lo=lo,
                    hi=hi,
                    cell=(cw, CELL[1]),
                    tooltip=tip,
                    x_title=x_title,
                    y_title=y_title,
                    values=values,
                    scale_title=f"colour: {metric}",
                ),
            )
        )
    return out


def _matches(row: dict, where: dict) -> bool:
    return all(row.get(k) == v for k, v in where.items())


def _where_text(where: dict) -> str:
    return ", ".join(f"{k}={_label(v)}" for k, v in where.items())


def _curve_figure(result, spec: dict, splits: list) -> list[str]:
    x, metric = _param(spec, "x", "curve", required=True), spec.get("metric")
    metrics = [metric] if isinstance(metric, str) else list(metric) if isinstance(metric, (list, tuple)) else []
    if not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ValueError(f"curve: 'metric' must name a metric or a list of metrics, got {metric!r}")
    series, split_by, spread = (_param(spec, key, "curve") for key in ("series", "split", "spread"))
    reference = spec.get("reference")
    if reference is not None and (not isinstance(reference, dict) or not reference):
        raise ValueError(f"curve: 'reference' must be a dict of parameter values, got {reference!r}")
    title = str(spec.get("title") or f"{', '.join(metrics)} against {x}")
    ref_name = _where_text(reference) if reference else ""

    def name_of(m, g):
        return " · ".join(part for part in ((m if len(metrics) > 1 else ""), (f"{series}={_label(g)}" if series else "")) if part)

    panels = []  # (title, xs, lines, bands, tips, references)
    for steered in splits:
        where = _where(spec, steered)
        found = [r for m in metrics for r in result.select(m, **where) if x in r and _is_number(r["value"])]
        ref_rows = [r for r in found if reference and _matches(r, reference)]
        rows = [r for r in found if not (reference and _matches(r, reference))]
        if not rows and not ref_rows:
            continue
        values = sorted(dict.fromkeys(r.get(split_by) for r in rows), key=_sort_key) if split_by else [ALL]
        for value in values:
            prows = rows if value is ALL else [r for r in rows if r.get(split_by) == value]
            prefs = ref_rows
            if value is not ALL and any(r.get(split_by) == value for r in ref_rows):
                prefs = [r for r in ref_rows if r.get(split_by) == value]
            ref_xs = list(dict.fromkeys(r[x] for r in prefs))
            xs = sorted(dict.fromkeys([r[x] for r in prows] + (ref_xs if len(ref_xs) > 1 else [])), key=_sort_key)
            if not xs and prefs:
                xs = ref_xs
            groups = sorted(dict.fromkeys(r.get(series) for r in prows), key=_sort_key) if series else [None]
            lines, bands, tips = {}, {}, {}
            for m in metrics:
                for g in groups:
                    cell: dict = {}
                    for r in prows:
                        if r["metric"] == m and (series is None or r.get(series) == g):
                            cell.setdefault(r[x], []).append(r)
                    if not cell:
                        continue
                    name = name_of(m, g)
                    stats = [Stats(cell[v], spread) if v in cell else None for v in xs]
                    lines[name] = [s.mean if s else None for s in stats]
                    if spread:
                        bands[name] = [(s.mean - s.se, s.mean + s.se) if s and s.se is not None else None for s in stats]
                        tips[name] = [
                            f"{name + ': ' if name else ''}{_label(v)} → {s.text()}" if s else None for v, s in zip(xs, stats)
                        ]
            refs: list[dict[str, Any]] = []
            for m in metrics:
                mrows = [r for r in prefs if r["metric"] == m]
                if not mrows:
                    continue
                name = f"{ref_name}{' · ' + m if len(metrics) > 1 else ''} (reference)"
                at = list(dict.fromkeys(r[x] for r in mrows))
                if len(at) == 1:
                    s = Stats(mrows, spread)
                    refs.append({"name": name, "value": s.mean, "tip": f"{name}, {x}={_label(at[0])}: {s.text()}"})
                else:
                    stats = [Stats([r for r in mrows if r[x] == v], spread) if v in at else None for v in xs]
                    refs.append(
                        {
                            "name": name,
                            "ys": [s.mean if s else None for s in stats],
                            "tips": [f"{name}: {_label(v)} → {s.text()}" if s else None for v, s in zip(xs, stats)],
                        }
                    )
            panels.append((_panel_title(_panel_title(title, steered), value, split_by or SPLIT), xs, lines, bands, tips, refs))
    if not panels:
        raise ValueError(f"curve: no numeric rows of {', '.join(map(repr, metrics))} with {x!r}")
    means = [v for p in panels for ys in p[2].values() for v in ys if v is not None]
    means += [ref["value"] for p in panels for ref in p[5] if "value" in ref]
    means += [v for p in panels for ref in p[5] for v in ref.get("ys") or () if v is not None]
    lo, hi = _range(means, spec)
    if spec.get("range") is None and (lo, hi) != (0.0, 1.0):  # the data's range: make room for the bands
        ends = [e for p in panels for band in p[3].values() for b in band if b for e in b]
        lo, hi = _range(means + ends, spec)
    x_title = _title_of(spec, "x_title", x)
    y_title = _title_of(spec, "y_title", metrics[0] if len(metrics) == 1 else "value")
    return [
        _panel(
            name,
            line_chart(xs, lines, name, x_label=x_title, y_label=y_title, lo=lo, hi=hi, bands=bands, tips=tips, references=refs),
        )
        for name, xs, lines, bands, tips, refs in panels
    ]


def _bars_figure(result, spec: dict, splits: list) -> list[str]:
    x, metric = _param(spec, "x", "bars", required=True), spec.get("metric")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"bars: 'metric' must name a metric, got {metric!r}")
    series, spread = _param(spec, "series", "bars"), _param(spec, "spread", "bars")
    title = str(spec.get("title") or f"{metric} by {x}")
    panels = []
    for steered in splits:
        rows = [r for r in result.select(metric, **_where(spec, steered)) if x in r and _is_number(r["value"])]
        if not rows:
            continue
        categories = list(dict.fromkeys(r[x] for r in rows))
        if all(_is_number(c) for c in categories):
            categories.sort()
        groups = sorted(dict.fromkeys(r.get(series) for r in rows), key=_sort_key) if series else [None]
        entries: dict[str, list[dict[str, Any] | None]] = {}
        for g in groups:
            name = f"{series}={_label(g)}" if series else ""
            per: list[dict[str, Any] | None] = []
            for c in categories:
                cell = [r for r in rows if r[x] == c and (series is None or r.get(series) == g)]
                if not cell:
                    per.append(None)
                    continue
                s = Stats(cell, spread)
                where = f"{x}={_label(c)}" + (f", {name}" if name else "")
                per.append(
                    {
                        "mean": s.mean,
                        "se": s.se,
                        "points": s.points,
                        "tip": f"{where}: mean {s.text()}" if spread else f"{where}: mean {fmt(s.mean)} ({len(cell)} rows)",
                        "point_tips": [f"{where}, {spread}={_label(k)}: {fmt(v)}" for k, v in zip(s.labels, s.points)],
                    }
                )
            entries[name] = per
        panels.append((_panel_title(title, steered), categories, entries))
    if not panels:
        raise ValueError(f"bars: no numeric rows of {metric!r} with {x!r}")
    values = [e["mean"] for _, _, entries in panels for per in entries.values() for e in per if e]
    lo, hi = _range(values, spec)
    if spec.get("range") is None:
        extra = [
            v
            for _, _, entries in panels
            for per in entries.values()
            for e in per
            if e
            for v in ([e["mean"] - e["se"], e["mean"] + e["se"]] if e["se"] is not None else []) + e["points"]
        ]
        if (lo, hi) != (0.0, 1.0) or any(v < 0 or v > 1 for v in extra):
            lo, hi = _range(values + extra, spec)
        lo = min(lo, 0.0) if hi > 0 else lo  # bars rise from 0
    x_title, y_title = _title_of(spec, "x_title", x), _title_of(spec, "y_title", metric)
    return [
        _panel(name, bar_chart(categories, entries, name, x_label=x_title, y_label=y_title, lo=lo, hi=hi))
        for name, categories, entries in panels
    ]


_KINDS = {"heatmap": _heatmap_figure, "curve": _curve_figure, "bars": _bars_figure}


def figure_html(result, spec) -> str:
    """One figure spec as HTML: its panels, or a note saying why it cannot be drawn."""
    try:
        if not isinstance(spec, dict):
            raise ValueError(f"a figure spec is a dict, got {type(spec).__name__}")
        kind = spec.get("kind")
        if kind not in _KINDS:
            raise ValueError(f"unknown figure kind {kind!r} (expected {', '.join(_KINDS)})")
        metric = spec.get("metric")
        metrics = set(metric) if isinstance(metric, (list, tuple)) else {metric}
        where = spec.get("where") or {}
        if not isinstance(where, dict):
            raise ValueError(f"'where' must be a dict of parameter values, got {where!r}")
        splits = [ALL] if SPLIT in where or spec.get("split") == SPLIT else _split_values(result, metrics, where)
        svgs = _KINDS[kind](result, spec, splits)
    except (ValueError, TypeError, KeyError) as e:
        warnings.warn(f"probe report: figure {spec!r} not drawn: {e}", stacklevel=2)
        return f'<p class="note warn">A figure could not be drawn: {escape(str(e))}</p>'
    return '<div class="figure"><div class="panels">' + "".join(svgs) + "</div></div>"


def _panel(title: str, svg: str) -> str:
    return f'<div class="panel"><div class="panel-title">{escape(title)}</div>{svg}</div>'


def _cell(value) -> str:
    if value is None or value == "":
        return '<td data-v="">–</td>'
    if isinstance(value, float) and not math.isfinite(value):
        return f'<td data-v="">{escape(str(value))}</td>'  # sorts with the empty cells
    if _is_number(value):
        shown = fmt(value) if isinstance(value, float) else str(value)
        return f'<td data-v="{escape(repr(value))}">{escape(shown)}</td>'
    text = str(value)
    return f'<td class="text" data-v="{escape(text)}">{escape(text)}</td>'


def results_table(result, max_rows: int = MAX_ROWS) -> str:
    columns = result.columns
    numeric = {c: all(_is_number(r[c]) for r in result.rows if r.get(c) not in (None, "")) for c in columns}
    head = "".join(f'<th data-type="{"number" if numeric[c] else "text"}">{escape(c)}</th>' for c in columns)
    shown = result.rows[:max_rows]
    body = "".join("<tr>" + "".join(_cell(r.get(c)) for c in columns) + "</tr>" for r in shown)
    note = (
        "Click a column to sort."
        if len(result.rows) <= max_rows
        else f"Showing the first {max_rows} of {len(result.rows)} rows (click a column to sort them); results.csv holds every row."
    )
    return (
        f'<p class="note">{escape(note)}</p><div class="table-wrap"><table class="heads sortable results">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


# -- examples --------------------------------------------------------------------------------------


def example_rows(meta: dict) -> list[dict] | None:
    """``meta["examples"]`` when it is a list of dicts with answer, output and score (the
    shape drawn as a table), else None."""
    examples = (meta or {}).get("examples")
    if not isinstance(examples, list) or not examples:
        return None
    if not all(isinstance(e, dict) and all(k in e for k in ("answer", "output", "score")) for e in examples):
        return None
    return examples


def _score(example: dict) -> float:
    s = example.get("score")
    if isinstance(s, bool):
        return float(s)
    return float(s) if _is_number(s) and math.isfinite(s) else 0.0


def _short_text(value, limit: int = 300) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str, allow_nan=True)
    return text if len(text) <= limit else text[:limit] + "…"


def _excerpt(prompt: str, anchors: list, width: int = 70) -> str:
    """HTML: the part of ``prompt`` around the first anchor found in it (the answer, the
    key), the anchor marked; else the prompt's end (where the question is). Escaped."""
    for anchor in anchors:
        a = anchor if isinstance(anchor, str) else None if anchor is None else _label(anchor)
        if not a or not a.strip():
            continue
        i = prompt.find(a)
        if i < 0:
            continue
        lo, hi = max(0, i - width), min(len(prompt), i + len(a) + width)
        return (
            ("…" if lo > 0 else "")
            + escape(prompt[lo:i])
            + f"<mark>{escape(prompt[i : i + len(a)])}</mark>"
            + escape(prompt[i + len(a) : hi])
            + ("…" if hi < len(prompt) else "")
        )
    tail = 2 * width
    return ("…" if len(prompt) > tail else "") + escape(prompt[-tail:])


def examples_table(examples: list[dict], limit: int = MAX_EXAMPLES) -> str:
    """The examples as a sortable table, failures (score < 1) first, at most ``limit`` rows."""
    params = list(dict.fromkeys(k for e in examples for k in e if k not in _EXAMPLE_FIELDS))
    has_prompt = any(isinstance(e.get("prompt"), str) for e in examples)
    partial = any(0 < _score(e) < 1 for e in examples)
    order = sorted(range(len(examples)), key=lambda i: (_score(examples[i]) >= 1, i))  # failures first, else as run
    failures = sum(_score(e) < 1 for e in examples)
    shown = order[:limit]
    numeric = {p: all(_is_number(e[p]) for e in examples if e.get(p) not in (None, "")) for p in params}
    head = [f'<th data-type="{"number" if numeric[p] else "text"}">{escape(str(p))}</th>' for p in params]
    if has_prompt:
        head.append('<th data-type="text">prompt (excerpt)</th>')
    head += ['<th data-type="text">expected</th>', '<th data-type="text">output</th>', '<th data-type="number">correct</th>']
    body = []
    for i in shown:
        e = examples[i]
        score = _score(e)
        cells = []
        for p in params:
            v = e.get(p)
            cells.append(_cell(v if v is None or isinstance(v, (str, int, float)) else _short_text(v)))
        if has_prompt:
            prompt = e.get("prompt")
            if isinstance(prompt, str):
                anchors = [e.get("answer"), e.get("key")]
                cells.append(f'<td class="text prompt" data-v="{escape(prompt[:200])}">{_excerpt(prompt, anchors)}</td>')
            else:
                cells.append('<td data-v="">–</td>')
        for v in (e.get("answer"), e.get("output")):
            text = "" if v is None else _short_text(v)
            cells.append(f'<td class="text" data-v="{escape(text)}">{escape(text)}</td>')
        mark = "✓" if score >= 1 else "✗" + (f" ({fmt(score)})" if partial and score > 0 else "")
        cells.append(
            f'<td class="{"ok" if score >= 1 else "bad"}" data-v="{score!r}" '
            f'title="score {escape(fmt(score))}">{escape(mark)}</td>'
        )
        body.append(f'<tr class="{"pass" if score >= 1 else "fail"}">' + "".join(cells) + "</tr>")
    note = f"{failures} of {len(examples)} answers wrong (score < 1); failures first. Click a column to sort."
    if len(examples) > limit:
        note += f" Showing {limit} of {len(examples)} examples (every failure first); results.json holds them all."
    return (
        f'<p class="note">{escape(note)}</p><div class="table-wrap"><table class="heads sortable examples">'
        f"<thead><tr>{''.join(head)}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


# -- the run ---------------------------------------------------------------------------------------


def _text(value, limit: int = 4000) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str, allow_nan=True)
    return text if len(text) <= limit else text[:limit] + f" … ({len(text) - limit} more characters)"


def meta_table(result) -> str:
    meta = result.meta or {}
    items = [("probe", result.probe), ("model", meta.get("model", "?"))]
    if _is_number(meta.get("seconds")):
        items.append(("seconds", f"{meta['seconds']:.2f}"))
    params = meta.get("params")
    if isinstance(params, dict):
        items += [(f"--{str(k).replace('_', '-')}", v) for k, v in params.items()]
    elif params is not None:
        items.append(("params", params))
    skip = {"model", "seconds", "params", "figures"} | ({"examples"} if example_rows(meta) is not None else set())
    items += [(str(k), v) for k, v in meta.items() if k not in skip]
    rows = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(_text(v))}</td></tr>" for k, v in items)
    return f'<table class="kv">{rows}</table>'


def render_probe_html(result, *, title: str | None = None, max_rows: int = MAX_ROWS) -> str:
    """The report page of ``result`` (a ``ProbeResult``) as a string."""
    from ..probes.result import ProbeResult

    if not isinstance(result, ProbeResult):
        raise ValueError(f"result: expected a ProbeResult, got {type(result).__name__}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows: expected an int >= 1, got {max_rows!r}")
    meta = result.meta or {}
    model = str(meta.get("model") or "model")
    title = title or f"attnkit probe {result.probe} — {model}"
    line = f"{len(result.rows)} rows · metrics: {', '.join(result.metrics) or 'none'}"
    if _is_number(meta.get("seconds")):
        line += f" · {meta['seconds']:.1f} s"
    specs = meta.get("figures") or []
    if not isinstance(specs, list):
        specs = [specs]
    if specs:
        figures = (
            '<p class="note">Hover a cell, point or bar for its value.</p><div class="grid">'
            + "".join(figure_html(result, spec) for spec in specs)
            + "</div>"
        )
        splits = [s for s in _split_values(result) if s is not ALL and s is not None]
        if splits:
            figures = (
                f'<p class="note">A figure whose rows differ in {escape(SPLIT)} '
                f"({escape(', '.join(_label(s) for s in splits))}) is drawn once per value, side by side on one scale.</p>"
                + figures
            )
    else:
        figures = '<p class="note">This probe declared no figures; its rows are below.</p>'
    sections = [("figures", "Figures", figures)]
    examples = example_rows(meta)
    if examples is not None:
        sections.append(("examples", "Examples", examples_table(examples)))
    sections += [("results", "Results", results_table(result, max_rows)), ("run", "Run", meta_table(result))]
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{escape(name)}</h2>{content}</section>' for sid, name, content in sections)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_asset('report.css')}{_CSS}</style></head><body>"
        f'<header><h1>{escape(title)}</h1><p class="meta">{escape(line)}</p></header>'
        f"<nav>{nav}</nav><main>{body}</main><script>{_asset('report.js')}</script></body></html>"
    )


def write_probe_report(result, out_dir: str, *, title: str | None = None, max_rows: int = MAX_ROWS) -> str:
    """Write ``report.html`` for ``result`` into ``out_dir``; returns its path."""
    html = render_probe_html(result, title=title, max_rows=max_rows)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path
