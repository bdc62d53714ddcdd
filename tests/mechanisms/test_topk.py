"""Top-k attention and Top-theta (arXiv 2502.08363) against their literal references;
calibration against a dense computation; kept fractions."""

import math

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms import topk as topk_module
from attnkit.mechanisms.topk import TopK, TopTheta, calibrate_top_theta
from helpers import assert_close, qkv


def test_topk_matches_reference():
    mc.grid(TopK(5))
    mc.matches_reference(TopK(3), mc.SHAPES["bottom_right"], ak.causal(), return_lse=True)


def test_topk_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch, (topk_module, "_ROW_TILING")):
        for name in ("none", "causal", "window", "document"):
            mc.matches_reference(
                TopK(6), dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8), mc.MASKS[name](37), ak.softcap(3.0), return_lse=True
            )


def test_topk_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch, (topk_module, "_ROW_TILING")):
        mc.gradchecks(TopK(3), mask=ak.causal(), score=ak.alibi(2))


def test_topk_contract():
    mc.low_precision(TopK(4), mask=ak.causal(), dtypes=(torch.float32,))
    mc.dead_rows(TopK(4))
    mc.observers(TopK(4), mask=ak.causal())
    mc.empty_sequences(TopK(4))
    mc.by_name("topk", TopK(4))


