"""The probe report: one self-contained HTML page for a ``ProbeResult``.

What to draw comes from the result itself: ``meta["figures"]`` lists figure specs,

- ``{"kind": "heatmap", "rows": PARAM, "cols": PARAM, "metric": METRIC, "title": TEXT}``:
  the pivot ``result.table(rows, cols, metric)`` (cells averaged over everything else,
  e.g. samples) as a viridis heatmap;
- ``{"kind": "curve", "x": PARAM, "metric": METRIC or [METRICS], "series": PARAM or None,
  "title": TEXT}``: the mean of each metric against ``x``, one line per value of ``series``;

either may add ``"where": {PARAM: VALUE}`` to draw a slice and ``"range": [lo, hi]`` to fix
the scale (default: [0, 1] for values in it that reach 0.5, else the data's range). When the rows carry a
``steered`` column with more than one value (a steered run beside the plain one), each
figure is drawn once per value, side by side, on one colour or y scale.

Then a sortable table of the rows (the first ``max_rows``, with a note; results.csv
holds all) and the run's meta: model, parameters, seconds. Inline CSS, JS and SVG,
nothing fetched; every string from the result (parameter values, metric names, the
model's name) is escaped, so a value holding ``<script>`` shows as text.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from html import escape

from .chart import line_chart
from .html import _asset
from .svg import fmt, heatmap

#: the column that marks a steered run beside a plain one (drawn side by side)
SPLIT = "steered"
ALL = object()  # "no split": one panel of every row
MAX_ROWS = 2000

_CSS = """
table.results td.text, table.kv td { text-align: left; }
table.kv { border-collapse: collapse; font-size: 13px; }
table.kv th { text-align: left; padding: 3px 12px 3px 0; color: var(--muted); font-weight: 600; vertical-align: top; }
table.kv td { padding: 3px 0; white-space: pre-wrap; word-break: break-word; max-width: 70em; }
.panels { display: flex; flex-wrap: wrap; gap: 12px 18px; }
p.warn { color: #a4262c; }
.panel .panel-title { font-size: 12px; font-weight: 600; margin: 0 0 2px 4px; max-width: 36em; }
.panel svg text.svg-title { display: none; }  /* the panel's HTML title wraps; the SVG's would be clipped */
"""


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sort_key(value):
    return (0, value, "") if _is_number(value) else (1, 0, str(value))


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _split_values(result, metrics=None, where=None) -> list:
    """The values of the ``steered`` column among the rows of ``metrics`` (all when None)
    at ``where``, when there are several (None for rows without the column); else [None]:
    one panel of every row."""
    rows = [r for r in result.rows if (metrics is None or r["metric"] in metrics)
            and all(r.get(k) == v for k, v in (where or {}).items())]
    values = sorted(dict.fromkeys(r.get(SPLIT) for r in rows), key=_sort_key)
    return values if len(values) > 1 else [ALL]


def _panel_title(title: str, split) -> str:
    if split is ALL:
        return title
    return f"{title} — " + (f"without {SPLIT}" if split is None else f"{SPLIT}={_label(split)}")


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
        if (not isinstance(fixed, (list, tuple)) or len(fixed) != 2 or not all(_is_number(v) for v in fixed)
                or not fixed[0] < fixed[1]):
            raise ValueError(f"'range' must be [lo, hi] with lo < hi, got {fixed!r}")
        return float(fixed[0]), float(fixed[1])
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if lo >= 0 and hi <= 1 and (hi >= 0.5 or hi == lo):
        return 0.0, 1.0
    return (lo, hi) if hi > lo else (lo - abs(lo) / 2 - 0.5, hi + abs(hi) / 2 + 0.5)  # one value: a band around it


def _heatmap_figure(result, spec: dict, splits: list) -> list[str]:
    rows, cols, metric = spec.get("rows"), spec.get("cols"), spec.get("metric")
    for key, value in (("rows", rows), ("cols", cols), ("metric", metric)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"heatmap: {key!r} must name a {'metric' if key == 'metric' else 'parameter'}, got {value!r}")
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
    out = []
    for split, t in tables:
        labels_r, labels_c = [_label(v) for v in t.row_labels], [_label(v) for v in t.col_labels]
        tip = (lambda r, c, v, lr=labels_r, lc=labels_c: f"{rows} {lr[r]}, {cols} {lc[c]}: {metric} = {fmt(v)}")
        cw = max(26, min(60, 7 * max(len(s) for s in labels_c) + 6))
        name = _panel_title(title, split)
        out.append(_panel(name, heatmap(t.values, [f"{rows} {s}" for s in labels_r], labels_c, name, lo=lo, hi=hi,
                                        cell=(cw, 18), tooltip=tip)))
    return out


def _curve_figure(result, spec: dict, splits: list) -> list[str]:
    x, metric, series = spec.get("x"), spec.get("metric"), spec.get("series")
    metrics = [metric] if isinstance(metric, str) else list(metric) if isinstance(metric, (list, tuple)) else []
    if not isinstance(x, str) or not x:
        raise ValueError(f"curve: 'x' must name a parameter, got {x!r}")
    if not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ValueError(f"curve: 'metric' must name a metric or a list of metrics, got {metric!r}")
    if series is not None and not isinstance(series, str):
        raise ValueError(f"curve: 'series' must name a parameter or be None, got {series!r}")
    title = str(spec.get("title") or f"{', '.join(metrics)} against {x}")
    panels = []
    for split in splits:
        where = _where(spec, split)
        found = [r for m in metrics for r in result.select(m, **where) if x in r and _is_number(r["value"])]
        if not found:
            continue
        xs = sorted(dict.fromkeys(r[x] for r in found), key=_sort_key)
        groups = sorted(dict.fromkeys(r.get(series) for r in found), key=_sort_key) if series else [None]
        lines = {}
        for m in metrics:
            for g in groups:
                cell = {}
                for r in found:
                    if r["metric"] == m and (series is None or r.get(series) == g):
                        cell.setdefault(r[x], []).append(float(r["value"]))
                if not cell:
                    continue
                name = " · ".join(part for part in ((m if len(metrics) > 1 else ""),
                                                     (f"{series}={_label(g)}" if series else "")) if part)
                lines[name] = [sum(cell[v]) / len(cell[v]) if v in cell else None for v in xs]
        panels.append((split, xs, lines))
    if not panels:
        raise ValueError(f"curve: no numeric rows of {', '.join(map(repr, metrics))} with {x!r}")
    lo, hi = _range([v for _, _, lines in panels for ys in lines.values() for v in ys if v is not None], spec)
    y_label = metrics[0] if len(metrics) == 1 else "value"
    return [_panel(_panel_title(title, split), line_chart(xs, lines, _panel_title(title, split), x_label=x, y_label=y_label,
                                                         lo=lo, hi=hi))
            for split, xs, lines in panels]


_KINDS = {"heatmap": _heatmap_figure, "curve": _curve_figure}


def figure_html(result, spec) -> str:
    """One figure spec as HTML: its panels, or a note saying why it cannot be drawn."""
    try:
        if not isinstance(spec, dict):
            raise ValueError(f"a figure spec is a dict, got {type(spec).__name__}")
        kind = spec.get("kind")
        if kind not in _KINDS:
            raise ValueError(f"unknown figure kind {kind!r} (expected {' or '.join(_KINDS)})")
        metric = spec.get("metric")
        metrics = set(metric) if isinstance(metric, (list, tuple)) else {metric}
        where = spec.get("where") or {}
        if not isinstance(where, dict):
            raise ValueError(f"'where' must be a dict of parameter values, got {where!r}")
        splits = [ALL] if SPLIT in where else _split_values(result, metrics, where)
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
    note = ("Click a column to sort." if len(result.rows) <= max_rows else
            f"Showing the first {max_rows} of {len(result.rows)} rows (click a column to sort them); results.csv holds every row.")
    return (f'<p class="note">{escape(note)}</p><div class="table-wrap"><table class="heads sortable results">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


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
    items += [(str(k), v) for k, v in meta.items() if k not in ("model", "seconds", "params", "figures")]
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
        figures = '<div class="grid">' + "".join(figure_html(result, spec) for spec in specs) + "</div>"
        splits = [s for s in _split_values(result) if s is not ALL and s is not None]
        if splits:
            figures = (f'<p class="note">A figure whose rows differ in {escape(SPLIT)} '
                       f"({escape(', '.join(_label(s) for s in splits))}) is drawn once per value, side by side on one scale.</p>"
                       + figures)
    else:
        figures = '<p class="note">This probe declared no figures; its rows are below.</p>'
    sections = [("figures", "Figures", figures), ("results", "Results", results_table(result, max_rows)),
                ("run", "Run", meta_table(result))]
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{escape(name)}</h2>{content}</section>' for sid, name, content in sections)
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{_asset('report.css')}{_CSS}</style></head><body>"
            f'<header><h1>{escape(title)}</h1><p class="meta">{escape(line)}</p></header>'
            f"<nav>{nav}</nav><main>{body}</main><script>{_asset('report.js')}</script></body></html>")


def write_probe_report(result, out_dir: str, *, title: str | None = None, max_rows: int = MAX_ROWS) -> str:
    """Write ``report.html`` for ``result`` into ``out_dir``; returns its path."""
    html = render_probe_html(result, title=title, max_rows=max_rows)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path
