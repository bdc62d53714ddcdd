"""Block-sparse prefill: the vertical-slash rule by literal loops, fast path against the
dense reference (values and gradients), exactness with every block, tile classes, stats."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.block_sparse import BlockPattern
from attnkit.mods import EMPTY, FULL, TileGrid
from attnkit.observe import Observer
from helpers import assert_close, qkv

SMALL = dict(block_size=8, last_q=6, vertical_size=6, slash_size=5, sink_tokens=2, local_tokens=3)


def literal_pattern(mech, q, k):
    """MInference's vertical-slash choice for batch row 0, rounded out to blocks."""
    _, Hq, Nq, D = q.shape
    Nk, bs = k.shape[2], mech.block_size
    G, n, last = Hq // k.shape[1], -(-Nk // bs), min(mech.last_q, Nq)
    blocks = torch.zeros(Hq, n, n, dtype=torch.bool)
    kept = torch.zeros(Hq, dtype=torch.float64)
    for h in range(Hq):
        rows = range(Nq - last, Nq)
        pos = {r: Nk - Nq + r for r in rows}
        a = {}
        for r in rows:
            s = torch.tensor(
                [float(q[0, h, r] @ k[0, h // G, j]) / math.sqrt(D) if j <= pos[r] else -math.inf for j in range(Nk)]
            )
            a[r] = torch.softmax(s, 0).tolist()
        vertical = [sum(a[r][j] for r in rows) for j in range(Nk)]
        slash = [sum(a[r][pos[r] - delta] for r in rows if pos[r] - delta >= 0) for delta in range(Nk)]
        vertical = [math.inf if j < mech.sink_tokens else x for j, x in enumerate(vertical)]
        slash = [math.inf if d < mech.local_tokens else x for d, x in enumerate(slash)]
        columns = sorted(range(Nk), key=lambda j: -vertical[j])[: mech.vertical_size]
        deltas = sorted(range(Nk), key=lambda d: -slash[d])[: mech.slash_size]
        for qb in range(n):
            for c in columns:
                if c // bs <= qb:
                    blocks[h, qb, c // bs] = True
            for delta in deltas:
                for p in range(qb * bs, (qb + 1) * bs):
                    if p - delta >= 0:
                        blocks[h, qb, (p - delta) // bs] = True
        kept[h] = sum(a[r][j] for r in rows for j in range(Nk) if blocks[h, pos[r] // bs, j // bs]) / last
    return blocks, kept


@pytest.mark.parametrize("Nq,Nk", [(40, 40), (21, 37)])
def test_pattern_is_minference_rule(Nq, Nk):
    q, k, _ = qkv(B=1, Hq=4, Hkv=2, Nq=Nq, Nk=Nk, D=8)
    mech = get_mechanism("block_sparse", **SMALL)
    blocks, stats = mech.estimate(q, k, 8**-0.5)
    want, kept = literal_pattern(mech, q, k)
    assert torch.equal(blocks[0], want)
    assert torch.allclose(stats.kept_mass[0].double(), kept, atol=1e-5)  # estimated in float32
    n, first = blocks.shape[-1], (Nk - Nq) // 8
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool))[first:]
    assert torch.allclose(stats.density[0], (want[:, first:] & lower).sum((1, 2)).float() / lower.sum())


@pytest.mark.parametrize("Nq,Nk,Dv", [(100, 100, 8), (70, 130, 5), (96, 96, 8)])
def test_fast_path_matches_reference_values_and_gradients(Nq, Nk, Dv):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=Nq, Nk=Nk, D=8, Dv=Dv, requires_grad=True)
    mech = get_mechanism("block_sparse", block_size=16, last_q=8, vertical_size=6, slash_size=6, sink_tokens=2, local_tokens=3)
    out, lse = mech(q, k, v, mask=ak.causal(), return_lse=True)
    ref, ref_lse = mech.reference(q, k, v, mask=ak.causal(), return_lse=True)
    assert_close(out, ref)
    assert_close(lse, ref_lse)
    assert float(mech.last_stats.density.min()) < 1  # the pattern really is sparse
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * go).sum() + (ref_lse * gl).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert_close(a, b)


def test_gradcheck():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=24, Nk=24, D=3, requires_grad=True)
    mech = get_mechanism("block_sparse", block_size=4, last_q=4, vertical_size=3, slash_size=3, sink_tokens=1, local_tokens=2)
    assert torch.autograd.gradcheck(lambda a, b, c: mech(a, b, c, mask=ak.causal(), return_lse=True), (q, k, v), fast_mode=True)


def test_all_blocks_selected_is_causal_softmax():
    q, k, v = qkv(B=2, Hq=4, Hkv=1, Nq=50, Nk=90, D=8)
    mech = get_mechanism("block_sparse", block_size=16, vertical_size=90, slash_size=1, sink_tokens=0, local_tokens=1)
    out, lse = mech(q, k, v, mask=ak.causal(), return_lse=True)
    want, want_lse = reference_attention(make_request(q, k, v, mask=ak.causal()), torch.float64)
    assert_close(out, want)
    assert_close(lse, want_lse)
    assert float(mech.last_stats.density.min()) == 1.0
    assert torch.allclose(mech.last_stats.kept_mass, torch.ones(2, 4), atol=1e-5)


def test_tile_classes_agree_with_the_pattern():
    g = torch.Generator().manual_seed(3)
    blocks = torch.rand(2, 3, 7, 7, generator=g) < 0.4
    mask = BlockPattern(blocks, 6)
    for q_block, k_block, Nq in [(6, 6, 40), (8, 5, 40), (16, 12, 25)]:
        grid = TileGrid(q_start=40 - Nq, q_len=Nq, q_block=q_block, k_len=40, k_block=k_block)
        states = mask.classify(grid)
        dense = mask.dense(2, 3, Nq, 40)
        for i in range(grid.n_q):
            for j in range(grid.n_k):
                tile = dense[:, :, i * q_block : (i + 1) * q_block, j * k_block : (j + 1) * k_block]
                for b in range(2):
                    if states[b, i, j] == EMPTY:
                        assert not bool(tile[b].any())
                    if states[b, i, j] == FULL:
                        assert bool(tile[b].all())


class Collect(Observer):
    def begin(self, call):
        self.weights = torch.zeros(call.batch, call.heads, call.q_len, call.k_len, dtype=torch.float64)

    def update(self, tile):
        self.weights[:, :, tile.q_pos.view(-1, 1) - (tile.call.k_len - tile.call.q_len), tile.k_pos.view(1, -1)] += tile.weights


def test_observers_get_softmax_weights_on_the_pattern():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=60, Nk=80, D=8)
    mech = get_mechanism("block_sparse", **SMALL)
    meter = Collect()
    out = mech(q, k, v, mask=ak.causal(), observers=[meter])
    assert_close(meter.weights.sum(-1), torch.ones(1, 4, 60, dtype=torch.float64))
    assert_close(torch.matmul(meter.weights, v.repeat_interleave(2, 1)), out)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(vertical_size=2, sink_tokens=3), "sink_tokens"),
        (dict(slash_size=2, local_tokens=3), "local_tokens"),
        (dict(local_tokens=0), "local_tokens"),
        (dict(last_q=0), "last_q"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_mechanism("block_sparse", **kwargs)


def test_invalid_calls():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=32, Nk=32, D=4)
    mech = get_mechanism("block_sparse")
    with pytest.raises(ValueError, match="causal"):
        mech(q, k, v)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        mech(q, k[:, :, :16], v[:, :, :16], mask=ak.causal())
    with pytest.raises(ValueError, match="sinks"):
        mech(q, k, v, mask=ak.causal(), sinks=torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_within_tolerance_of_float64(dtype):
    q, k, v = (t.to(dtype).double() for t in qkv(B=1, Hq=4, Hkv=2, Nq=64, Nk=64, D=16))
    mech = get_mechanism("block_sparse", **SMALL)
    got = mech(q.to(dtype), k.to(dtype), v.to(dtype), mask=ak.causal())
    assert got.dtype == dtype
    assert_close(got, mech.reference(q, k, v, mask=ak.causal()), dtype=dtype)
