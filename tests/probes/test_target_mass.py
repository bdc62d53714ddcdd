"""TargetMass and PooledSpanMass, the probes' own meters, against dense float64 weights,
with the observe pass cut into small tiles so that rows span many key tiles (by default
a short input is one tile)."""

import pytest
import torch

import attnkit as ak
from attnkit.probes.pooled_mass import PooledSpanMass
from attnkit.probes.target_mass import TargetMass
from helpers import qkv

B, HQ, HKV, N, D = 2, 4, 2, 100, 8


def small_tiles(monkeypatch):
    import attnkit.kernels.observe_pass as op

    for name, value in (
        ("OBSERVE_Q_BLOCK", 32),
        ("OBSERVE_K_BLOCK", 48),
        ("OBSERVE_MAX_FULL_SPAN", 48),
        ("OBSERVE_TILE_WEIGHTS", 1),
    ):
        monkeypatch.setattr(op, name, value)


def dense(q, k, causal: bool):
    """(B, H, N, N) softmax weights, float64, literal formula (GQA: head h reads h // 2)."""
    kk = k.repeat_interleave(HQ // HKV, dim=1)
    s = q @ kk.transpose(-1, -2) / D**0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tiling", ["tiles", "small-tiles"])
def test_target_mass_equals_dense(causal, tiling, monkeypatch):
    if tiling == "small-tiles":
        small_tiles(monkeypatch)
    q, k, v = qkv(B, HQ, HKV, N, N, D)
    g = torch.Generator().manual_seed(1)
    # up to 3 targets per row at or before the query (-1: unused), some rows with none
    targets = torch.randint(0, N, (B, N, 3), generator=g)
    targets = torch.minimum(targets, torch.arange(N).view(1, N, 1))
    targets[torch.rand(B, N, 3, generator=g) < 0.3] = -1
    previous = torch.arange(-1, N - 1).view(1, N, 1).expand(B, N, 1).contiguous()
    meter = TargetMass({"random": targets, "previous": previous}, queries=(10, None))
    ak.attention(q, k, v, mask=ak.causal() if causal else None, observers=[meter], layer=0)
    p = dense(q, k, causal)
    for name, t in (("random", targets), ("previous", previous)):
        total, rows = torch.zeros(HQ, dtype=torch.float64), 0
        for b in range(B):
            for i in range(10, N):
                keys = [int(x) for x in t[b, i] if x >= 0]
                if keys:
                    total += p[b, :, i, keys].sum(-1)
                    rows += 1
        torch.testing.assert_close(meter.score(name)[0], total / rows, rtol=1e-10, atol=1e-10)


def test_target_mass_refuses_bad_targets():
    with pytest.raises(ValueError, match="targets"):
        TargetMass({"x": torch.zeros(2, 5)})
    with pytest.raises(ValueError, match="after its query"):
        TargetMass({"x": torch.full((1, 5, 1), 4)})
    with pytest.raises(ValueError, match="below -1"):
        TargetMass({"x": torch.full((1, 5, 1), -2)})
    with pytest.raises(ValueError, match="same"):
        TargetMass({"x": torch.zeros(1, 5, 1, dtype=torch.long), "y": torch.zeros(2, 5, 1, dtype=torch.long)})


@pytest.mark.parametrize("tiling", ["tiles", "small-tiles"])
def test_pooled_span_mass_equals_dense(tiling, monkeypatch):
    if tiling == "small-tiles":
        small_tiles(monkeypatch)
    q, k, v = qkv(B, HQ, HKV, N, N, D)
    g = torch.Generator().manual_seed(2)
    rows = torch.rand(B, N, generator=g, dtype=torch.float64)
    rows[:, 50:60] = 0.0
    segments = torch.randint(-1, 5, (B, N), generator=g)
    meter = PooledSpanMass(rows, segments, 5)
    ak.attention(q, k, v, observers=[meter], layer=2)
    p = dense(q, k, causal=False)
    expected = torch.zeros(B, HQ, 5, dtype=torch.float64)
    for b in range(B):
        for s in range(5):
            keys = (segments[b] == s).nonzero().view(-1)
            expected[b, :, s] = (rows[b].view(1, N) * p[b][:, :, keys].sum(-1)).sum(-1)
    torch.testing.assert_close(meter.per_example()[:, 0], expected, rtol=1e-10, atol=1e-10)


def test_pooled_span_mass_refuses_bad_input():
    with pytest.raises(ValueError, match="row_weights"):
        PooledSpanMass(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="key_segments"):
        PooledSpanMass(torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="key_segments"):
        PooledSpanMass(torch.zeros(2, 5), torch.full((2, 5), 3), 3)
    with pytest.raises(ValueError, match="segments"):
        PooledSpanMass(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long), 0)
