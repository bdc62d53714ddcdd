"""Attention regulation (arXiv 2403.06381): the bias runs through attnkit's kernels on
the target tokens' logits only (literal float64 reference), a zero bias is the model,
the optimisation starts from the model's own maps (dense, from the default processors'
q and k) and lowers the objective, and the model is restored after errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import diffusion_tiny as tiny  # noqa: E402
from diffusion_reference import recorded, restored, softmax64  # noqa: E402

import attnkit.diffusion as ad  # noqa: E402
from attnkit.diffusion.layers import select_layers  # noqa: E402
from attnkit.diffusion.regulation import TokenBias, gaussian_basis  # noqa: E402
from attnkit.diffusion.switch import edits_on  # noqa: E402
from helpers import assert_close  # noqa: E402

T = tiny.TEXT
TOKENS = [1, 3]


def _table(b, h, n, k):
    """A fixed bias with a different value at every (row, head, query, target)."""
    i = torch.arange(n, dtype=torch.float64).view(1, 1, -1, 1)
    j = torch.arange(k, dtype=torch.float64).view(1, 1, 1, -1)
    bb = torch.arange(b, dtype=torch.float64).view(-1, 1, 1, 1)
    hh = torch.arange(h, dtype=torch.float64).view(1, -1, 1, 1)
    return 0.7 * torch.sin(0.3 * i + 1.1 * j + 0.5 * bb + 0.9 * hh)


@pytest.mark.parametrize("layout", [((0, 16), (16, 21)), ((5, 29), (0, 5)), ((0, 48), (0, 5))])
def test_token_bias_reaches_only_target_logits(layout):
    (i_lo, i_hi), (t_lo, t_hi) = layout  # SD3 [image; text], Flux [text; image], UNet cross
    nq = nk = max(i_hi, t_hi)
    if (t_lo, t_hi) == (0, 5) and i_lo == 0:
        nq, nk = i_hi, t_hi
    table = _table(2, 3, i_hi - i_lo, len(TOKENS))
    mod = TokenBias(table, [t_lo + t for t in TOKENS], (i_lo, i_hi)).bind(2, 3, nq, nk)
    s = torch.randn(2, 3, nq, nk, dtype=torch.float64)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(3).view(1, -1, 1, 1)
    q_idx, kv = (torch.arange(nq) + nk - nq).view(1, 1, -1, 1), torch.arange(nk).view(1, 1, 1, -1)
    got = mod(s, b, h, q_idx, kv)
    expected = s.clone()
    for n, t in enumerate(TOKENS):
        expected[:, :, i_lo:i_hi, t_lo + t] += table[..., n]
    assert torch.equal(got, expected)


class _Fixed:
    """An edit putting ``_table`` on the target tokens of every call."""

    def __init__(self):
        self.layouts = []

    def scores(self, layout, query, key):
        self.layouts.append(layout)
        (i_lo, i_hi), (t_lo, _) = layout.image_queries, layout.text_keys
        table = _table(query.shape[0], query.shape[1], i_hi - i_lo, len(TOKENS)).to(query.dtype)
        return [TokenBias(table, [t_lo + t for t in TOKENS], (i_lo, i_hi))]

    def output(self, layout, out):
        return out


@pytest.mark.parametrize("name", ["unet", "sd3", "flux"])
def test_a_token_bias_through_the_kernels_equals_the_dense_reference(name):
    model, inputs = tiny.MODELS[name]()
    image_first = name != "flux"

    def logits(s):  # (B, H, Nq, Nk) float64: literal placement of the bias
        s = s.clone()
        nq, nk = s.shape[-2:]
        if name == "unet" and nk != T:  # the UNet's self-attention: no text keys
            return s
        if name == "unet":
            i_lo, i_hi, t_lo = 0, nq, 0
        elif image_first:
            i_lo, i_hi, t_lo = 0, nq - T, nq - T
        else:
            i_lo, i_hi, t_lo = T, nq, 0
        table = _table(s.shape[0], s.shape[1], i_hi - i_lo, len(TOKENS))
        for n, t in enumerate(TOKENS):
            s[:, :, i_lo:i_hi, t_lo + t] += table[..., n]
        return s

    with torch.no_grad():
        expected, _ = recorded(model, lambda: tiny.run(model, inputs), logits)
    chosen = select_layers(model, None, ("cross", "joint"))
    edit = _Fixed()
    with torch.no_grad(), ad.use(model, layers=[layer.name for layer in chosen]), edits_on(chosen, lambda layer, prev: edit):
        out = tiny.run(model, inputs)
    with torch.no_grad():
        base = tiny.run(model, inputs)
    assert len(edit.layouts) == len(chosen)
    assert (expected - base).abs().max() > 1e-4  # the bias is visible
    assert_close(out, expected, torch.float32)
    assert restored(model)


@pytest.mark.parametrize("name", ["unet", "sd3"])
def test_zero_bias_is_the_model(name):
    model, inputs = tiny.MODELS[name]()
    with torch.no_grad():
        base = tiny.run(model, inputs)
        with ad.use(model):
            routed = tiny.run(model, inputs)
        with ad.regulate(model, TOKENS, iterations=0) as reg:
            out = tiny.run(model, inputs)
    assert torch.equal(out, routed) and reg.calls == []
    assert_close(out, base, torch.float32)


def _objective_literal(p):
    """The objective at zero weights of the targets' maps p (B, H, N, K), float64."""
    k = p.shape[-1]
    high = (torch.quantile(p, 0.9, dim=2) - 0.9) ** 2
    even = (p.mean(2) - min(1.0, 0.2 * k) / k) ** 2
    return float((1.0 * high.mean(-1) + 80.0 * even.mean(-1)).sum())


