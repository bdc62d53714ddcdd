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
