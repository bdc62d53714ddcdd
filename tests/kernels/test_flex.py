"""Compiled FlexAttention backend: same mods, same results; its CPU limits refused clearly;
a compiled kernel that gives wrong numbers is caught on its first call and never trusted."""

import pytest
import torch

import attnkit as ak
from attnkit.kernels import flex, make_request
from helpers import assert_close, qkv


def _compiles() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_flex_runs_attnkit_mods_and_masks_exactly():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=96, Nk=160, D=16, dtype=torch.float32)
    ids = torch.arange(160) // 50
    for kw in (dict(mask=ak.causal() & ak.document(ids), score=ak.alibi(4)),):
        got = ak.attention(q, k, v, backend="flex", **kw)
        want = ak.attention(q, k, v, backend="reference", **kw)
        assert_close(got, want, torch.float32)
    # a second document layout reuses the compiled kernel (dynamic=False, same signature)
    before = _compiles()
    ids2 = torch.arange(160) // 30
    got = ak.attention(q, k, v, backend="flex", mask=ak.causal() & ak.document(ids2), score=ak.alibi(4))
    assert_close(
        got, ak.attention(q, k, v, backend="reference", mask=ak.causal() & ak.document(ids2), score=ak.alibi(4)), torch.float32
    )
    assert _compiles() == before


@pytest.mark.slow
def test_flex_is_right_where_torch_compiled_flex_was_wrong():
    """torch 2.13's compiled CPU flex returned wrong numbers (or NaN) at D = 8 and 16 with
    40 tokens on AVX2 builds (docs/flex.md); attnkit pads lengths to buckets, checks each
    kernel once, and lengths of one bucket share a kernel."""
    g = torch.Generator().manual_seed(0)
    for batch, mask in ((2, None), (1, ak.causal() & ak.window(5))):
        q, k, v = (torch.randn(batch, 2, 40, 8, generator=g) for _ in range(3))
        want = ak.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        assert_close(ak.attention(q, k, v, mask=mask, backend="flex"), want, torch.float32)
    before = _compiles()
    for n in (33, 47, 64):  # the bucket of 40 queries and keys: 64 queries, 128 keys
        q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
        want = ak.attention(q.double(), k.double(), v.double(), backend="reference")
        assert_close(ak.attention(q, k, v, backend="flex"), want, torch.float32)
    assert _compiles() == before


def test_lengths_are_padded_to_buckets():
    assert [flex.bucket(n) for n in (1, 2, 3, 40, 64, 65)] == [1, 2, 4, 64, 64, 128]
    assert [flex.bucket(n, 128) for n in (1, 128, 129, 300)] == [128, 128, 256, 512]


def test_flex_refuses_what_cpu_flex_cannot_do():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=16, dtype=torch.float32)
    assert "no lse on CPU" in flex.flex_unsupported(make_request(q, k, v, return_lse=True))
    assert "no lse on CPU" in flex.flex_unsupported(make_request(q, k, v, sinks=torch.zeros(2)))
    assert "no backward on CPU" in flex.flex_unsupported(make_request(q.requires_grad_(), k, v))


def test_a_kernel_wrong_on_its_first_call_is_never_trusted(monkeypatch):
    """A stand-in for torch's wrong kernel: its first call is checked against the chunked
    backend, the right answer comes back, and later calls of its signature skip it."""
    monkeypatch.setattr(flex, "_verdicts", flex._Verdicts(seen={}))
    calls = []

    def wrong_kernel(req):
        calls.append(req.q_len)
        out = ak.attention(req.q, req.k, req.v, mask=req.mask, backend="reference")
        return out + 0.5, None

    monkeypatch.setattr(flex, "_run_compiled", wrong_kernel)
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Nq=40, Nk=40, D=8, dtype=torch.float32)
    want = ak.attention(q, k, v, mask=ak.causal(), backend="reference")
    assert_close(ak.attention(q, k, v, mask=ak.causal(), backend="flex"), want, torch.float32)
    note = ak.explain(q, k, v, mask=ak.causal(), backend="flex")
    assert "runs on the chunked backend instead" in note and "wrong numbers" in note and "0.5 off" in note
    q2, k2, v2 = qkv(B=2, Hq=2, Hkv=2, Nq=45, Nk=45, D=8, dtype=torch.float32, seed=1)  # same bucket
    assert_close(
        ak.attention(q2, k2, v2, mask=ak.causal(), backend="flex"),
        ak.attention(q2, k2, v2, mask=ak.causal(), backend="reference"),
        torch.float32,
    )
    assert calls == [40]
    # another signature is checked on its own first call, and trusted when right
    monkeypatch.setattr(flex, "_run_compiled", lambda req: (ak.attention(req.q, req.k, req.v, backend="reference"), None))
    ak.attention(q, k, v, backend="flex")
    assert flex.flex_reroute(make_request(q, k, v)) is None


def test_past_the_kernel_limit_calls_run_on_the_chunked_backend(monkeypatch):
    monkeypatch.setattr(flex, "_verdicts", flex._Verdicts(seen={}))

    def limit_hit(req):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit reached")

    monkeypatch.setattr(flex, "_run_compiled", limit_hit)
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=16, dtype=torch.float32)
    assert_close(ak.attention(q, k, v, backend="flex"), ak.attention(q, k, v, backend="reference"), torch.float32)
    note = ak.explain(q, k, v, backend="flex")
    assert f"{flex.MAX_KERNELS} compiled flex kernels already" in note and "unfused O(N^2)" in note
