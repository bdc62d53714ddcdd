"""Differential attention (arXiv 2410.05258) against its literal two-map formula."""

import math

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.differential import Differential
from helpers import assert_close, qkv


def test_matches_reference():
    mc.grid(Differential())
    mc.grid(Differential(lambda_dim=4).double(), shapes={"gqa": mc.SHAPES["gqa"]})


def test_multi_tile():
    mc.matches_reference(
        Differential(layer_index=3), dict(B=1, Hq=4, Hkv=2, Nq=280, Nk=300, D=8), ak.causal() & ak.window(100), ak.softcap(3.0)
    )


def test_gradcheck():
    mc.gradchecks(Differential(lambda_init=0.3), shape=dict(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=4, Dv=2), mask=ak.causal())


def test_contract():
    mc.low_precision(Differential(), mask=ak.causal())
    mc.dead_rows(Differential())
    mc.observers(Differential(lambda_init=0.6), mask=ak.causal())
    mc.empty_sequences(Differential())
    mc.by_name("differential", Differential())


def test_lambda_zero_is_softmax_of_the_first_halves():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=9, Nk=9, D=8)
    out = Differential(lambda_init=0.0)(q, k, v, mask=ak.causal())
    ref, _ = reference_attention(make_request(q[..., :4], k[..., :4], v, mask=ak.causal()))
    assert_close(out, ref)


def test_lambda_schedule_and_reparameterisation():
    assert Differential(layer_index=0).lambda_init == pytest.approx(0.2)
    assert Differential(layer_index=5).lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.5))
    mech = Differential(lambda_dim=3)
    with torch.no_grad():
        for name, value in (("lambda_q1", 0.1), ("lambda_k1", 0.2), ("lambda_q2", 0.3), ("lambda_k2", -0.1)):
            getattr(mech, name).fill_(value)
    assert mech.lam().item() == pytest.approx(math.exp(3 * 0.02) - math.exp(-3 * 0.03) + 0.8, rel=1e-6)


def test_rejects_bad_input():
    for kwargs in (dict(lambda_init=math.nan), dict(layer_index=-1), dict(lambda_dim=0)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            Differential(**kwargs)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=5)
    with pytest.raises(ValueError, match="odd"):
        Differential()(q, k, v)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="return_lse"):
        Differential()(q, k, v, return_lse=True)


def test_maps_share_one_grouped_call_only_when_heads_look_alike():
    # a mask that reads h: renumbering the heads for the grouped call would change it, so
    # each map gets its own call
    def by_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((h % 2 == 0) | (kv_idx >= q_idx - 3))

    mc.matches_reference(Differential(lambda_dim=2).double(), dict(B=2, Hq=4, Hkv=2, Nq=13, Nk=13, D=8), by_head)
    for backend in ("auto", "chunked"):
        mc.matches_reference(
            Differential(lambda_dim=2).double(), dict(B=2, Hq=4, Hkv=2, Nq=13, Nk=13, D=8), ak.causal(), backend=backend
        )


@pytest.mark.parametrize(
    "mask",
    [None, ak.causal(), ak.window(40), ak.window(20, 15), ak.document(torch.arange(330) // 100)],
    ids=["none", "causal", "window", "two-sided", "document"],
)
def test_float32_inference_matches_reference(mask, monkeypatch):
    """float32 without gradients: band masks take the C kernel with D/2-wide query and key
    heads against Dv-wide values, other masks the grouped call; GQA, Nq != Nk, Dv != D."""
    from attnkit.kernels import cpu

    calls = []
    real = cpu.softmax_attention
    monkeypatch.setattr(cpu, "softmax_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=300, Nk=330, D=16, Dv=24, dtype=torch.float32)
    mech = Differential(lambda_init=0.5)
    with torch.no_grad():
        out = mech(q, k, v, mask=mask)
    assert_close(out, mech.reference(q.double(), k.double(), v.double(), mask=mask), dtype=torch.float32)
    band = mask is None or mask.band() is not None
    assert calls == ([1] if band and cpu.fused_usable(q, k, v) else [])


@pytest.mark.parametrize("learned", [False, True])
def test_float64_call_computes_lambda_in_float64(learned):
    """λ = 0.8 (or the re-parameterised λ from float32 vectors) enters a float64 call in
    float64: float32's 0.800000011920929 would be off by 1e-8, far above TOL[float64]."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=6, Nk=6, D=4)
    mech = Differential(lambda_init=0.8, lambda_dim=3 if learned else None)  # parameters stay float32
    lam = torch.tensor(0.8, dtype=torch.float64)
    if learned:
        p = {n: getattr(mech, n).detach().double() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
        lam = torch.exp(p["lambda_q1"] @ p["lambda_k1"]) - torch.exp(p["lambda_q2"] @ p["lambda_k2"]) + 0.8
    s = 1 / math.sqrt(2)
    p1 = torch.softmax(q[..., :2] @ k[..., :2].transpose(-1, -2) * s, dim=-1)
    p2 = torch.softmax(q[..., 2:] @ k[..., 2:].transpose(-1, -2) * s, dim=-1)
    want = (p1 - lam * p2) @ v
    for out in (mech(q, k, v), mech.reference(q, k, v)):
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, want, atol=1e-13, rtol=1e-13)
