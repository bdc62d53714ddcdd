"""HyperAttention: sortLSH order, the plan's coverage, fast path against the dense
estimator, exactness where the method is exact, the sampling estimator, determinism."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.hyper_attention import ExactPart, HyperPart, gray_rank
from attnkit.observe import Observer
from helpers import assert_close, qkv

SMALL = dict(block_size=16, sample_size=12, min_seq_len=32, lsh_num_projs=4)


def exact(q, k, v, mask=None):
    return reference_attention(make_request(q, k, v, mask=mask), torch.float64)


@pytest.mark.parametrize("bits", [1, 3, 7])
def test_gray_rank_orders_buckets_one_bit_apart(bits):
    codes = torch.arange(2**bits)
    rank = gray_rank(codes, bits)
    assert torch.equal(torch.sort(rank).values, codes)  # a bijection
    in_order = torch.argsort(rank)
    flips = in_order[1:] ^ in_order[:-1]
    assert all(bin(int(f)).count("1") == 1 for f in flips)  # the paper's Hamming-sorted buckets


@pytest.mark.parametrize(
    "causal,Nq,Nk", [(False, 100, 100), (False, 70, 130), (True, 150, 150), (True, 90, 170), (True, 170, 90)]
)
def test_plan_covers_every_visible_pair_once(causal, Nq, Nk):
    q, k, _ = qkv(B=1, Hq=2, Hkv=1, Nq=Nq, Nk=Nk, D=8)
    parts = get_mechanism("hyper_attention", **SMALL).plan(q, k, causal)
    count = torch.zeros(Nq, Nk, dtype=torch.long)
    for p in parts:
        cover = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.long)
        if isinstance(p, ExactPart) and p.causal:
            cover = torch.tril(cover)
        count[p.q0 : p.q1, p.k0 : p.k1] += cover
    visible = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        visible = torch.arange(Nk) <= torch.arange(Nq).view(-1, 1) + Nk - Nq
    assert torch.equal(count, visible.long())
    assert any(isinstance(p, HyperPart) for p in parts)


@pytest.mark.parametrize(
    "causal,Nq,Nk,Dv", [(False, 100, 100, 8), (False, 70, 130, 5), (True, 150, 150, 8), (True, 90, 170, 8), (True, 170, 90, 6)]
)
def test_fast_path_matches_dense_estimator(causal, Nq, Nk, Dv):
    q, k, v = qkv(B=2, Hq=6, Hkv=2, Nq=Nq, Nk=Nk, D=8, Dv=Dv)
    mech = get_mechanism("hyper_attention", **SMALL, seed=3)
    mask = ak.causal() if causal else None
    out, lse = mech(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = mech.reference(q, k, v, mask=mask, return_lse=True)
    assert_close(out, ref)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    assert_close(lse[torch.isfinite(lse)], ref_lse[torch.isfinite(ref_lse)])


def test_dense_estimator_is_the_papers_formula():
    """W_ij = 1 in i's block; count_j * n / m for sampled keys elsewhere (literal loops)."""
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Nq=40, Nk=40, D=4)
    mech = get_mechanism("hyper_attention", block_size=10, sample_size=7, min_seq_len=8, lsh_num_projs=3)
    (part,) = mech.plan(q, k, causal=False)
    q_rank = torch.argsort(part.q_order[0, 0]).tolist()
    k_rank = torch.argsort(part.k_order[0, 0]).tolist()
    drawn = part.samples[0, 0].tolist()
    out = torch.zeros(40, 4, dtype=torch.float64)
    for i in range(40):
        num, den = torch.zeros(4, dtype=torch.float64), 0.0
        for j in range(40):
            same = q_rank[i] // part.q_block_size == k_rank[j] // 10
            w = 1.0 if same else drawn.count(j) * 40 / 7
            a = math.exp(float(q[0, 0, i] @ k[0, 0, j]) / 2) * w
            num, den = num + a * v[0, 0, j], den + a
        out[i] = num / den
    assert_close(mech.reference(q, k, v)[0, 0], out)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_dense_estimator(causal):
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=120, Nk=120, D=8, requires_grad=True)
    mech = get_mechanism("hyper_attention", **SMALL)
    mask = ak.causal() if causal else None
    g = torch.Generator().manual_seed(2)
    go, gl = torch.randn(1, 4, 120, 8, generator=g, dtype=torch.float64), torch.randn(1, 4, 120, generator=g, dtype=torch.float64)

    def grads(fn):
        out, lse = fn(q, k, v, mask=mask, return_lse=True)
        return torch.autograd.grad((out * go).sum() + (lse * gl).sum(), (q, k, v))

    for got, want in zip(grads(mech), grads(mech.reference)):
        assert_close(got, want)


