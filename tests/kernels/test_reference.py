"""The reference backend is the definition: check it against a per-row loop and torch SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from helpers import assert_close, qkv


def naive(q, k, v, visible, scale, sinks=None):
    """Softmax attention one row at a time, in float64 Python-level loops over rows."""
    B, H, Nq, _ = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H, Nq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                keys = [j for j in range(k.shape[2]) if visible[b, h, i, j]]
                logits = [float(q[b, h, i] @ k[b, h // G, j]) * scale for j in keys]
                if sinks is not None:
                    logits.append(float(sinks[h]))
                if not logits:
                    continue
                m = max(logits)
                z = sum(math.exp(x - m) for x in logits)
                lse[b, h, i] = m + math.log(z)
                for x, j in zip(logits, keys):
                    out[b, h, i] += math.exp(x - lse[b, h, i]) * v[b, h // G, j]
    return out, lse


@pytest.mark.parametrize("Nq,Nk", [(7, 7), (3, 9)])
def test_reference_matches_per_row_loop(Nq, Nk):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=Nq, Nk=Nk, D=5, Dv=3)
    sinks = torch.randn(4, dtype=torch.float64)
    mask = ak.causal() & ak.window(4)
    req = make_request(q, k, v, mask=mask, scale=0.7, sinks=sinks)
    out, lse = reference_attention(req)
    vis = mask.dense(2, 4, Nq, Nk).expand(2, 4, Nq, Nk)
    want_out, want_lse = naive(q, k, v, vis, 0.7, sinks)
    assert_close(out, want_out)
    assert_close(lse, want_lse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_matches_sdpa_with_dense_mask(dtype):
    q, k, v = qkv(B=2, Hq=6, Hkv=3, Nq=33, Nk=40, D=8, dtype=dtype)
    mask = ak.document(torch.arange(40) // 9) & ak.window(12, 3)
    dense = mask.dense(2, 6, 33, 40)
    got = ak.attention(q, k, v, mask=mask, backend="reference")
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
    assert_close(got, want, dtype)


def test_reference_rows_without_keys_are_zero_with_zero_gradient():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=6, Nk=6, requires_grad=True)
    mask = lambda b, h, i, j: (i % 2 == 0) & (j <= i)  # noqa: E731
    out, lse = ak.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    assert torch.equal(out[:, :, 1::2], torch.zeros_like(out[:, :, 1::2]))
    assert torch.isneginf(lse[:, :, 1::2]).all() and torch.isfinite(lse[:, :, ::2]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, 1::2], torch.zeros_like(q.grad[:, :, 1::2]))
