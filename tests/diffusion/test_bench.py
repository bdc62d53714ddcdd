"""The diffusion benchmark suite: quick mode gives the advertised rows in seconds, and
the memory row's byte counts equal the formulas for its UNet (no timing is asserted)."""

import pytest

pytest.importorskip("diffusers")

from attnkit.bench import SUITES  # noqa: E402
from attnkit.bench import diffusion as suite  # noqa: E402


def test_quick_mode_rows():
    steps = []
    rows = suite.run(quick=True, progress=steps.append)
    assert "diffusion" in SUITES and len(steps) == suite.STEPS
    assert [r.case for r in rows] == [
        "UNet2DConditionModel step under use()",
        "UNet2DConditionModel step with TokenMaps",
        "Flux step under use()",
        "Flux step with TokenMaps",
        "UNet2DConditionModel step with PAG",
        "memory: per-token maps, one step, all layers",
    ]
    for r in rows[:5]:
        assert r.attnkit_ms > 0 and r.baseline_ms > 0
    for r in (rows[0], rows[2]):
        assert r.ok == (r.ratio <= suite.TARGET_STEP)
    # 32x32 latent: level 0 runs at 32x32 (1024 tokens), level 1 and the mid block at
    # 16x16 (256); 8 heads (the UNet's legacy attention_head_dim=8 is the head count).
    # Cross layers: down 0, up 1 (x2) at 1024, mid at 256; same for self layers.
    extra = rows[5].extra
    assert extra["tokenmaps_bytes"] == 1 * 77 * (1024 + 256) * 8
    full = 1 * 8 * 4 * (3 * 1024 * 1024 + 256 * 256 + 3 * 1024 * 77 + 256 * 77)
    assert extra["full_maps_bytes"] == full
