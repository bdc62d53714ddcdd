"""The chunked backend (both engines) against the reference: values, lse, gradients."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.kernels import Tiling, chunked_attention, make_request, reference_attention
from attnkit.kernels.chunked import choose_engine, make_chunked_plan
from helpers import assert_close, qkv

# Tiny blocks so that small inputs cross many tiles, partial tiles and skipped tiles.
SMALL = Tiling(
    fused_q_block=8,
    fused_q_block_large=16,
    fused_q_block_bias=8,
    fused_k_block=4,
    fused_max_masked_span=12,
    tiled_q_block=8,
    tiled_k_block=4,
    tiled_tile_k=8,
    single_tile=0,
)


def masks(B, Nq, Nk):
    out = {
        "none": None,
        "causal": ak.causal(),
        "window": ak.window(5),
        "window2": ak.window(3, 6),
        "causal&doc": ak.causal() & ak.document(torch.arange(Nk) // 9),
        "doc per row": ak.document(torch.stack([torch.arange(Nk) // 7, torch.arange(Nk) // 13])[:B]),
        "prefix": ak.prefix_lm(torch.tensor([3, 17])[:B]),
        "padding": ak.padding(torch.tensor([Nk, max(Nk - 9, 0)])[:B]),
        "dilated": ak.dilated(11, 3),
        "callable": lambda b, h, q, k: (k <= q) & ((q + k + h) % 4 != 1),
        "~window": ~ak.window(2, 2),
    }
    if Nq == Nk:
        out["nbh1d"] = ak.neighborhood_1d(5, dilation=2) if Nk >= 10 else ak.neighborhood_1d(min(Nk, 3))
    return out


def scores(H):
    return {
        "none": None,
        "alibi": ak.alibi(H),
        "temperature/head": ak.temperature(torch.linspace(0.5, 2.0, H, dtype=torch.float64)),
        "alibi>>temp": ak.alibi(H) >> ak.temperature(1.7),
        "loglen": ak.log_length_scale(0.8),
        "relbias": ak.relative_bias(torch.randn(12, H, dtype=torch.float64), max_distance=20),
        "softcap": ak.softcap(2.0),
        "alibi>>softcap": ak.alibi(H) >> ak.softcap(4.0),
        "callable": lambda s, b, h, q, k: s + 0.1 * torch.sin(q.to(s.dtype) - k.to(s.dtype)),
    }


@st.composite
def calls(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3]))
    Nk = draw(st.integers(1, 45))
    Nq = draw(st.sampled_from([Nk, Nk, max(1, Nk // 3), 1]))
    D = draw(st.sampled_from([4, 8]))
    Dv = draw(st.sampled_from([D, 3, 12]))
    mask = draw(st.sampled_from(sorted(masks(B, Nq, Nk))))
    score = draw(st.sampled_from(sorted(scores(Hkv * G))))
    sinks = draw(st.booleans())
    engine = draw(st.sampled_from(["fused", "tiled"]))
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32]))
    return B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, engine, dtype


def build(B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, dtype, seed=0, requires_grad=False):
    q, k, v = qkv(B=B, Hq=Hkv * G, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, Dv=Dv, dtype=dtype, seed=seed, requires_grad=requires_grad)
    s = torch.randn(Hkv * G, dtype=torch.float64).to(dtype) if sinks else None
    return q, k, v, dict(mask=masks(B, Nq, Nk)[mask], score=scores(Hkv * G)[score], sinks=s)


@settings(max_examples=120, deadline=None)
@given(calls())
def test_forward_matches_reference(call):
    B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, engine, dtype = call
    q, k, v, kw = build(B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, dtype)
    req = make_request(q, k, v, return_lse=True, **kw)
    if engine == "fused":
        assume(choose_engine(req)[0] == "fused")
    out, lse = chunked_attention(req, engine=engine, tiling=SMALL)
    want_out, want_lse = reference_attention(req, torch.float64)
    assert_close(out, want_out, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse[finite], dtype)


@settings(max_examples=40, deadline=None)
@given(calls(), st.booleans())
def test_gradients_match_reference(call, lse_grad):
    B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, engine, _ = call
    dtype = torch.float64
    q, k, v, kw = build(B, Hkv, G, Nq, Nk, D, Dv, mask, score, sinks, dtype, requires_grad=True)
    if kw["sinks"] is not None:
        kw["sinks"].requires_grad_()
    params = [p for p in (kw["score"].parameters() if isinstance(kw["score"], ak.ScoreMod) else []) if p.is_floating_point()]
    for p in params:
        p.requires_grad_()
    req = make_request(q, k, v, return_lse=True, **kw)
    if engine == "fused":
        assume(choose_engine(req)[0] == "fused")
    leaves = [q, k, v] + ([kw["sinks"]] if kw["sinks"] is not None else []) + params
    g_out = torch.randn(B, Hkv * G, Nq, Dv, dtype=dtype)
    g_lse = torch.randn(B, Hkv * G, Nq, dtype=dtype) if lse_grad else None

    def grads(run):
        out, lse = run()
        loss = (out * g_out).sum()
        if g_lse is not None:
            loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * g_lse).sum()
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    got = grads(lambda: chunked_attention(req, engine=engine, tiling=SMALL))
    want = grads(lambda: reference_attention(req, torch.float64))
    for a, b in zip(got, want):
        b = torch.zeros_like(a) if b is None else b
        a = torch.zeros_like(b) if a is None else a
        assert_close(a, b, a.dtype)  # a float32 parameter (default ALiBi slopes) gets a float32 gradient


@pytest.mark.parametrize("engine", ["fused", "tiled"])
def test_gradcheck_q_k_v_sinks(engine):
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=9, Nk=11, D=3, Dv=2, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sinks):
        req = make_request(q, k, v, mask=ak.causal() & ak.window(6), score=ak.alibi(2), sinks=sinks, return_lse=True)
        out, lse = chunked_attention(req, engine=engine, tiling=SMALL)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_gradcheck_relative_bias_table():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=3, requires_grad=True)
    table = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, table):
        req = make_request(q, k, v, mask=ak.causal(), score=ak.relative_bias(table, max_distance=10))
        return chunked_attention(req, tiling=SMALL)[0]

    req = make_request(q, k, v, score=ak.relative_bias(table, max_distance=10))
    assert choose_engine(req)[0] == "tiled"  # a learnable bias needs dS
    assert torch.autograd.gradcheck(f, (q, k, v, table))


@pytest.mark.parametrize("engine", ["fused", "tiled"])
def test_rows_without_keys_give_zeros_lse_minus_inf_and_zero_grads(engine):
    q, k, v = qkv(B=2, Hq=2, Hkv=1, Nq=20, Nk=20, D=4, requires_grad=True)
    mask = ak.padding([0, 20]) | (lambda b, h, i, j: (i >= 12) & (j == 0))  # row 0: only queries >= 12 see key 0
    req = make_request(q, k, v, mask=mask, return_lse=True)
    out, lse = chunked_attention(req, engine=engine, tiling=SMALL)
    assert torch.equal(out[0, :, :12], torch.zeros_like(out[0, :, :12]))
    assert torch.isneginf(lse[0, :, :12]).all() and torch.isfinite(lse[0, :, 12:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, :, :12], torch.zeros_like(q.grad[0, :, :12]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("engine", ["fused", "tiled"])
def test_large_logits_in_low_precision_do_not_overflow(dtype, engine):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=40, Nk=40, D=16, dtype=dtype)
    q = q * 60  # logits far beyond float16's range once multiplied out
    req = make_request(q, k, v, mask=ak.causal(), return_lse=True)
    out, lse = chunked_attention(req, engine=engine, tiling=SMALL)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want, want_lse = reference_attention(req, torch.float64)
    assert_close(out, want, dtype)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-2, atol=1e-1)  # |lse| ~ 1e3: float32 rounding of the scores


def test_plan_skips_tiles_and_coalesces_documents():
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Nq=1024, Nk=1024, D=4)
    plan = make_chunked_plan(make_request(q, k, v, mask=ak.document(torch.arange(1024) // 256)), "fused")
    blocks = plan.for_batch(0)
    assert [(b.q0, b.q1) for b in blocks] == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert all(len(b.segments) == 1 and b.segments[0].kind == "full" for b in blocks)
    plan = make_chunked_plan(make_request(q, k, v, mask=ak.window(64)), "fused")
    assert plan.area < 1024 * (64 + 256 + 128)  # a band, not the whole square


def test_default_tiling_through_the_public_api():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=700, Nk=900, D=16, dtype=torch.float32)
    for kw in (
        dict(mask=ak.causal()),
        dict(mask=ak.window(100), score=ak.alibi(4)),
        dict(score=ak.softcap(5.0), mask=ak.causal()),
    ):
        got = ak.attention(q, k, v, backend="chunked", **kw)
        want = ak.attention(q, k, v, backend="reference", **kw)
        assert_close(got, want, torch.float32)


def test_forcing_an_engine_that_cannot_run_is_an_error():
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="engine='fused' cannot run this call: score mod softcap"):
        chunked_attention(make_request(q, k, v, score=ak.softcap(2.0)), engine="fused")


def test_a_causal_call_with_row_scales_or_a_per_key_bias_is_one_causal_tile():
    from attnkit.steer.mods import KeyBias

    B, H, N, cached = 2, 4, 1100, 300
    q, k, v = qkv(B=B, Hq=H, Hkv=2, Nq=N - cached, Nk=N, D=16, dtype=torch.float32, requires_grad=True)
    table = torch.randn(B, H, N, dtype=torch.float64)
    for score in (KeyBias(table), ak.temperature(torch.linspace(0.5, 2.0, H, dtype=torch.float64))):
        req = make_request(q, k, v, mask=ak.causal(), score=score, return_lse=True)
        plan = make_chunked_plan(req, "fused")
        assert [(b.q0, b.q1) for b in plan.for_batch(0)] == [(0, N - cached)]
        assert [(s.k0, s.k1, s.kind) for s in plan.for_batch(0)[0].segments] == [(0, cached, "full"), (cached, N, "causal")]
        out, lse = chunked_attention(req, engine="fused")
        want, want_lse = reference_attention(req, torch.float64)
        assert_close(out, want, torch.float32)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
        ref = torch.autograd.grad(want, (q, k, v), grad.double())
        for g, r in zip(got, ref):
            assert_close(g, r, torch.float32)
    # a key hidden by a -inf bias needs a dense tile: the call keeps its blocks of rows
    table[:, :, 5] = float("-inf")
    req = make_request(q, k, v, mask=ak.causal(), score=KeyBias(table))
    assert len(make_chunked_plan(req, "fused").for_batch(0)) > 1
    assert_close(chunked_attention(req, engine="fused")[0], reference_attention(req, torch.float64)[0], torch.float32)
