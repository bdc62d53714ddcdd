"""The report of ``attnkit inspect --image``: the image's patch grid overlaid by each
head's attention, and the visual-share curves over the generated tokens.

Drawn from an ``AttentionProfile`` whose ``arrays`` hold ``visual_received``
({(layer, head): {"values": (B, N0)}}, the mass each key received from the generated
steps) and ``visual_share`` ({(layer, head): {"step_start", "values": (B, T)}}), and
whose ``meta["vision"]["images"]`` locate the image tokens and their grid. Static SVG,
no script; the image itself is embedded as a PNG data URI when given. Every text that
came from the model or the user goes through ``html.escape``.
"""

from __future__ import annotations

import base64
import math
import os
from html import escape

from .chart import line_chart
from .html import _asset
from .svg import fmt

CELL_COLOUR = "#d55e00"
SIZE = 132  # pixels per overlay


def _grid(image: dict) -> tuple[int, int, int]:
    """(first token, rows, cols) of an image's token grid; a strip when it has none."""
    n = image["end"] - image["start"]
    if image.get("grid"):
        rows, cols = image["grid"]
        return image["start"], rows, cols
    side = math.isqrt(n - 1) if n > 1 else 0
    if side * side == n - 1:  # LLaVA's "full" strategy: a CLS token, then the patches
        return image["start"] + 1, side, side
    return image["start"], 1, n


