"""SVG pieces of the report: a colour scale and heatmaps, as plain strings.

Heatmaps are drawn on the server side, so they show without JavaScript; every label
and tooltip goes through ``html.escape``.
"""

from __future__ import annotations

import math
from html import escape

# Viridis at ten evenly spaced stops (perceptually uniform, readable in grey and by
# most colour-blind readers); values in between are interpolated linearly.
_VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]
MISSING = "#d9d9d9"


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def colour(t: float) -> str:
    """Viridis colour of ``t`` in [0, 1] (clamped) as #rrggbb."""
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    a, b = _rgb(_VIRIDIS[i]), _rgb(_VIRIDIS[i + 1])
    f = t - i
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    return f"{v:.3e}"


def heatmap(grid: list[list[float | None]], row_labels: list[str], col_labels: list[str], title: str,
            lo: float | None = None, hi: float | None = None, cell: tuple[int, int] = (26, 18), tooltip=None) -> str:
    """An SVG heatmap of ``grid`` (rows x cols; None/NaN = not measured) with axis labels
    and a legend; ``tooltip(r, c, value)`` gives each cell's hover text."""
    values = [v for row in grid for v in row if v is not None and not math.isnan(v)]
    lo = min(values) if lo is None and values else (0.0 if lo is None else lo)
    hi = max(values) if hi is None and values else (1.0 if hi is None else hi)
    span = hi - lo if hi > lo else 1.0
    cw, ch = cell
    # column labels wider than a cell are written at an angle
    slant = max((len(s) for s in col_labels), default=1) * 6 > cw
    left = 8 + 7 * max((len(s) for s in row_labels), default=1)
    top = 24 + (6 * max(len(s) for s in col_labels) if slant else 10)
    width = left + max(cw * len(col_labels), 120) + 30  # room for the legend's end label
    height = top + ch * len(row_labels) + 40
    out = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">']
    out.append(f'<text x="{left}" y="12" class="svg-title">{escape(title)}</text>')
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
            fill = MISSING if missing else colour((v - lo) / span)
            tip = tooltip(r, c, v) if tooltip else f"{row_labels[r]}, {col_labels[c]}: {fmt(v)}"
            out.append(f'<rect x="{left + c * cw}" y="{top + r * ch}" width="{cw - 1}" height="{ch - 1}" fill="{fill}">'
                       f"<title>{escape(tip)}</title></rect>")
    # legend: a gradient bar from lo to hi
    ly = top + ch * len(row_labels) + 12
    lw = max(cw * len(col_labels), 120)
    steps = 24
    for i in range(steps):
        out.append(f'<rect x="{left + i * lw / steps}" y="{ly}" width="{lw / steps + 0.5}" height="8" fill="{colour(i / (steps - 1))}"/>')
    out.append(f'<text x="{left}" y="{ly + 22}" class="axis">{escape(fmt(lo))}</text>')
    out.append(f'<text x="{left + lw}" y="{ly + 22}" text-anchor="end" class="axis">{escape(fmt(hi))}</text>')
    out.append("</svg>")
    return "".join(out)


def bars(values: list[float], labels: list[str], title: str, hi: float = 1.0, width: int = 360) -> str:
    """A horizontal bar chart (values in [0, hi])."""
    bh, left = 18, 8 + 7 * max((len(s) for s in labels), default=1)
    height = 24 + bh * len(values) + 8
    out = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" role="img" '
           f'aria-label="{escape(title)}"><text x="{left}" y="12" class="svg-title">{escape(title)}</text>']
    for i, (v, label) in enumerate(zip(values, labels)):
        y = 20 + i * bh
        w = 0 if hi <= 0 else width * min(max(v / hi, 0.0), 1.0)
        out.append(f'<text x="{left - 4}" y="{y + bh * 0.7}" text-anchor="end" class="axis">{escape(label)}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bh - 4}" fill="{colour(0.35)}"><title>{escape(label)}: {fmt(v)}</title></rect>')
        out.append(f'<text x="{left + w + 4}" y="{y + bh * 0.7}" class="axis">{escape(fmt(v))}</text>')
    out.append("</svg>")
    return "".join(out)
