"""The pipeline report's pieces: the PNG writer (read back by Pillow), the colour scale,
and escaping of every run string (tokens, prompt, layer names) in the page."""

from __future__ import annotations

import io

import numpy as np
import pytest

from attnkit.report.diffusion import heat_pixels, png_bytes, render_token_maps_html


def test_png_reads_back_exactly():
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    img = Image.open(io.BytesIO(png_bytes(pixels)))
    assert img.size == (7, 5) and img.mode == "RGB"
    assert np.array_equal(np.asarray(img), pixels)
    with pytest.raises(ValueError, match="pixels"):
        png_bytes(pixels.astype(np.float32))


def test_heat_pixels_span_min_to_max():
    values = np.array([[0.2, 0.4], [0.6, 0.2]])
    px = heat_pixels(values, 0.2, 0.6)
    assert tuple(px[0, 0]) == (0x44, 0x01, 0x54) and tuple(px[1, 0]) == (0xFD, 0xE7, 0x25)  # viridis ends
    assert np.array_equal(heat_pixels(np.full((2, 2), 0.3), 0.3, 0.3), np.broadcast_to(px[0, 0], (2, 2, 3)))  # flat map


def test_every_run_string_is_escaped():
    evil = '<img src=x onerror="alert(1)">'
    maps = np.random.default_rng(1).random((2, 3, 3))
    html = render_token_maps_html(
        ["ok", evil],
        [(f"steps {evil}", maps)],
        image=np.zeros((4, 4, 3)),
        meta={"prompt": evil, "layers": [f"blocks.{evil}"]},
        title=f"t {evil}",
    )
    assert evil not in html and 'onerror="' not in html and "<script" not in html
    assert html.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") >= 5
    assert html.count('<figure class="token-map"') == 2
    with pytest.raises(ValueError, match="sections"):
        render_token_maps_html(["only one"], [("all", maps)])
