"""Sigmoid attention (arXiv 2409.04431): chunked path and FlexAttention against the literal
formula sigmoid(QK^T / sqrt(d) + b) V."""

import math

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.sigmoid import Sigmoid
from helpers import assert_close, qkv


def test_matches_reference():
    mc.grid(Sigmoid())
    mc.matches_reference(Sigmoid(bias=-1.5), mc.SHAPES["gqa"], ak.causal())


def test_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch):
        for name in ("none", "causal", "window", "document"):
            mc.matches_reference(Sigmoid(), dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8), mc.MASKS[name](37), ak.alibi(4))


def test_small_tiles_without_score_mod(monkeypatch):
    """No score mod: full tiles take the keys-as-rows backward, causal diagonals the tril gates."""
    with mc.small_tiles(monkeypatch):
        for shape in (mc.SHAPES["gqa"], mc.SHAPES["bottom_right"]):
            for name in ("none", "causal", "window", "document"):
                mc.matches_reference(Sigmoid(), shape, mc.MASKS[name](shape["Nk"]))
        mc.gradchecks(Sigmoid(), mask=ak.causal())


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(Sigmoid(), mask=ak.causal(), score=ak.softcap(2.0))


def test_low_precision():
    mc.low_precision(Sigmoid(), mask=ak.causal())


def test_dead_rows_observers_empty():
    mc.dead_rows(Sigmoid())
    mc.observers(Sigmoid(), mask=ak.causal() & ak.window(6))
    mc.empty_sequences(Sigmoid())


def test_by_name():
    mc.by_name("sigmoid", Sigmoid())


@pytest.mark.parametrize("context, n", [(None, 4096), (9, 9), (256, 256)])
def test_bias_is_minus_log_n_of_the_context_not_of_the_call(context, n):
    # zero logits: every gate is sigmoid(-log n) = 1 / (1 + n), with n the mechanism's
    # context (default 4096), whatever the number of keys of the call (9 and 4)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=5, Nk=9, D=4)
    mech = Sigmoid() if context is None else Sigmoid(context=context)
    out = mech(torch.zeros_like(q), k, v)
    assert_close(out, v.sum(dim=2, keepdim=True).expand(-1, -1, 5, -1) / (1 + n))
    out = mech(torch.zeros_like(q), k[:, :, :4], v[:, :, :4])
    assert_close(out, v[:, :, :4].sum(dim=2, keepdim=True).expand(-1, -1, 5, -1) / (1 + n))


def test_a_given_bias_wins_over_the_context_and_bad_contexts_raise():
    assert Sigmoid(bias=-2.0, context=100).bias == -2.0
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sigmoid\\(context\\)"):
            Sigmoid(context=bad)


@pytest.mark.parametrize("lse_route", [False, True])
def test_flex_routes_undo_the_normalisation(lse_route):
    """Both ways of turning FlexAttention's softmax back into sigmoid gates, run here on the
    reference softmax backend (which returns the lse) in place of compiled Flex."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=13, Nk=30, D=8, Dv=5, dtype=torch.float32)
    mech = Sigmoid()
    for mask in (None, ak.causal(), ak.document(torch.arange(30) // 6)):
        req = make_request(q, k, v, mask=mask, score=ak.alibi(4))
        got = mech.flex(req, run=reference_attention, lse_route=lse_route)
        assert_close(got, mech.reference(q.double(), k.double(), v.double(), mask=mask, score=ak.alibi(4)), dtype=torch.float32)


@pytest.mark.slow
def test_flex_compiled_on_cpu():
    """Compiled FlexAttention on CPU returns no lse; the unit-key route still gives the gates."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=128, Nk=128, D=16, dtype=torch.float32)
    mech = Sigmoid()
    with torch.no_grad():
        out = mech(q, k, v, mask=ak.causal(), backend="flex")
    assert_close(out, mech.reference(q.double(), k.double(), v.double(), mask=ak.causal()), dtype=torch.float32)


def test_flex_refuses_training():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=4, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ValueError, match="backward"):
        Sigmoid()(q, k, v, backend="flex")


def test_rejects_bad_parameters():
    for bad in (math.nan, math.inf, "x", True):
        with pytest.raises(ValueError, match="bias"):
            Sigmoid(bias=bad)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="return_lse"):
        Sigmoid()(q, k, v, return_lse=True)


# ---------------------------------------------------------------- the fused C kernels

FUSED_MASKS = {
    "none": None,
    "causal": ak.causal(),
    "window": ak.window(37),
    "two-sided window": ak.window(20, 15),
    "causal & window": ak.causal() & ak.window(50),
}


@pytest.fixture
def fused_calls(monkeypatch):
    """Records which fused C kernels ran; skips where torch exposes no sgemm to call."""
    from attnkit.kernels import cpu

    if not cpu.fused_usable(*(torch.zeros(1),) * 3):
        pytest.skip("no C compiler or no sgemm exported by this torch build: the tile loop runs instead")
    calls = []
    for name in ("sigmoid_attention", "sigmoid_attention_backward"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


def _float32_against_float64(mask, shape, sigmoid=Sigmoid()):
    q, k, v = qkv(**shape, dtype=torch.float32, requires_grad=True, seed=7)
    go = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    out = ak.attention(q, k, v, mask=mask, mechanism=sigmoid)
    grads = torch.autograd.grad(out, (q, k, v), go.float())
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ak.attention(*ref_inputs, mask=mask, mechanism=sigmoid, backend="reference")
    ref_grads = torch.autograd.grad(ref, ref_inputs, go)
    assert_close(out, ref, torch.float32)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask", list(FUSED_MASKS))
def test_fused_kernel_matches_reference(mask, threads, fused_calls):
    """Band masks without a score mod run forward and backward in C (kernels/cpu/loops_fused.cpp),
    one thread or head ranges over several; GQA, Nq != Nk (bottom-right), Dv != D."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _float32_against_float64(FUSED_MASKS[mask], dict(B=2, Hq=4, Hkv=2, Nq=150, Nk=333, D=16, Dv=24))
        _float32_against_float64(FUSED_MASKS[mask], dict(B=1, Hq=2, Hkv=1, Nq=300, Nk=300, D=8), Sigmoid(bias=-1.0))
    finally:
        torch.set_num_threads(before)
    assert fused_calls == ["sigmoid_attention", "sigmoid_attention_backward"] * 2


def test_fused_kernel_not_used_for_other_masks_or_mods(fused_calls):
    shape = dict(B=1, Hq=2, Hkv=1, Nq=200, Nk=200, D=8)
    _float32_against_float64(ak.document(torch.arange(200) // 70), shape)
    q, k, v = qkv(**shape, dtype=torch.float32, seed=1)
    got = ak.attention(q, k, v, mask=ak.causal(), score=ak.softcap(3.0), mechanism="sigmoid")
    want = ak.attention(
        q.double(), k.double(), v.double(), mask=ak.causal(), score=ak.softcap(3.0), mechanism="sigmoid", backend="reference"
    )
    assert_close(got, want, torch.float32)
    assert fused_calls == []