def image_defs(png: bytes, rows: int, cols: int, size: int = SIZE) -> str:
    """The image once per page, as ``#attnkit-image``, sized like the overlays."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    h = size * rows / cols
    return (
        f'<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs><image id="attnkit-image" href="{uri}" '
        f'x="0" y="0" width="{size}" height="{fmt(h)}" preserveAspectRatio="none"/></defs></svg>'
    )


def overlay(mass: list[float], rows: int, cols: int, with_image: bool, caption: str, size: int = SIZE) -> str:
    """One SVG: the page's image (``image_defs``) under a ``rows`` × ``cols`` grid of
    cells, each filled in proportion to its share of the largest mass (``data-v`` holds
    the mass)."""
    top = max(mass) if mass else 0.0
    h = size * rows / cols
    cw, ch = size / cols, h / rows
    parts = [
        f'<svg class="overlay" xmlns="http://www.w3.org/2000/svg" width="{size}" height="{fmt(h)}" viewBox="0 0 {size} {fmt(h)}" role="img">'
        f"<title>{escape(caption)}</title>"
    ]
    if with_image:
        parts.append('<use href="#attnkit-image"/>')
    else:
        parts.append(f'<rect x="0" y="0" width="{size}" height="{fmt(h)}" fill="#222"/>')
    for i, v in enumerate(mass):
        r, c = divmod(i, cols)
        alpha = 0.0 if top <= 0 else 0.85 * v / top
        parts.append(
            f'<rect class="cell" x="{fmt(c * cw)}" y="{fmt(r * ch)}" width="{fmt(cw)}" height="{fmt(ch)}" '
            f'fill="{CELL_COLOUR}" fill-opacity="{alpha:.3f}" data-v="{v:.6g}"><title>patch ({r}, {c}): {v:.4g}</title></rect>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _mass(profile, layer: int, head: int, start: int, n: int, row: int = 0) -> list[float]:
    values = profile.arrays["visual_received"][(layer, head)]["values"]
    return [float(x) for x in values[row, start : start + n].tolist()]


def _overlays(profile, png: bytes | None) -> str:
    meta = profile.meta["vision"]
    image = next((im for im in meta["images"] if im["row"] == 0), None)
    if image is None:
        return '<p class="note">No image in batch row 0.</p>'
    start, rows, cols = _grid(image)
    n = rows * cols
    shares = profile.values("visual.share")
    heads = sorted(profile.arrays["visual_received"])
    out = [
        image_defs(png, rows, cols) if png is not None else "",
        '<p class="note">Each picture is the image under its grid of image tokens; a cell\'s colour is the attention mass '
        "the generated tokens put on that token, relative to the head's most attended cell (hover a cell for its mass). "
        "The caption gives the head's visual share: the part of its attention on the image at all.</p>",
    ]
    for layer in sorted({lay for lay, _ in heads}):
        cells = []
        for lay, h in heads:
            if lay != layer:
                continue
            share = shares.get((lay, h))
            caption = f"layer {lay}, head {h}" + (f": visual share {share:.3f}" if share is not None else "")
            cells.append(
                f'<figure class="head" data-layer="{lay}" data-head="{h}">{overlay(_mass(profile, lay, h, start, n), rows, cols, png is not None, caption)}'
                f"<figcaption>{escape(caption)}</figcaption></figure>"
            )
        out.append(f'<h3>layer {layer}</h3><div class="overlays">{"".join(cells)}</div>')
    return "".join(out)


def _curves(profile) -> str:
    shares = profile.arrays.get("visual_share") or {}
    if not shares:
        return '<p class="note">No generated step was measured.</p>'
    steps = max(int(d["values"].shape[1]) for d in shares.values())
    tokens = profile.tokens or []
    first = profile.meta.get("prompt_tokens", 0)
    xs = list(range(steps))
    by_layer: dict = {}
    for (layer, _head), d in sorted(shares.items()):
        vals = d["values"][0].tolist()
        by_layer.setdefault(layer, []).append(vals + [math.nan] * (steps - len(vals)))
    series, tips = {}, {}
    for layer, rows in by_layer.items():
        mean = []
        for t in xs:
            vs = [r[t] for r in rows if isinstance(r[t], float) and math.isfinite(r[t])]
            mean.append(sum(vs) / len(vs) if vs else None)
        name = f"layer {layer}"
        series[name] = mean
        tips[name] = [
            f"{name}, step {t} (→ {tokens[first + t] if first + t < len(tokens) else '?'}): "
            + (f"{m:.3f}" if m is not None else "not measured")
            for t, m in zip(xs, mean)
        ]
    chart = line_chart(
        xs,
        series,
        "visual share per generated token (mean over heads)",
        "generated token",
        "visual share",
        lo=0.0,
        hi=1.0,
        tips=tips,
    )
    head_charts = []
    for layer, rows in by_layer.items():
        names = [f"head {h}" for (lay, h) in sorted(shares) if lay == layer]
        per = {name: [v if math.isfinite(v) else None for v in r] for name, r in zip(names, rows)}
        head_charts.append(
            '<div class="figure">'
            + line_chart(
                xs,
                per,
                f"layer {layer}: visual share per head",
                "generated token",
                "visual share",
                lo=0.0,
                hi=1.0,
                size=(420, 260),
            )
            + "</div>"
        )
    return (
        '<p class="note">Step t is the query that predicts generated token t. A falling curve is visual attention '
        'draining towards the text as the answer goes on.</p><div class="figure">'
        + chart
        + "</div>"
        + '<div class="grid">'
        + "".join(head_charts)
        + "</div>"
    )


def _table(profile) -> str:
    metrics = [m for m in profile.metrics if m.startswith("visual.")]
    head = "".join(f"<th>{escape(m)}</th>" for m in metrics)
    body = []
    for layer, h in profile.heads:
        vals = profile.head_metrics(layer, h)
        body.append(
            f"<tr><td>{layer}</td><td>{h}</td>"
            + "".join(f"<td>{fmt(vals[m]) if m in vals else ''}</td>" for m in metrics)
            + "</tr>"
        )
    return f'<table class="heads"><thead><tr><th>layer</th><th>head</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


_CSS = (
    ".overlays{display:flex;flex-wrap:wrap;gap:10px}.overlays figure{margin:0}.overlays figcaption{font-size:11px;color:#444;"
    f"max-width:{SIZE}px}}.overlay{{border:1px solid #ccc}}.answer{{white-space:pre-wrap;background:#f6f6f6;padding:6px}}"
)


def render_vision_html(profile, *, image_png: bytes | None = None, title: str | None = None) -> str:
    """The page as a string."""
    meta = profile.meta
    if "vision" not in meta or "visual_received" not in profile.arrays:
        raise ValueError("profile: not a vision profile (made by attnkit.inspection.vision_run.inspect_image)")
    vis = meta["vision"]
    title = title or f"attnkit inspect — {meta.get('model', 'model')}"
    line = (
        f"{meta.get('model', '?')} ({meta.get('model_type', '?')}) · {meta.get('prompt_tokens', '?')} prompt tokens, "
        f"{len(vis['images'])} image(s) · {vis['steps']} generated tokens · {vis['layers']} layers × {vis['heads']} heads"
        + (f" · {meta['seconds']:.2f} s" if isinstance(meta.get("seconds"), (int, float)) else "")
    )
    sections = [
        (
            "answer",
            "Prompt and answer",
            f'<p class="note">prompt</p><p class="answer">{escape(vis.get("prompt", ""))}</p>'
            f'<p class="note">answer (greedy)</p><p class="answer">{escape(vis.get("generated", ""))}</p>',
        ),
        ("overlay", "Where each head looked", _overlays(profile, image_png)),
        ("curves", "Visual share over the answer", _curves(profile)),
        (
            "heads",
            "All heads",
            '<p class="note">Means over the generated steps; see docs/vision.md for each metric.</p>' + _table(profile),
        ),
    ]
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{escape(name)}</h2>{content}</section>' for sid, name, content in sections)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_asset('report.css')}{_CSS}</style></head><body>"
        f'<header><h1>{escape(title)}</h1><p class="meta">{escape(line)}</p></header><nav>{nav}</nav><main>{body}</main></body></html>'
    )


def write_vision_report(profile, out_dir: str, *, image_png: bytes | None = None, title: str | None = None) -> dict:
    """Write ``report.html`` into ``out_dir``; returns {"html": path}."""
    html = render_vision_html(profile, image_png=image_png, title=title)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return {"html": path}


__all__ = ["overlay", "render_vision_html", "write_vision_report"]
