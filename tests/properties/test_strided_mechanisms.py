"""Mechanisms that call the fused flash op or the C loops directly give the same values
and gradients whatever the memory layout of q, k, v and of the output gradient.

The private flash op and the C loops index raw memory: before the layout normalisation in
kernels/fused.py (``flash_forward`` / ``flash_backward``) and kernels/native.py
(``dense``), a last dimension with stride != 1 made them read memory they do not own
(different garbage on every run). 3 mechanisms x 2 dtypes x 5 layouts = 30 cases.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import expanded, with_layout

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.adaptive_span import AdaptiveSpan
from helpers import TOL, qkv


def _mechanism(name: str, dtype: torch.dtype):
    if name == "adaptive_span":
        return AdaptiveSpan(max_span=40, ramp=4, num_heads=4).to(dtype), ak.causal()
    if name == "hyper_attention":
        return get_mechanism(
            "hyper_attention", block_size=16, sample_size=12, min_seq_len=32, lsh_num_projs=4, seed=3
        ), ak.causal()
    return get_mechanism("nsa", compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6).to(
        dtype
    ), ak.causal()


@pytest.mark.parametrize("layout", ["last_dim_strided", "every_other", "transposed", "offset", "expand_batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["adaptive_span", "hyper_attention", "nsa"])
def test_layout_does_not_change_values_or_gradients(name, dtype, layout):
    mech, mask = _mechanism(name, dtype)
    q0, k0, v0 = qkv(B=2, Hq=4, Hkv=2, Nq=90, Nk=90, D=16, dtype=dtype, seed=1)
    g0 = torch.randn(2, 4, 90, 16, dtype=torch.float64).to(dtype)

    def run(transform):
        leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
        q, k, v = (transform(t) for t in leaves)
        out = mech(q, k, v, mask=mask)
        grads = torch.autograd.grad(out, leaves, transform(g0))
        return out.detach(), grads

    if layout == "expand_batch":
        layout_fn = lambda t: expanded(t, 0)  # noqa: E731
        plain_fn = lambda t: expanded(t, 0).contiguous()  # noqa: E731
    else:
        layout_fn = lambda t: with_layout(t, layout)  # noqa: E731
        plain_fn = lambda t: t  # noqa: E731
    want_out, want_grads = run(plain_fn)
    got_out, got_grads = run(layout_fn)
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])
    for name_, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"d{name_}: {m}")
