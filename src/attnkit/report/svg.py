"""SVG pieces of the report: a colour scale and heatmaps, as plain strings.

Heatmaps are drawn on the server side, so they show without JavaScript; every label
and tooltip goes through ``html.escape``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

# Viridis at ten evenly spaced stops (perceptually uniform, readable in grey and by
# most colour-blind readers); values in between are interpolated linearly.
_VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]
MISSING = "#d9d9d9"


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return r, g, b


def colour(t: float) -> str:
    """Viridis colour of ``t`` in [0, 1] (clamped) as #rrggbb."""
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    a, b = _rgb(_VIRIDIS[i]), _rgb(_VIRIDIS[i + 1])
    f = t - i
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    return f"{v:.3e}"


def short(v: float | None) -> str:
    """A value in at most about five characters, for text inside a heatmap cell."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if v == 0:
        return "0"
    a = abs(v)
    if 0.01 <= a < 1000:
        text = f"{v:.2g}" if a < 0.1 else f"{v:.3g}" if a < 100 else f"{v:.0f}"
        return text[1:] if text.startswith("0.") else ("-" + text[2:] if text.startswith("-0.") else text)
    if 1000 <= a < 1e6:
        return f"{v / 1000:.3g}k"
    return f"{v:.0e}"


def _ink(fill: str) -> str:
    """Black or white, whichever reads on ``fill``."""
    r, g, b = _rgb(fill)
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def heatmap(
    grid: Sequence[Sequence[float | None]],
    row_labels: list[str],
    col_labels: list[str],
    title: str,
    lo: float | None = None,
    hi: float | None = None,
    cell: tuple[int, int] = (26, 18),
    tooltip=None,
    *,
    x_title: str | None = None,
    y_title: str | None = None,
    values: bool = False,
    scale_title: str | None = None,
) -> str:
    """An SVG heatmap of ``grid`` (rows x cols; None/NaN = not measured) with axis labels
    and a legend; ``tooltip(r, c, value)`` gives each cell's hover text. ``x_title`` and
    ``y_title`` name the axes (the columns' above them, the rows' beside them);
    ``values`` writes each cell's value inside it (for small grids); ``scale_title`` names
    the colour scale (under its bar)."""
    finite = [v for row in grid for v in row if v is not None and not math.isnan(v)]
    lo = min(finite) if lo is None and finite else (0.0 if lo is None else lo)
    hi = max(finite) if hi is None and finite else (1.0 if hi is None else hi)
    span = hi - lo if hi > lo else 1.0
    cw, ch = cell
    # column labels wider than a cell are written at an angle
    slant = max((len(s) for s in col_labels), default=1) * 6 > cw
    y_pad = 18 if y_title else 0
    left = 8 + y_pad + 7 * max((len(s) for s in row_labels), default=1)
    top = 24 + (20 if x_title else 0) + (6 * max(len(s) for s in col_labels) if slant else 10)
    grid_w = cw * len(col_labels)
    width = left + max(grid_w, 120) + 30  # room for the legend's end label
    if x_title:
        width = max(width, int(left + 7 * len(x_title)) + 8)
    height = top + ch * len(row_labels) + 40 + (14 if scale_title else 0)
    if scale_title:
        width = max(width, int(left + 6.2 * len(scale_title)) + 8)
    if y_title:
        height = max(height, top + 7 * len(y_title) + 8)
    out = [
        f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
    ]
    out.append(f'<text x="{left}" y="12" class="svg-title">{escape(title)}</text>')
    if x_title:
        out.append(
            f'<text class="axis-title x-title" x="{left + max(grid_w, 7 * len(x_title)) / 2:.1f}" y="34" '
            f'text-anchor="middle">{escape(x_title)}</text>'
        )
    if y_title:
        cy = top + max(ch * len(row_labels), 7 * len(y_title)) / 2
        out.append(
            f'<text class="axis-title y-title" x="12" y="{cy:.1f}" transform="rotate(-90 12 {cy:.1f})" '
            f'text-anchor="middle">{escape(y_title)}</text>'
        )
    for c, label in enumerate(col_labels):
        x, y = left + c * cw + cw / 2, top - 6
        if slant:
            out.append(f'<text x="{x}" y="{y}" transform="rotate(-50 {x} {y})" class="axis">{escape(label)}</text>')
        else:
            out.append(f'<text x="{x}" y="{y}" text-anchor="middle" class="axis">{escape(label)}</text>')
    for r, label in enumerate(row_labels):
        out.append(f'<text x="{left - 4}" y="{top + r * ch + ch * 0.7}" text-anchor="end" class="axis">{escape(label)}</text>')
        for c, v in enumerate(grid[r]):
            missing = v is None or math.isnan(v)
            fill = MISSING if v is None or missing else colour((v - lo) / span)
            tip = tooltip(r, c, v) if tooltip else f"{row_labels[r]}, {col_labels[c]}: {fmt(v)}"
            out.append(
                f'<rect x="{left + c * cw}" y="{top + r * ch}" width="{cw - 1}" height="{ch - 1}" fill="{fill}">'
                f"<title>{escape(tip)}</title></rect>"
            )
            if values and not missing:
                out.append(
                    f'<text class="cell-value" x="{left + c * cw + (cw - 1) / 2:.1f}" y="{top + r * ch + ch / 2 + 3.5:.1f}" '
                    f'text-anchor="middle" fill="{_ink(fill)}" pointer-events="none">{escape(short(v))}</text>'
                )
    # legend: a gradient bar from lo to hi
    ly = top + ch * len(row_labels) + 12
    lw = max(grid_w, 120)
    steps = 24
    for i in range(steps):
        out.append(
            f'<rect x="{left + i * lw / steps}" y="{ly}" width="{lw / steps + 0.5}" height="8" fill="{colour(i / (steps - 1))}"/>'
        )
    out.append(f'<text x="{left}" y="{ly + 22}" class="axis">{escape(fmt(lo))}</text>')
    out.append(f'<text x="{left + lw}" y="{ly + 22}" text-anchor="end" class="axis">{escape(fmt(hi))}</text>')
    if scale_title:
        out.append(f'<text x="{left}" y="{ly + 36}" class="axis scale-title">{escape(scale_title)}</text>')
    out.append("</svg>")
    return "".join(out)


def bars(values: Sequence[float], labels: list[str], title: str, hi: float = 1.0, width: int = 360) -> str:
    """A horizontal bar chart (values in [0, hi])."""
    bh, left = 18, 8 + 7 * max((len(s) for s in labels), default=1)
    height = 24 + bh * len(values) + 8
    out = [
        f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" role="img" '
        f'aria-label="{escape(title)}"><text x="{left}" y="12" class="svg-title">{escape(title)}</text>'
    ]
    for i, (v, label) in enumerate(zip(values, labels)):
        y = 20 + i * bh
        w = 0 if hi <= 0 else width * min(max(v / hi, 0.0), 1.0)
        out.append(f'<text x="{left - 4}" y="{y + bh * 0.7}" text-anchor="end" class="axis">{escape(label)}</text>')
        out.append(
            f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bh - 4}" fill="{colour(0.35)}"><title>{escape(label)}: {fmt(v)}</title></rect>'
        )
        out.append(f'<text x="{left + w + 4}" y="{y + bh * 0.7}" class="axis">{escape(fmt(v))}</text>')
    out.append("</svg>")
    return "".join(out)