def test_topk_keeps_k_and_reports_it():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=16, Nk=16, D=8)
    mech = TopK(5)
    mech(q, k, v, mask=ak.causal())
    visible = torch.arange(1, 17, dtype=torch.float64)
    assert mech.kept_fraction == pytest.approx(float(visible.clamp(max=5).sum() / visible.sum()))
    assert torch.allclose(mech.kept_per_head, torch.full((4,), mech.kept_fraction, dtype=torch.float64))
    # k >= every row's visible keys: exact softmax attention
    out, lse = TopK(16)(q, k, v, mask=ak.causal(), return_lse=True)
    ref, ref_lse = reference_attention(make_request(q, k, v, mask=ak.causal()))
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_grouped_selection_is_a_top_k_set():
    # rows long enough for several rounds of grouping, a tail outside the groups, masked
    # columns, rows with fewer than k visible, and ties at the k-th value
    g = torch.Generator().manual_seed(3)
    s = torch.randn(6, 2051, generator=g).round(decimals=1)
    s[1, 40:] = -math.inf
    s[2, :2000] = -math.inf
    s[3] = 0.0
    for k in (1, 7, 64):
        values, cols = topk_module._top_columns(s, k)
        assert cols.shape == (6, k)
        assert (cols.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct columns
        assert torch.equal(values, s.gather(-1, cols))
        kept = values.sort(-1, descending=True).values
        assert torch.equal(kept, s.topk(k, dim=-1).values)


def _theta(q, k, keep, mask, per_position):
    return calibrate_top_theta(q.detach(), k.detach(), keep, mask=mask, per_position=per_position)


@pytest.mark.parametrize("mask", [None, ak.causal(), ak.window(40), ak.window(20, 15)], ids=repr)
def test_topk_c_forward_matches_reference_and_pytorch_path(mask, monkeypatch):
    """float32 with a band mask: the forward runs in C (kernels/cpu/); values, lse,
    gradients (from the saved choice) and the kept/visible report against the float64
    reference and against the PyTorch block path; GQA, Nq != Nk, Dv != D, rows that see
    fewer than k keys."""
    from attnkit.kernels import cpu

    if not cpu.fused_usable(*(torch.zeros(1),) * 3):
        pytest.skip("no C compiler or no sgemm exported by this torch build: the PyTorch path runs instead")
    calls = []
    real = cpu.topk_attention
    monkeypatch.setattr(cpu, "topk_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=150, Nk=333, D=16, Dv=24, dtype=torch.float32, requires_grad=True, seed=5)
    go = torch.randn(2, 4, 150, 24, dtype=torch.float64)

    def run(mech, inputs, backend="auto"):
        out, lse = mech(*inputs, mask=mask, return_lse=True, backend=backend)
        return (out, lse, *torch.autograd.grad(out, inputs, go.to(out.dtype)))

    mech = TopK(k=24)
    fast = run(mech, (q, k, v))
    fraction = mech.kept_fraction
    assert calls == [1]
    want = run(TopK(k=24), [t.detach().double().requires_grad_() for t in (q, k, v)], backend="reference")
    monkeypatch.setattr(cpu, "usable", lambda *tensors: False)
    slow_mech = TopK(k=24)
    slow = run(slow_mech, (q, k, v))
    for f, s_, w in zip(fast, slow, want):
        assert_close(f, w, torch.float32)
        assert_close(f, s_, torch.float32)
    assert fraction == pytest.approx(slow_mech.kept_fraction)


@pytest.mark.parametrize("compensation", ["none", "denominator", "denominator+vmean"])
def test_top_theta_matches_reference(compensation):
    g = torch.Generator().manual_seed(0)
    masks = (None, ak.causal(), ak.document(torch.arange(100) // 7))
    for i, shape in enumerate(mc.SHAPES.values()):
        if i % 2:  # one threshold per head and position, some positions unthresholded
            theta = torch.randn(4, shape["Nk"], generator=g) * 0.3
            theta[:, ::5] = -math.inf
        else:
            theta = torch.linspace(-0.4, 0.5, 4)
        mech = TopTheta(theta, compensation=compensation, sdc_scale=0.7)
        for mask in (masks[i], masks[(i + 1) % 3]):
            if isinstance(mask, ak.Mask) and "document" in repr(mask):
                mask = ak.document(torch.arange(shape["Nk"]) // 7)
            mc.matches_reference(mech, shape, mask, ak.softcap(3.0), seed=5, return_lse=True)


def test_top_theta_small_tiles_gradcheck(monkeypatch):
    q, k, _ = qkv(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8)
    mech = TopTheta(_theta(q, k, 5, ak.causal(), True)).double()
    with mc.small_tiles(monkeypatch):
        for name in ("causal", "window", "document"):
            mc.matches_reference(mech, dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8), mc.MASKS[name](37), return_lse=True)
        shape = dict(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=3, Dv=2)
        q, k, _ = qkv(**shape, seed=11)  # calibrated on other samples: no logit sits on a threshold
        mc.gradchecks(TopTheta(_theta(q, k, 2, ak.causal(), True)), shape=shape, mask=ak.causal())


def test_top_theta_contract():
    mech = TopTheta(torch.tensor([0.1, -0.2, 0.3, 0.0]), compensation="none")
    mc.low_precision(mech, mask=ak.causal(), dtypes=(torch.float32,))
    mc.observers(mech, mask=ak.causal())
    mc.by_name("top_theta", mech)
    mc.dead_rows(TopTheta(torch.tensor([0.1, -0.1])))
    mc.empty_sequences(TopTheta(torch.tensor([0.1, -0.1])))


def test_top_theta_observers_see_compensated_weights():
    mc.observers(TopTheta(torch.tensor([0.1, -0.2, 0.3, 0.0])), mask=ak.causal())


def test_calibration_against_dense_thresholds():
    q, k, _ = qkv(B=3, Hq=4, Hkv=2, Nq=30, Nk=30, D=8, seed=2)
    s = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(-1, -2)) / math.sqrt(8)
    s = s.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), -math.inf)
    kth = s.sort(dim=-1, descending=True).values[..., 6]  # the 7th largest: keeping s > it keeps 6
    used = torch.arange(30) >= 6  # rows with more than 6 visible keys
    theta = calibrate_top_theta(q, k, 6, mask=ak.causal())
    assert_close(theta.double(), kth[:, :, used].mean(dim=(0, 2)), dtype=torch.float32)
    table = calibrate_top_theta(q, k, 6, mask=ak.causal(), per_position=True, add_sigma=1.0)
    expected = kth.mean(0) + kth.std(0, unbiased=False)
    assert_close(table[:, used].double(), expected[:, used], dtype=torch.float32)
    assert torch.isneginf(table[:, ~used]).all()
    # on the calibration data itself, per-position thresholds keep about 6 per long row,
    # and the mechanism reports the fraction it kept
    plain = calibrate_top_theta(q, k, 6, mask=ak.causal(), per_position=True)
    keep = s > plain.double()[None, :, :, None]
    assert keep.sum(-1)[:, :, used].double().mean() == pytest.approx(6, abs=1.5)
    mech = TopTheta(plain, compensation="none")
    mech(q, k, k, mask=ak.causal())
    assert mech.kept_fraction == pytest.approx(float(keep.sum() / torch.isfinite(s).sum()))


def test_top_theta_without_thresholds_is_softmax():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=9, Nk=9, D=4)
    mech = TopTheta(torch.full((2,), -math.inf))
    out = mech(q, k, v, mask=ak.causal())
    assert_close(out, reference_attention(make_request(q, k, v, mask=ak.causal()))[0])
    assert mech.kept_fraction == 1.0


def test_rejects_bad_parameters():
    with pytest.raises(ValueError, match=r"topk\(k\)"):
        TopK(0)
    for bad in (torch.tensor([math.nan]), torch.tensor([math.inf]), torch.zeros(2, 2, 2), [1.0]):
        with pytest.raises(ValueError, match="thresholds"):
            TopTheta(bad)
    with pytest.raises(ValueError, match="compensation"):
        TopTheta(torch.zeros(2), compensation="all")
    with pytest.raises(ValueError, match="sdc_scale"):
        TopTheta(torch.zeros(2), sdc_scale=-1)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=4)
    with pytest.raises(ValueError, match="no thresholds"):
        TopTheta()(q, k, v)
    with pytest.raises(ValueError, match="heads"):
        TopTheta(torch.zeros(3))(q, k, v)
    with pytest.raises(ValueError, match="positions"):
        TopTheta(torch.zeros(2, 5))(q, k, v)
    with pytest.raises(ValueError, match="keep"):
        calibrate_top_theta(q, k, 0)
    with pytest.raises(ValueError, match="more than keep"):
        calibrate_top_theta(q, k, 8)
