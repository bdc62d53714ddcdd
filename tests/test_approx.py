"""approx_error: relative output error and attention-mass recall against dense definitions."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention, reference_probabilities
from attnkit.mechanisms import Mechanism, get_mechanism
from helpers import qkv


def literal(approx, q, k, v, mask, support):
    """Relative error and recall computed densely: exact P from the reference backend,
    ``support`` (B, H, Nq, Nk) the pairs the method uses."""
    req = make_request(q, k, v, mask=mask)
    exact, _ = reference_attention(req, torch.float64)
    p = reference_probabilities(req)
    err = float((approx.double() - exact).norm() / exact.norm())
    per_head = ((approx.double() - exact).pow(2).sum((0, 2, 3)) / exact.pow(2).sum((0, 2, 3))).sqrt()
    mass = (p * support).sum(-1)
    return err, per_head, float(mass.mean()), mass.mean((0, 2))


def test_softmax_is_exact():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=40, Nk=60, D=8)
    res = ak.approx_error(q, k, v, mechanism="softmax", mask=ak.causal())
    assert res.relative_error == 0.0
    assert math.isclose(res.mass_recall, 1.0, abs_tol=1e-12)
    assert torch.allclose(res.per_head_recall, torch.ones(4, dtype=torch.float64), atol=1e-12)


def test_neighborhood_error_and_recall_match_dense_definitions():
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Nq=48, Nk=48, D=8)
    mech = get_mechanism("neighborhood", kernel=(3, 5), grid=(6, 8))
    res = ak.approx_error(q, k, v, mechanism=mech)
    support = ak.neighborhood_2d((6, 8), (3, 5)).dense(2, 2, 48, 48)
    err, per_head, recall, per_head_recall = literal(mech(q, k, v), q, k, v, None, support)
    assert math.isclose(res.relative_error, err, rel_tol=1e-9)
    assert torch.allclose(res.per_head_error, per_head, rtol=1e-9)
    assert math.isclose(res.mass_recall, recall, rel_tol=1e-9)
    assert torch.allclose(res.per_head_recall, per_head_recall, rtol=1e-9)
    full = ak.approx_error(q, k, v, mechanism="neighborhood", kernel=(6, 8), grid=(6, 8))
    assert full.relative_error < 1e-12 and math.isclose(full.mass_recall, 1.0, abs_tol=1e-12)


def test_block_sparse_recall_is_exact_mass_inside_the_pattern():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Nq=64, Nk=96, D=8)
    mech = get_mechanism("block_sparse", block_size=8, last_q=8, vertical_size=6, slash_size=5, sink_tokens=2, local_tokens=3)
    res = ak.approx_error(q, k, v, mechanism=mech, mask=ak.causal())
    blocks, _ = mech.estimate(q, k, 8**-0.5)
    pos, key = torch.arange(64) + 32, torch.arange(96)
    support = blocks[:, :, pos // 8][..., key // 8] & (key <= pos[:, None])
    err, _, recall, _ = literal(mech(q, k, v, mask=ak.causal()), q, k, v, ak.causal(), support)
    assert math.isclose(res.relative_error, err, rel_tol=1e-9)
    assert math.isclose(res.mass_recall, recall, rel_tol=1e-9)
    assert res.mass_recall < 1


def test_hyper_attention_recall_counts_blocks_and_samples():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=80, Nk=80, D=8)
    mech = get_mechanism("hyper_attention", block_size=16, sample_size=10, min_seq_len=16, lsh_num_projs=3)
    res = ak.approx_error(q, k, v, mechanism=mech)
    w = mech.weights(mech.plan(q, k, False), 1, 2, 80, 80, torch.float64)
    err, _, recall, _ = literal(mech(q, k, v), q, k, v, None, w > 0)
    assert math.isclose(res.relative_error, err, rel_tol=1e-9)
    assert math.isclose(res.mass_recall, recall, rel_tol=1e-9)


def test_float32_inputs():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=64, Nk=64, D=8, dtype=torch.float32)
    res = ak.approx_error(
        q, k, v, mechanism="nsa", mask=ak.causal(), compress_block=8, compress_stride=8, select_block=8, num_selected=3, window=8
    )
    assert 0 < res.relative_error < math.inf and 0 < res.mass_recall <= 1 + 1e-5


class Unobserved(Mechanism):
    """A mechanism that shows its observers nothing: half of softmax attention."""

    name = "unobserved"

    def forward(self, q, k, v, **call):
        return 0.5 * ak.attention(q, k, v, mask=call.get("mask"))


def test_mechanism_without_weights_has_no_recall():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=4)
    res = ak.approx_error(q, k, v, mechanism=Unobserved())
    assert res.mass_recall is None and res.per_head_recall is None
    assert math.isclose(res.relative_error, 0.5, rel_tol=1e-12)


def test_bad_mechanism():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=4)
    with pytest.raises(ValueError, match="mechanism"):
        ak.approx_error(q, k, v, mechanism="no_such_method")
    with pytest.raises(ValueError, match="mechanism"):
        ak.approx_error(q, k, v, mechanism=get_mechanism("softmax"), block_size=3)
