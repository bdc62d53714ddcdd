"""The per-key bias interventions are made of (PASTA's log alpha outside the spans) runs in
the fused kernel as a row of offsets, also on tiles the causal mask cuts: values, lse and
gradients against the float64 formula written here, at sizes that cross query blocks."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request
from attnkit.kernels.chunked import choose_engine
from attnkit.steer.mods import KeyBias


def literal(q, k, v, table, causal):
    """softmax(q k^T / sqrt(D) + table[b, h, kv]) v, with GQA and a causal mask."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.mT / math.sqrt(q.shape[-1]) + table[:, :, None, :]
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hidden", [False, True])
def test_key_bias_matches_the_formula_forward_and_backward(causal, hidden):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, N, D = 2, 4, 2, 1300, 16
    q, k, v = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (Hq, Hkv, Hkv))
    table = torch.where(torch.rand(B, Hq, N, generator=g) < 0.5, math.log(0.01), 0.0).double()
    if hidden:  # keys hidden wholly by -inf: the dense path takes those tiles
        table[:, :, 300:340] = -math.inf
    mask = ak.causal() if causal else None
    assert choose_engine(make_request(q, k, v, mask=mask, score=KeyBias(table)))[0] == "fused"
    out, lse = ak.attention(q, k, v, mask=mask, score=KeyBias(table), return_lse=True)
    want, want_lse = literal(q, k, v, table, causal)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)  # float64: rounding only
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def literal_rows(q, k, v, table, causal):
    """``literal`` for Nq <= Nk queries at the last positions (query i at Nk - Nq + i); a
    row that sees no key gives 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.mT / math.sqrt(q.shape[-1]) + table[:, :, None, :]
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1), -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)  # all -inf: NaN, a row that sees nothing
    return w @ v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_few_queries_take_sdpa_with_the_offsets_as_its_mask(dtype, nq, causal):
    """A prefill of a few tokens or a decoding step with a per-key bias: SDPA with the
    offsets as its float mask (kernels/key_offsets.py), against the formula; keys hidden
    by -inf, and a row whose every visible key is hidden (output 0)."""
    from attnkit.kernels.key_offsets import key_offset_terms

    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, Nk, D = 2, 4, 2, 12, 16
    q = torch.randn(B, Hq, nq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.where(torch.rand(B, Hq, Nk, generator=g) < 0.5, math.log(3.0), 0.0).double()
    table[0, 1, : Nk - nq + 1] = -math.inf  # batch row 0, head 1: the first query sees only hidden keys
    table[1, :, 4:7] = -math.inf
    mask = ak.causal() if causal else None
    q, k, v = (t.to(dtype) for t in (q, k, v))
    assert key_offset_terms(make_request(q, k, v, mask=mask, score=KeyBias(table))) is not None
    out = ak.attention(q, k, v, mask=mask, score=KeyBias(table))
    want = literal_rows(q.double(), k.double(), v.double(), table, causal)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)  # float32 roundoff
    torch.testing.assert_close(out.double(), want, **tol)
    if causal or nq == 1:  # that row sees no key: exactly 0 as the kernels give
        assert torch.equal(out[0, 1, 0], torch.zeros(D, dtype=dtype))


def test_a_key_only_bias_of_ones_own_takes_the_same_path():
    """A user's key-only Bias (no table: the default key_row evaluates bias() on one query
    row) through the SDPA path, against the reference backend's literal float64 formula."""
    from attnkit.kernels.key_offsets import key_offset_terms
    from attnkit.mods.scores import Bias

    class KeyRamp(Bias):
        key_only = True

        def bias(self, b, h, q_idx, kv_idx):
            return -0.1 * (h + 1) * kv_idx.to(torch.float64)

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, n, 8, dtype=torch.float64, generator=g) for h, n in ((4, 3), (2, 9), (2, 9)))
    assert key_offset_terms(make_request(q, k, v, mask=ak.causal(), score=KeyRamp())) is not None
    got = ak.attention(q, k, v, mask=ak.causal(), score=KeyRamp())
    want = ak.attention(q, k, v, mask=ak.causal(), score=KeyRamp(), backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # float64: rounding only
