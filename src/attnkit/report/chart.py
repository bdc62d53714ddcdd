"""An SVG line chart as a plain string: one line per series, a point per x value.

Drawn on the server side like the heatmaps (no JavaScript, nothing fetched); every
label and tooltip goes through ``html.escape``. Numeric x values that span a wide
range of positive values (token lengths 256 .. 32768) get a log2 axis so that doublings
sit evenly; other x values are spaced evenly in the order given.
"""

from __future__ import annotations

import math
from html import escape

from .svg import fmt

#: categorical colours (Okabe & Ito 2008, distinguishable by colour-blind readers)
PALETTE = ["#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442", "#000000"]


def _numeric(values) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _label(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def line_chart(xs: list, series: dict[str, list[float | None]], title: str, x_label: str = "", y_label: str = "",
               lo: float | None = None, hi: float | None = None, size: tuple[int, int] = (460, 250)) -> str:
    """``series``: name -> one y value per entry of ``xs`` (None/NaN: no point there;
    the line breaks). ``lo``/``hi`` fix the y range (default: the data's, from 0 when
    every value is >= 0, and [0, 1] when every value lies in it)."""
    values = [v for ys in series.values() for v in ys if v is not None and math.isfinite(v)]
    if lo is None:
        lo = min(values + [0.0]) if values else 0.0
    if hi is None:
        hi = max(values) if values else 1.0
        if values and lo >= 0 and hi <= 1:
            hi = 1.0
    if hi <= lo:
        hi = lo + 1.0
    width, height = size
    legend_w = min(220, 24 + 6 * max(len(name) for name in series)) if any(series) else 0  # unnamed: no legend
    ticks = [lo + (hi - lo) * i / 4 for i in range(5)]
    left = 26 + 6 * max(len(fmt(v)) for v in ticks)  # room for the tick labels and the rotated axis name
    right, top, bottom = 14 + legend_w, 24, 40
    pw, ph = width - left - right, height - top - bottom
    if pw < 120:
        width += 120 - pw
        pw = 120

    numeric = _numeric(xs)
    log = numeric and all(x > 0 for x in xs) and max(xs) / min(xs) >= 16
    if numeric:
        tx = [math.log2(x) for x in xs] if log else [float(x) for x in xs]
        a, b = min(tx), max(tx)
        pos = [left + (pw / 2 if b == a else (t - a) / (b - a) * pw) for t in tx]
    else:
        pos = [left + (pw / 2 if len(xs) == 1 else i / (len(xs) - 1) * pw) for i in range(len(xs))]

    def y_of(v: float) -> float:
        return top + ph - (min(max(v, lo), hi) - lo) / (hi - lo) * ph

    out = [f'<svg class="curve" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text x="{left}" y="14" class="svg-title">{escape(title)}</text>']
    # y grid and ticks
    for v in ticks:
        y = y_of(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e4e4ea" stroke-width="1"/>')
        out.append(f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" class="axis">{escape(fmt(v))}</text>')
    # x ticks: every value when they fit, else about eight
    every = max(1, math.ceil(len(xs) / 8))
    for i, (x, px) in enumerate(zip(xs, pos)):
        if i % every and i != len(xs) - 1:
            continue
        out.append(f'<line x1="{px:.1f}" y1="{top + ph}" x2="{px:.1f}" y2="{top + ph + 4}" stroke="#888" stroke-width="1"/>')
        out.append(f'<text x="{px:.1f}" y="{top + ph + 15}" text-anchor="middle" class="axis">{escape(_label(x))}</text>')
    out.append(f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#888" stroke-width="1"/>')
    if x_label:
        out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="axis">'
                   f'{escape(x_label + (" (log scale)" if log else ""))}</text>')
    if y_label:
        out.append(f'<text x="12" y="{top + ph / 2}" transform="rotate(-90 12 {top + ph / 2})" text-anchor="middle" class="axis">'
                   f"{escape(y_label)}</text>")
    for k, (name, ys) in enumerate(series.items()):
        col = PALETTE[k % len(PALETTE)]
        dash = ' stroke-dasharray="5 3"' if (k // len(PALETTE)) % 2 else ""  # past eight series: dashed lines
        runs, run = [], []
        for px, v in zip(pos, ys):
            if v is None or not math.isfinite(v):
                if run:
                    runs.append(run)
                run = []
            else:
                run.append((px, y_of(v)))
        if run:
            runs.append(run)
        for run in runs:
            if len(run) > 1:
                points = " ".join(f"{px:.1f},{py:.1f}" for px, py in run)
                out.append(f'<polyline fill="none" stroke="{col}" stroke-width="2"{dash} points="{points}"/>')
        for x, px, v in zip(xs, pos, ys):
            if v is not None and math.isfinite(v):
                tip = f"{name}: {_label(x)} → {fmt(v)}" if name else f"{_label(x)} → {fmt(v)}"
                out.append(f'<circle class="point" cx="{px:.1f}" cy="{y_of(v):.1f}" r="3" fill="{col}">'
                           f"<title>{escape(tip)}</title></circle>")
        if legend_w and name:
            ly = top + 6 + 16 * k
            out.append(f'<line x1="{width - legend_w + 4}" y1="{ly - 6}" x2="{width - legend_w + 16}" y2="{ly - 6}" '
                       f'stroke="{col}" stroke-width="3"{dash}/>')
            out.append(f'<text x="{width - legend_w + 20}" y="{ly - 3}" class="axis">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)
