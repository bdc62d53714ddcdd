"""SVG charts as plain strings: a line chart (one line per series, a point per x value,
optional shaded bands and dashed reference lines) and a grouped bar chart (means with
error bars and the individual points as dots).

Drawn on the server side like the heatmaps (no JavaScript, nothing fetched); every
label and tooltip goes through ``html.escape``. Numeric x values that span a wide
range of positive values (token lengths 256 .. 32768) get a log2 axis so that doublings
sit evenly; other x values are spaced evenly in the order given.

Every y gridline carries its value (``<line class="grid" data-v="...">``), so a reader
of the SVG (a test) can map pixels back to values.
"""

from __future__ import annotations

import math
from html import escape
from typing import TypeGuard

from .svg import fmt

#: categorical colours (Okabe & Ito 2008, distinguishable by colour-blind readers)
PALETTE = ["#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442", "#000000"]
#: the colour of reference lines (drawn dashed)
REFERENCE = "#444444"
CHAR_W = 6.2  # a generous width of one character of the 10px axis font, in pixels
LEGEND_ROW = 16


def _numeric(values) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _finite(v: object) -> TypeGuard[float]:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _label(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _text_w(text: str) -> float:
    return CHAR_W * len(text)


def _y_range(values: list[float], lo, hi) -> tuple[float, float]:
    if lo is None:
        lo = min(values + [0.0]) if values else 0.0
    if hi is None:
        hi = max(values) if values else 1.0
        if values and lo >= 0 and hi <= 1:
            hi = 1.0
    if hi <= lo:
        hi = lo + 1.0
    return float(lo), float(hi)


class _Frame:
    """The axes of a chart: margins, the y scale, gridlines, axis titles and a legend that
    always fits (on the right when its names are short, else below the plot)."""

    def __init__(self, title, lo, hi, size, legend: list[tuple[str, str, str]], x_label, y_label, min_pw=120, x_label_h=15):
        self.lo, self.hi = lo, hi
        self.legend = legend  # (name, colour, kind: "line" / "dash" / "box")
        self.title, self.x_label, self.y_label = title, x_label, y_label
        width, height = size
        self.ticks = [lo + (hi - lo) * i / 4 for i in range(5)]
        longest = max((len(name) for name, _, _ in legend), default=0)
        self.legend_right = bool(legend) and longest <= 34
        legend_w = 28 + _text_w("m" * longest) if self.legend_right else 0
        self.left = 30 + _text_w(max((fmt(v) for v in self.ticks), key=len))  # tick labels and the rotated axis title
        self.top = 24
        self.x_label_h = x_label_h
        self.bottom = 12 + x_label_h + (22 if x_label else 0)
        self.right = 14 + legend_w
        self.pw = max(min_pw, width - self.left - self.right)
        self.ph = max(120, height - self.top - self.bottom)
        self.width = math.ceil(self.left + self.pw + self.right)
        self.height = self.top + self.ph + self.bottom
        if self.legend_right:  # tall legends grow the chart rather than run off its bottom
            self.height = max(self.height, self.top + LEGEND_ROW * len(legend) + 8)
        elif legend:
            self.legend_y = self.height
            self.height += LEGEND_ROW * len(legend) + 6
            self.width = max(self.width, math.ceil(self.left + 28 + _text_w("m" * longest) + 8))

    def y(self, v: float) -> float:
        return self.top + self.ph - (min(max(v, self.lo), self.hi) - self.lo) / (self.hi - self.lo) * self.ph

    def open(self, cls: str) -> list[str]:
        out = [
            f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{escape(self.title)}">',
            f'<text x="{self.left:.1f}" y="14" class="svg-title">{escape(self.title)}</text>',
        ]
        x2 = self.left + self.pw
        for v in self.ticks:
            y = self.y(v)
            out.append(
                f'<line class="grid" data-v="{v!r}" x1="{self.left:.1f}" y1="{y:.1f}" x2="{x2:.1f}" y2="{y:.1f}" '
                'stroke="#e4e4ea" stroke-width="1"/>'
            )
            out.append(f'<text x="{self.left - 4:.1f}" y="{y + 3:.1f}" text-anchor="end" class="axis">{escape(fmt(v))}</text>')
        base = self.top + self.ph
        out.append(f'<line x1="{self.left:.1f}" y1="{base}" x2="{x2:.1f}" y2="{base}" stroke="#888" stroke-width="1"/>')
        if self.x_label:
            out.append(
                f'<text x="{self.left + self.pw / 2:.1f}" y="{self.top + self.ph + self.x_label_h + 20}" '
                f'text-anchor="middle" class="axis-title">{escape(self.x_label)}</text>'
            )
        if self.y_label:
            cy = self.top + self.ph / 2
            out.append(
                f'<text x="12" y="{cy:.1f}" transform="rotate(-90 12 {cy:.1f})" text-anchor="middle" '
                f'class="axis-title">{escape(self.y_label)}</text>'
            )
        return out

    def close(self, out: list[str]) -> str:
        if self.legend:
            if self.legend_right:
                x0, y0 = self.left + self.pw + 14, self.top + 6
            else:
                x0, y0 = self.left, self.legend_y + 10
            for k, (name, col, kind) in enumerate(self.legend):
                ly = y0 + LEGEND_ROW * k
                if kind == "box":
                    out.append(f'<rect x="{x0 + 2:.1f}" y="{ly - 11}" width="12" height="10" fill="{col}"/>')
                else:
                    dash = ' stroke-dasharray="5 3"' if kind == "dash" else ""
                    out.append(
                        f'<line x1="{x0:.1f}" y1="{ly - 6}" x2="{x0 + 16:.1f}" y2="{ly - 6}" stroke="{col}" '
                        f'stroke-width="{2 if kind == "dash" else 3}"{dash}/>'
                    )
                out.append(f'<text x="{x0 + 22:.1f}" y="{ly - 2}" class="axis legend-entry">{escape(name)}</text>')
        out.append("</svg>")
        return "".join(out)


def line_chart(
    xs: list,
    series: dict[str, list[float | None]],
    title: str,
    x_label: str = "",
    y_label: str = "",
    lo: float | None = None,
    hi: float | None = None,
    size: tuple[int, int] = (560, 320),
    *,
    bands: dict[str, list] | None = None,
    tips: dict[str, list] | None = None,
    references: list[dict] | None = None,
) -> str:
    """``series``: name -> one y value per entry of ``xs`` (None/NaN: no point there;
    the line breaks). ``lo``/``hi`` fix the y range (default: the data's, from 0 when
    every value is >= 0, and [0, 1] when every value lies in it).

    ``bands``: name -> per x a ``(low, high)`` pair or None, drawn as a shaded band behind
    the series' line (a single point gets an error bar). ``tips``: name -> per x the hover
    text of the point (default ``"name: x → value"``). ``references``: dashed lines, each
    ``{"name", "value", "tip"}`` (a horizontal line across the plot) or ``{"name", "ys",
    "tips"}`` (a dashed series over ``xs``), named in the legend."""
    references = references or []
    bands, tips = bands or {}, tips or {}
    values = [v for ys in series.values() for v in ys if _finite(v)]
    values += [ref["value"] for ref in references if _finite(ref.get("value"))]
    values += [v for ref in references for v in ref.get("ys") or () if _finite(v)]
    lo, hi = _y_range(values, lo, hi)
    legend = [
        (name, PALETTE[k % len(PALETTE)], "dash" if (k // len(PALETTE)) % 2 else "line") for k, name in enumerate(series) if name
    ]
    legend += [(ref["name"], REFERENCE, "dash") for ref in references if ref.get("name")]
    numeric = _numeric(xs)
    log = numeric and all(x > 0 for x in xs) and max(xs) / min(xs) >= 16
    f = _Frame(title, lo, hi, size, legend, x_label + (" (log scale)" if log and x_label else ""), y_label)
    left, pw, ph, top = f.left, f.pw, f.ph, f.top
    if numeric:
        tx = [math.log2(x) for x in xs] if log else [float(x) for x in xs]
        a, b = min(tx), max(tx)
        pos = [left + (pw / 2 if b == a else (t - a) / (b - a) * pw) for t in tx]
    else:
        pos = [left + (pw / 2 if len(xs) == 1 else i / (len(xs) - 1) * pw) for i in range(len(xs))]

    out = f.open("curve")
    # x ticks: every value when they fit, else about eight
    every = max(
        1, math.ceil(len(xs) / 8), math.ceil(len(xs) * (_text_w(max((_label(x) for x in xs), key=len, default="")) + 8) / pw)
    )
    for i, (x, px) in enumerate(zip(xs, pos)):
        if i % every and i != len(xs) - 1:
            continue
        out.append(f'<line x1="{px:.1f}" y1="{top + ph}" x2="{px:.1f}" y2="{top + ph + 4}" stroke="#888" stroke-width="1"/>')
        out.append(f'<text x="{px:.1f}" y="{top + ph + 15}" text-anchor="middle" class="axis">{escape(_label(x))}</text>')

    def runs_of(values_at):
        """Contiguous runs of (px, value) where ``values_at`` has a value."""
        runs, run = [], []
        for px, v in zip(pos, values_at):
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                if run:
                    runs.append(run)
                run = []
            else:
                run.append((px, v))
        if run:
            runs.append(run)
        return runs

    # bands first, under every line
    for k, (name, _ys) in enumerate(series.items()):
        col = PALETTE[k % len(PALETTE)]
        band = bands.get(name)
        if not band:
            continue
        clean = [b if b is not None and _finite(b[0]) and _finite(b[1]) else None for b in band]
        for run in runs_of(clean):
            if len(run) == 1:
                px, (b_lo, b_hi) = run[0]
                out.append(
                    f'<line class="band" x1="{px:.1f}" y1="{f.y(b_lo):.1f}" x2="{px:.1f}" y2="{f.y(b_hi):.1f}" '
                    f'stroke="{col}" stroke-opacity="0.45" stroke-width="6"/>'
                )
                continue
            upper = " ".join(f"{px:.1f},{f.y(b_hi):.1f}" for px, (_, b_hi) in run)
            lower = " ".join(f"{px:.1f},{f.y(b_lo):.1f}" for px, (b_lo, _) in reversed(run))
            out.append(
                f'<polygon class="band" data-series="{escape(name)}" points="{upper} {lower}" fill="{col}" '
                'fill-opacity="0.18" stroke="none"/>'
            )
    for ref in references:
        name = ref.get("name") or ""
        if _finite(ref.get("value")):
            y = f.y(ref["value"])
            tip = ref.get("tip") or f"{name}: {fmt(ref['value'])}"
            out.append(
                f'<line class="reference" x1="{left:.1f}" y1="{y:.1f}" x2="{left + pw:.1f}" y2="{y:.1f}" '
                f'stroke="{REFERENCE}" stroke-width="2" stroke-dasharray="6 4"><title>{escape(tip)}</title></line>'
            )
        elif ref.get("ys"):
            ref_tips = ref.get("tips") or [None] * len(xs)
            for run in runs_of(ref["ys"]):
                if len(run) > 1:
                    points = " ".join(f"{px:.1f},{f.y(v):.1f}" for px, v in run)
                    out.append(
                        f'<polyline class="reference" fill="none" stroke="{REFERENCE}" stroke-width="2" '
                        f'stroke-dasharray="6 4" points="{points}"/>'
                    )
            for x, px, v, tip in zip(xs, pos, ref["ys"], ref_tips):
                if _finite(v):
                    tip = tip or f"{name}: {_label(x)} → {fmt(v)}"
                    out.append(
                        f'<circle class="reference-point" cx="{px:.1f}" cy="{f.y(v):.1f}" r="3" fill="#fff" '
                        f'stroke="{REFERENCE}" stroke-width="1.5"><title>{escape(tip)}</title></circle>'
                    )
    for k, (name, ys) in enumerate(series.items()):
        col = PALETTE[k % len(PALETTE)]
        dash = ' stroke-dasharray="5 3"' if (k // len(PALETTE)) % 2 else ""  # past eight series: dashed lines
        for run in runs_of(ys):
            if len(run) > 1:
                points = " ".join(f"{px:.1f},{f.y(v):.1f}" for px, v in run)
                out.append(f'<polyline fill="none" stroke="{col}" stroke-width="2"{dash} points="{points}"/>')
        point_tips = tips.get(name) or [None] * len(xs)
        for x, px, v, tip in zip(xs, pos, ys, point_tips):
            if _finite(v):
                if tip is None:
                    tip = f"{name}: {_label(x)} → {fmt(v)}" if name else f"{_label(x)} → {fmt(v)}"
                out.append(
                    f'<circle class="point" cx="{px:.1f}" cy="{f.y(v):.1f}" r="3" fill="{col}">'
                    f"<title>{escape(tip)}</title></circle>"
                )
    return f.close(out)


def bar_chart(
    categories: list,
    groups: dict[str, list],
    title: str,
    x_label: str = "",
    y_label: str = "",
    lo: float | None = None,
    hi: float | None = None,
    size: tuple[int, int] = (560, 320),
) -> str:
    """Vertical grouped bars: for each category, one bar per group (name -> one entry per
    category: None, or a dict with ``mean``, optional ``se`` (an error bar of ± se),
    ``points`` (values drawn as dots over the bar), ``tip`` (the bar's hover text) and
    ``point_tips``). A group named "" draws without a legend. Bars rise from 0 (or
    from ``lo`` when the range lies above 0)."""
    values = []
    for entries in groups.values():
        for e in entries:
            if e is None or not _finite(e.get("mean")):
                continue
            values.append(e["mean"])
            if _finite(e.get("se")):
                values += [e["mean"] - e["se"], e["mean"] + e["se"]]
            values += [p for p in e.get("points") or () if _finite(p)]
    lo, hi = _y_range(values, lo, hi)
    named = [name for name in groups if name]
    legend = [(name, PALETTE[k % len(PALETTE)], "box") for k, name in enumerate(groups) if name]
    n_groups = max(1, len(groups))
    labels = [_label(c) for c in categories]
    longest = max((len(s) for s in labels), default=1)
    slant = _text_w(labels and max(labels, key=len) or "") > 150
    cat_w = max(64, 26 * n_groups + 24, min(160, _text_w("m" * longest) + 12))
    x_label_h = 15 if not slant else 12 + int(0.7 * _text_w("m" * min(longest, 40)))
    f = _Frame(
        title,
        lo,
        hi,
        size,
        legend if named else [],
        x_label,
        y_label,
        min_pw=cat_w * max(1, len(categories)),
        x_label_h=x_label_h,
    )
    cat_w = f.pw / max(1, len(categories))
    bar_w = min(44.0, (cat_w - 16) / n_groups)
    base = f.y(max(lo, min(0.0, hi)))
    out = f.open("bars")
    for i, label in enumerate(labels):
        cx = f.left + (i + 0.5) * cat_w
        ty = f.top + f.ph + 15
        if slant:
            out.append(
                f'<text x="{cx:.1f}" y="{ty}" transform="rotate(-35 {cx:.1f} {ty})" text-anchor="end" '
                f'class="axis">{escape(label)}</text>'
            )
        else:
            out.append(f'<text x="{cx:.1f}" y="{ty}" text-anchor="middle" class="axis">{escape(label)}</text>')
    for k, (name, entries) in enumerate(groups.items()):
        col = PALETTE[k % len(PALETTE)]
        for i, e in enumerate(entries):
            if e is None or not _finite(e.get("mean")):
                continue
            x0 = f.left + i * cat_w + (cat_w - bar_w * n_groups) / 2 + k * bar_w
            cx = x0 + bar_w / 2
            top = f.y(e["mean"])
            y0, h = min(top, base), abs(base - top)
            tip = e.get("tip") or (f"{name}: {fmt(e['mean'])}" if name else fmt(e["mean"]))
            out.append(
                f'<rect class="bar" data-series="{escape(name)}" data-category="{escape(labels[i])}" '
                f'x="{x0 + 1:.1f}" y="{y0:.1f}" width="{max(bar_w - 2, 1):.1f}" height="{h:.1f}" fill="{col}" '
                f'fill-opacity="0.75"><title>{escape(tip)}</title></rect>'
            )
            if _finite(e.get("se")) and e["se"] > 0:
                y_lo, y_hi = f.y(e["mean"] - e["se"]), f.y(e["mean"] + e["se"])
                cap = min(8.0, bar_w / 3)
                out.append(
                    f'<g class="err"><line x1="{cx:.1f}" y1="{y_hi:.2f}" x2="{cx:.1f}" y2="{y_lo:.2f}" '
                    f'stroke="#222" stroke-width="1.5"/>'
                    f'<line x1="{cx - cap:.1f}" y1="{y_hi:.2f}" x2="{cx + cap:.1f}" y2="{y_hi:.2f}" stroke="#222" stroke-width="1.5"/>'
                    f'<line x1="{cx - cap:.1f}" y1="{y_lo:.2f}" x2="{cx + cap:.1f}" y2="{y_lo:.2f}" stroke="#222" stroke-width="1.5"/>'
                    f"<title>{escape(tip)}</title></g>"
                )
            points = [p for p in e.get("points") or ()]
            point_tips = e.get("point_tips") or [None] * len(points)
            for j, (p, ptip) in enumerate(zip(points, point_tips)):
                if not _finite(p):
                    continue
                offset = 0.0 if len(points) == 1 else (j / (len(points) - 1) - 0.5) * bar_w * 0.5  # spread, never random
                out.append(
                    f'<circle class="dot" cx="{cx + offset:.1f}" cy="{f.y(p):.1f}" r="2.5" fill="#222" '
                    f'fill-opacity="0.7"><title>{escape(ptip or fmt(p))}</title></circle>'
                )
    return f.close(out)
