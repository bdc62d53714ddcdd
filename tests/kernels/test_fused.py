"""kernels/fused.py: the flash op's backward with a gradient on the logsumexp too."""

import math

import torch

from attnkit.kernels.fused import backward_with_lse_grad, flash_backward, flash_forward
from helpers import assert_close, qkv


def _dense(q, k, v, scale):
    """The literal formulas: lse = log sum_j exp(s_ij), o = softmax(s) v, s = scale q k^T."""
    s = scale * q @ k.transpose(-1, -2)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def test_lse_gradient_enters_through_the_extra_column():
    q, k, v = qkv(B=2, Hq=3, Hkv=3, Nq=9, Nk=13, D=5, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(5)
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(2, 3, 9, 5, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    out, lse = _dense(q, k, v, scale)
    want = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v), retain_graph=True)
    want_no_lse = torch.autograd.grad((out * grad_out).sum(), (q, k, v))

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    op_out, op_lse = flash_forward(qd, kd, vd, scale=scale)
    assert_close(op_out, out.detach())
    got = backward_with_lse_grad(flash_backward, grad_out, grad_lse, qd, kd, vd, op_out, op_lse.double(), 0.0, False, scale=scale)
    plain = backward_with_lse_grad(flash_backward, grad_out, None, qd, kd, vd, op_out, op_lse.double(), 0.0, False, scale=scale)
    for a, b, c, d in zip(got, want, plain, want_no_lse):
        assert a.shape == b.shape
        assert_close(a, b)
        assert_close(c, d)
    # the lse term matters here: without it the gradients differ
    assert (want[0] - want_no_lse[0]).abs().max() > 1e-2


def test_key_offsets_of_minus_inf_stay_on_the_op_and_hide_whole_causal_rows(monkeypatch):
    """Per-key offsets with -inf (keys hidden from every query, as an ablation of image
    keys hides them) go to the op with its causal mask; the rows of a causal segment whose
    visible keys are all hidden are reported dead. Values and gradients equal the float64
    reference, the first rows (which see only hidden keys) included in the values."""
    import attnkit
    import attnkit.kernels.fused as fused
    from attnkit.steer.mods import KeyBias

    calls = []
    original = fused._dead_causal
    monkeypatch.setattr(fused, "_dead_causal", lambda *a: calls.append(1) or original(*a))
    torch.manual_seed(0)
    B, H, N = 2, 3, 300
    q, k, v = (torch.randn(B, H, N, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.zeros(B, H, N, dtype=torch.float64)
    table[:, :, :5] = -math.inf  # rows 0..4 see no key
    table[:, :, 100:250] = -math.inf  # a span in the middle, as an image's keys
    table[1, 1] = 0.0  # one head of one row hides nothing
    call = dict(mask=attnkit.causal(), score=KeyBias(table))
    out = attnkit.attention(q, k, v, backend="chunked", **call)
    ref = attnkit.attention(q, k, v, backend="reference", **call)
    assert calls  # the op path, not dense tiles
    assert_close(out, ref)
    grads = torch.autograd.grad(out[:, :, 5:].sum(), (q, k, v))
    want = torch.autograd.grad(ref[:, :, 5:].sum(), (q, k, v))
    for got, exp in zip(grads, want):
        assert_close(got, exp)