def test_gradcheck():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=20, Nk=20, D=3, requires_grad=True)
    mech = get_mechanism("hyper_attention", block_size=5, sample_size=4, min_seq_len=8, lsh_num_projs=2)
    assert torch.autograd.gradcheck(lambda a, b, c: mech(a, b, c, mask=ak.causal(), return_lse=True), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_below_min_seq_len_is_softmax(causal):
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=60, Nk=60, D=8)
    mask = ak.causal() if causal else None
    out, lse = get_mechanism("hyper_attention", min_seq_len=61)(q, k, v, mask=mask, return_lse=True)
    want, want_lse = exact(q, k, v, mask)
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_one_block_is_softmax():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=80, Nk=80, D=8)
    out = get_mechanism("hyper_attention", block_size=80, sample_size=16, min_seq_len=16)(q, k, v)
    assert_close(out, exact(q, k, v)[0])


def test_residual_samples_estimate_the_rest_of_the_row():
    """Uniform samples weighted n/m estimate the normaliser outside the query's block:
    with many samples the row's lse approaches the exact one (estimator consistency)."""
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Nq=64, Nk=64, D=4)
    mech = get_mechanism("hyper_attention", block_size=32, sample_size=200_000, min_seq_len=16)
    _, lse = mech(q, k, v, return_lse=True)
    _, want = exact(q, k, v)
    assert torch.allclose(lse, want, atol=2e-2)
    no_samples = get_mechanism("hyper_attention", block_size=32, sample_size=0, min_seq_len=16)
    _, lse_blocks = no_samples(q, k, v, return_lse=True)
    assert bool((lse_blocks < want - 0.05).all())  # blocks alone miss mass that the samples restore


def test_seeded_and_deterministic():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=100, Nk=100, D=8)
    a = get_mechanism("hyper_attention", **SMALL, seed=5)(q, k, v)
    b = get_mechanism("hyper_attention", **SMALL, seed=5)(q, k, v)
    c = get_mechanism("hyper_attention", **SMALL, seed=6)(q, k, v)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


class Collect(Observer):
    def begin(self, call):
        self.weights = torch.zeros(call.batch, call.heads, call.q_len, call.k_len, dtype=torch.float64)

    def update(self, tile):
        self.weights[:, :, tile.q_pos.view(-1, 1) - (tile.call.k_len - tile.call.q_len), tile.k_pos.view(1, -1)] += tile.weights


def test_observers_get_the_estimators_weights():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=90, Nk=150, D=8)
    mech = get_mechanism("hyper_attention", **SMALL)
    meter = Collect()
    out = mech(q, k, v, mask=ak.causal(), observers=[meter])
    assert_close(meter.weights.sum(-1), torch.ones(1, 2, 90, dtype=torch.float64))
    assert_close(torch.matmul(meter.weights, v.repeat_interleave(2, 1)), out)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size"),
        (dict(sample_size=-1), "sample_size"),
        (dict(min_seq_len=1), "min_seq_len"),
        (dict(lsh_num_projs=31), "lsh_num_projs"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_mechanism("hyper_attention", **kwargs)


def test_invalid_calls():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=4)
    mech = get_mechanism("hyper_attention")
    with pytest.raises(ValueError, match="mask"):
        mech(q, k, v, mask=ak.window(4))
    with pytest.raises(ValueError, match="score"):
        mech(q, k, v, score=ak.alibi(2))
    with pytest.raises(ValueError, match="backend"):
        mech(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="head dim"):
        mech(q, k[..., :3], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_within_tolerance_of_float64(dtype):
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=96, Nk=96, D=16)
    mech = get_mechanism("hyper_attention", **SMALL)
    got = mech(q.to(dtype), k.to(dtype), v.to(dtype), mask=ak.causal())
    # the plan is drawn from the rounded inputs: the reference uses the same ones
    want = mech.reference(*(t.to(dtype).double() for t in (q, k, v)), mask=ak.causal())
    assert got.dtype == dtype
    assert_close(got, want, dtype=dtype)
