"""The report of ``attnkit inspect`` on a diffusers pipeline: one heatmap per text token
over the image, for the whole run and for each step range.

One self-contained HTML page: heatmaps are small PNGs inlined as data URIs (written here
with zlib, no plotting library), drawn over the generated image when there is one
(hovering a map shows the image through it). Every string from the run (tokens, the
prompt, the model's path, layer names) is escaped, so a token such as ``<script>`` shows
as text and never runs.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import zlib
from collections.abc import Sequence, Sized
from html import escape

import numpy as np

from .html import _asset
from .svg import colour

_LUT = np.array([[int(colour(i / 255)[j : j + 2], 16) for j in (1, 3, 5)] for i in range(256)], dtype=np.uint8)

_CSS = """
.maps { display: flex; flex-wrap: wrap; gap: 14px 18px; }
figure.token-map { margin: 0; width: 148px; }
figure.token-map .stack { position: relative; width: 148px; height: 148px; border: 1px solid var(--line); border-radius: 4px; overflow: hidden; }
figure.token-map img { position: absolute; inset: 0; width: 100%; height: 100%; image-rendering: pixelated; }
figure.token-map img.image { image-rendering: auto; }
figure.token-map .stack.over img.heat { opacity: 0.7; }
figure.token-map .stack.over:hover img.heat { opacity: 0.12; }
figure.token-map figcaption { font-size: 12px; margin-top: 3px; overflow-wrap: anywhere; }
figure.token-map figcaption .num { color: var(--muted); }
table.meta td { padding: 2px 10px 2px 0; vertical-align: top; }
"""


def png_bytes(pixels: np.ndarray) -> bytes:
    """A PNG (8-bit RGB, no interlace) of ``pixels`` (H, W, 3) uint8."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels: expected (H, W, 3) uint8, got {pixels.shape} {pixels.dtype}")
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[r].tobytes() for r in range(h))  # filter type 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _data_uri(pixels: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(pixels)).decode("ascii")


def heat_pixels(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """(h, w) values as viridis pixels (h, w, 3), ``lo`` dark and ``hi`` bright."""
    span = hi - lo
    scaled = np.clip(np.nan_to_num((values - lo) / span if span > 0 else values * 0.0), 0.0, 1.0)
    return _LUT[np.round(scaled * 255).astype(np.int64)]


def _image_uri(image) -> str | None:
    if image is None:
        return None
    arr = np.asarray(image, dtype=np.float32)
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3):
        return None
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return _data_uri(np.round(np.clip(arr, 0.0, 1.0) * 255).astype(np.uint8))


def _figures(tokens: list[str], maps, image_uri: str | None, label: str) -> str:
    out = []
    for i, token in enumerate(tokens):
        m = np.asarray(maps[i], dtype=np.float64)
        lo, hi = (float(m.min()), float(m.max())) if m.size else (0.0, 0.0)
        over = " over" if image_uri else ""
        base = f'<img class="image" src="{image_uri}" alt="">' if image_uri else ""
        alt = escape(f"attention to token {i} ({token}), {label}")
        out.append(
            f'<figure class="token-map" data-token="{i}"><div class="stack{over}">{base}'
            f'<img class="heat" src="{_data_uri(heat_pixels(m, lo, hi))}" alt="{alt}"></div>'
            f'<figcaption><span class="num">{i}</span> {escape(token)} <span class="num">{lo:.3g}–{hi:.3g}</span>'
            "</figcaption></figure>"
        )
    return '<div class="maps">' + "".join(out) + "</div>"


def render_token_maps_html(
    tokens: list[str],
    sections: Sequence[tuple[str, Sized]],
    *,
    image=None,
    meta: dict | None = None,
    title: str = "attnkit inspect",
) -> str:
    """The page: ``sections`` is [(label, maps (T, h, w))], each drawn as one heatmap per
    token of ``tokens`` (each from its own minimum to maximum, given under it); ``image`` the
    generated image (H, W, 3) in [0, 1] to draw them over; ``meta`` shown as a table."""
    for label, maps in sections:
        if len(maps) != len(tokens):
            raise ValueError(f"sections: {label!r} has maps of {len(maps)} tokens for {len(tokens)} token names")
    meta = dict(meta or {})
    image_uri = _image_uri(image)
    rows = "".join(f"<tr><td>{escape(str(k))}</td><td>{escape(_fmt(v))}</td></tr>" for k, v in meta.items() if k != "layers")
    layers = meta.get("layers") or []
    parts = [f'<section id="run"><h2>Run</h2><table class="meta">{rows}</table>']
    if layers:
        parts.append(
            f'<details><summary>{len(layers)} attention layers measured</summary><p class="note">'
            + ", ".join(escape(str(n)) for n in layers)
            + "</p></details>"
        )
    if image_uri:
        parts.append(f'<p><img src="{image_uri}" alt="generated image" style="width:256px;image-rendering:auto"></p>')
    parts.append("</section>")
    nav = ['<a href="#run">run</a>']
    for k, (label, maps) in enumerate(sections):
        anchor = f"maps-{k}"
        nav.append(f'<a href="#{anchor}">{escape(label)}</a>')
        parts.append(
            f'<section id="{anchor}"><h2>Token maps — {escape(label)}</h2><p class="note">Per text token, its '
            "cross-attention weight at each image position, averaged over the measured layers and heads and the "
            "steps of this range (Prompt-to-Prompt, arXiv 2208.01626). Each map spans its own minimum (dark) to maximum "
            "(bright), given under it"
            + (" and drawn over the generated image (hover to see through it)" if image_uri else "")
            + ".</p>"
            + _figures(tokens, maps, image_uri, label)
            + "</section>"
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{escape(title)}</title>'
        f"<style>{_asset('report.css')}{_CSS}</style></head><body><header><h1>{escape(title)}</h1></header>"
        f"<nav>{''.join(nav)}</nav><main>{''.join(parts)}</main></body></html>"
    )


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return " × ".join(str(x) for x in v) if all(isinstance(x, int) for x in v) else json.dumps(v, ensure_ascii=False)
    return "–" if v is None else str(v)


def write_token_maps_report(
    tokens: list[str],
    sections: Sequence[tuple[str, Sized]],
    out_dir: str,
    *,
    image=None,
    meta: dict | None = None,
    title: str = "attnkit inspect",
) -> dict:
    """Write ``report.html`` and ``maps.safetensors`` (one (T, h, w) float32 tensor per
    section, named ``maps.0``, ``maps.1``, ...; ``maps.json`` names them and the tokens)
    into ``out_dir``; returns their paths."""
    html = render_token_maps_html(tokens, sections, image=image, meta=meta, title=title)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"html": os.path.join(out_dir, "report.html"), "json": os.path.join(out_dir, "maps.json")}
    with open(paths["html"], "w", encoding="utf-8") as f:
        f.write(html)
    import torch

    tensors = {f"maps.{k}": torch.as_tensor(np.asarray(m, dtype=np.float32)).contiguous() for k, (_, m) in enumerate(sections)}
    try:
        from safetensors.torch import save_file
    except ImportError:  # the maps stay in the page; the tensors file needs the [hf] extra's safetensors
        pass
    else:
        paths["maps"] = os.path.join(out_dir, "maps.safetensors")
        save_file(tensors, paths["maps"])
    summary = {
        "tokens": list(tokens),
        "sections": {f"maps.{k}": label for k, (label, _) in enumerate(sections)},
        "meta": meta or {},
    }
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(summary, f, ensure_ascii=False, indent=1, default=str)
    return paths


__all__ = ["heat_pixels", "png_bytes", "render_token_maps_html", "write_token_maps_report"]
