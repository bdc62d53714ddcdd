"""Adaptive attention span (arXiv 1905.07799) against the paper's mask-then-renormalise
formula; span gradients; tiles beyond the span are skipped; the span penalty."""

import math

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import chunked, make_request, reference_attention
from attnkit.mechanisms.adaptive_span import AdaptiveSpan, SpanBand
from helpers import assert_close, qkv

MASKS = {"none": lambda nk: None, "window": mc.MASKS["window"], "document": mc.MASKS["document"]}


def spans(num_heads=4, max_span=12, ramp=3):
    mech = AdaptiveSpan(max_span=max_span, ramp=ramp, num_heads=num_heads).double()
    with torch.no_grad():
        mech.span.copy_(torch.tensor([0.05, 0.3, 0.6, 1.3])[:num_heads] if num_heads else torch.tensor(0.4))
    return mech


def test_matches_reference():
    mc.grid(spans(), masks=MASKS, return_lse=True)
    mc.matches_reference(spans(None), mc.SHAPES["bottom_right"], None, ak.alibi(4), return_lse=True)


def test_multi_tile_with_sinks():
    mech = spans(max_span=200, ramp=16)
    shape = dict(B=1, Hq=4, Hkv=2, Nq=300, Nk=300, D=8)
    sinks = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64).requires_grad_()
    mc.matches_reference(
        mech, shape, ak.document(torch.arange(300) // 120), ak.softcap(4.0), extra={"sinks": sinks}, return_lse=True
    )


def test_gradcheck_including_the_span():
    mech = spans(num_heads=2, max_span=6, ramp=2)
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=3, dtype=torch.float64, requires_grad=True)
    z = mech.span.detach().clone().requires_grad_()
    fn = lambda q, k, v, z: torch.func.functional_call(mech, {"span": z}, (q, k, v))
    assert torch.autograd.gradcheck(fn, (q, k, v, z), eps=1e-6, atol=1e-7, fast_mode=True)


def test_contract():
    mc.low_precision(spans().float(), dtypes=(torch.float32,))
    mc.dead_rows(spans(2))
    mc.observers(
        spans().float().double(),
        mask=ak.document(torch.arange(26) // 9),
        visible_mask=ak.document(torch.arange(26) // 9) & SpanBand([0] * 4, [n - 1 for n in spans().keys_per_head()]),
    )
    mc.empty_sequences(spans(2))
    mc.by_name("adaptive_span", spans(), sinks_allowed=True)


def test_full_span_without_ramp_effect_is_causal_softmax():
    # span covering every key, ramp narrower than the distances: m = 1 everywhere visible
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=10, Nk=10, D=4)
    mech = AdaptiveSpan(max_span=10, ramp=1, init=1.0)
    out = mech(q, k, v)
    assert_close(out, reference_attention(make_request(q, k, v, mask=ak.causal()))[0])


def test_tiles_beyond_the_span_are_skipped():
    mech = AdaptiveSpan(max_span=4096, ramp=32, init=0.0, num_heads=2)
    assert mech.keys_per_head() == [32, 32]
    n = 8192
    req = make_request(*qkv(B=1, Hq=2, Hkv=2, Nq=n, Nk=n, D=1), mask=SpanBand([0, 0], [31, 31]))
    plan = chunked.make_chunked_plan(req, "fused")
    assert plan.area < 0.1 * n * n / 2  # a tenth of what causal attention computes


def test_penalty_and_clamp():
    mech = AdaptiveSpan(max_span=100, num_heads=3, loss_coeff=0.5)
    with torch.no_grad():
        mech.span.copy_(torch.tensor([-0.2, 0.5, 1.4]))
    assert mech.penalty().item() == pytest.approx(0.5 * 100 * (0 + 0.5 + 1) / 3)
    mech.clamp_()
    assert mech.span.tolist() == [0.0, 0.5, 1.0]


def test_rejects_bad_parameters():
    for kwargs in (dict(max_span=0), dict(ramp=0), dict(ramp=math.inf), dict(init=1.5), dict(num_heads=0), dict(loss_coeff=-1)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            AdaptiveSpan(**kwargs)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="heads"):
        AdaptiveSpan(num_heads=3)(q, k, v)


def test_span_band_classifies_tiles_consistently():
    from attnkit.mods import TileGrid
    from attnkit.mods.grid import EMPTY, FULL

    band = SpanBand([0, 3, 10], [5, 20, 40])
    grid = TileGrid(q_start=16, q_len=64, q_block=8, k_len=80, k_block=8)
    states = band.classify(grid)[0]
    b, h, qi, ki = (t for t in ak.mods.index_tensors(1, 3, 16, 64, 0, 80))
    dense = band(b, h, qi, ki)[0]  # (H, Nq, Nk)
    for i in range(grid.n_q):
        for j in range(grid.n_k):
            tile = dense[:, i * 8 : (i + 1) * 8, j * 8 : (j + 1) * 8]
            if states[i, j] == EMPTY:
                assert not tile.any()
            if states[i, j] == FULL:
                assert tile.all()