@pytest.mark.parametrize("name", ["unet", "sd3"])
def test_regulation_starts_from_the_model_maps_and_lowers_the_objective(name):
    model, inputs = tiny.MODELS[name]()
    with torch.no_grad():
        _, calls = recorded(model, lambda: tiny.run(model, inputs))
    expected = []
    for path, q, k, scale in calls:
        nq = q.shape[2]
        if name == "unet" and not path.endswith("attn2"):
            continue
        rows, cols = (slice(None), slice(None)) if name == "unet" else (slice(0, nq - T), slice(nq - T, nq))
        p = softmax64(q, k, scale)[:, :, rows, cols]
        expected.append((path, _objective_literal(p[..., TOKENS])))
    # one layer at a time, so each regulated call's inputs are the model's own
    for path, before in expected:
        with torch.no_grad(), ad.regulate(model, TOKENS, layers=[path]) as reg:
            out = tiny.run(model, inputs)
        (call,) = reg.calls
        assert call.layer == path and call.step == 0
        assert abs(call.before - before) <= 1e-5 * max(1.0, before)
        assert call.after < call.before - 1e-3
    with torch.no_grad(), ad.regulate(model, TOKENS) as reg:
        out = tiny.run(model, inputs)
    assert [c.layer for c in reg.calls] == [p for p, _ in expected]
    assert all(c.after < c.before - 1e-3 for c in reg.calls)
    with torch.no_grad():
        assert (out - tiny.run(model, inputs)).abs().max() > 1e-4
    assert restored(model)


def test_steps_select_the_regulated_calls():
    model, inputs = tiny.pixart()
    with torch.no_grad():
        base = tiny.run(model, inputs)
        with ad.regulate(model, TOKENS, steps=[1]) as reg:
            first = tiny.run(model, inputs)
            second = tiny.run(model, inputs)
    assert_close(first, base, torch.float32)
    assert (second - base).abs().max() > 1e-5
    assert {c.step for c in reg.calls} == {1}


def test_bias_is_smooth_bumps_and_bad_input_is_refused():
    basis = gaussian_basis((16, 16))
    assert basis.shape == (49, 256)  # centres every 2 cells from 2: 7 x 7, as the authors place them
    assert_close(basis.max(1).values, torch.ones(49), torch.float32)
    model, inputs = tiny.unet()
    with pytest.raises(ValueError, match="tokens"):
        with torch.no_grad(), ad.regulate(model, [T + 2]):
            tiny.run(model, inputs)
    with pytest.raises(ValueError, match="layers"):
        with ad.regulate(model, TOKENS, layers=["down_blocks.0.attentions.0.transformer_blocks.0.attn1"]):
            pass
    with pytest.raises(ValueError, match="quantile"):
        with ad.regulate(model, TOKENS, quantile=1.0):
            pass
    with pytest.raises(ValueError, match="table"):
        TokenBias(torch.zeros(1, 1, 4, 2), [1], (0, 4))
    assert restored(model)


def test_model_is_restored_after_an_exception():
    model, inputs = tiny.sd3()
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), ad.regulate(model, TOKENS), ad.record_maps(model) as rec:
            tiny.run(model, inputs)
            assert rec.maps().shape == (2, T, 4, 4)
            raise RuntimeError("boom")
    assert restored(model)
    with torch.no_grad():
        out = tiny.run(model, inputs)
        with ad.use(model):
            assert_close(tiny.run(model, inputs), out, torch.float32)


def test_conditional_only_leaves_the_unconditional_rows_alone():
    model, inputs = tiny.unet()  # batch rows are independent in the UNet
    with torch.no_grad():
        base = tiny.run(model, inputs)
        with ad.regulate(model, TOKENS, conditional_only=True):
            out = tiny.run(model, inputs)
    assert_close(out[0], base[0], torch.float32)
    assert (out[1] - base[1]).abs().max() > 1e-4
