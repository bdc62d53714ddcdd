"""Compiled FlexAttention backend: same mods, same results; its CPU limits refused clearly."""

import pytest
import torch
from helpers import assert_close, qkv

import attnkit as ak
from attnkit.kernels import flex, make_request


@pytest.mark.slow
def test_flex_runs_attnkit_mods_and_masks_exactly():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=96, Nk=160, D=16, dtype=torch.float32)
    ids = torch.arange(160) // 50
    for kw in (dict(mask=ak.causal() & ak.document(ids), score=ak.alibi(4)),):
        got = ak.attention(q, k, v, backend="flex", **kw)
        want = ak.attention(q, k, v, backend="reference", **kw)
        assert_close(got, want, torch.float32)
    # a second document layout reuses the compiled kernel (dynamic=False, same signature)
    before = len(flex._signatures)
    ids2 = torch.arange(160) // 30
    got = ak.attention(q, k, v, backend="flex", mask=ak.causal() & ak.document(ids2), score=ak.alibi(4))
    assert_close(got, ak.attention(q, k, v, backend="reference", mask=ak.causal() & ak.document(ids2), score=ak.alibi(4)), torch.float32)
    assert len(flex._signatures) == before


def test_flex_refuses_what_cpu_flex_cannot_do(monkeypatch):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=16, dtype=torch.float32)
    assert "no lse on CPU" in flex.flex_unsupported(make_request(q, k, v, return_lse=True))
    assert "no lse on CPU" in flex.flex_unsupported(make_request(q, k, v, sinks=torch.zeros(2)))
    assert "no backward on CPU" in flex.flex_unsupported(make_request(q.requires_grad_(), k, v))


def test_flex_refuses_calls_past_the_recompile_limit(monkeypatch):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=16, dtype=torch.float32)
    monkeypatch.setattr(flex, "_signatures", {("some", "earlier", "signature")})
    monkeypatch.setattr(flex, "_recompile_limit", lambda: 1)
    reason = flex.flex_unsupported(make_request(q, k, v, mask=ak.causal()))
    assert "recompile limit (1)" in reason and "unfused O(N^2)" in reason
