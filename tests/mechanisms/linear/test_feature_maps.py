"""Feature maps against their definitions and the properties their papers state."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnkit.mechanisms.linear import (
    DPFP,
    FEATURE_MAPS,
    CosReweight,
    EluPlusOne,
    FAVORPlus,
    Identity,
    L2Norm,
    ReLU,
    SiLU,
    SumNorm,
    Taylor2,
    feature_map,
)
from attnkit.mechanisms.linear.feature_maps import orthogonal_gaussian
from helpers import assert_close


def x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_pointwise_maps():
    t = x(3, 5, 4)
    assert_close(Identity()(t), t)
    assert_close(EluPlusOne()(t), torch.where(t > 0, t + 1, torch.exp(t)))
    assert_close(ReLU()(t), t.clamp_min(0))
    assert_close(SiLU()(t), t / (1 + torch.exp(-t)))
    assert bool((EluPlusOne()(t) > 0).all())


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_is_the_papers_products(nu):
    """φ_{iν}(x) = r_j r_{(j - i) mod 2d} over j = 1..2d, i = 1..ν, r = [relu(x), relu(-x)] (eq. 28)."""
    t = x(2, 3, 4)
    d = t.shape[-1]
    r = torch.cat([t.clamp_min(0), (-t).clamp_min(0)], dim=-1)
    expected = torch.stack([r[..., j] * r[..., (j - i) % (2 * d)] for i in range(1, nu + 1) for j in range(2 * d)], dim=-1)
    assert DPFP(nu).out_dim(d) == 2 * d * nu
    assert_close(DPFP(nu)(t), expected)


def test_taylor2_dot_product_is_the_second_order_expansion_of_exp():
    a, b = x(6, 5), x(6, 5, seed=1)
    dot = (a * b).sum(-1)
    phi = Taylor2()
    assert phi.out_dim(5) == 1 + 5 + 25
    assert_close((phi(a) * phi(b)).sum(-1), 1 + dot + dot**2 / 2)


def test_favor_projection_is_blocks_of_orthogonal_rows():
    d = 6
    w = orthogonal_gaussian(15, d, seed=3)
    for block in (w[:6], w[6:12], w[12:]):
        gram = block @ block.T
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert_close(off_diagonal, torch.zeros_like(off_diagonal))
    assert not torch.allclose(w[0].norm(), w[1].norm())  # norms of Gaussian vectors, not constant


def test_favor_is_an_unbiased_estimate_of_exp():
    """E[φ(a)·φ(b)] = exp(a·b) (Performer, Lemma 1): the sample mean over m features lies
    within 5 standard errors of exp(a·b)."""
    d, m = 4, 40000
    a, b = 0.4 * x(d, seed=4), 0.4 * x(d, seed=5)
    phi = FAVORPlus(num_features=m, seed=11)
    terms = phi(a[None])[0] * phi(b[None])[0] * m  # m per-feature estimates of exp(a·b)
    standard_error = terms.std() / math.sqrt(m)
    assert abs(terms.mean() - math.exp(float(a @ b))) < 5 * standard_error
    assert standard_error < 0.02  # the estimate is informative, not just loose


def test_favor_rescaled_rows_are_positive_multiples():
    t = 3 * x(4, 7, 8)
    phi = FAVORPlus(seed=2)
    plain, rescaled = phi(t), phi(t, rescale_rows=True)
    ratio = rescaled / plain
    assert_close(ratio, ratio[..., :1].expand_as(ratio))
    assert bool((rescaled <= 1 / math.sqrt(phi.features(8)) + 1e-12).all())  # exp(<= 0) / √m: no overflow
    assert phi.features(8) == int(8 * math.log(8))


def test_favor_seed_and_redraw():
    t = x(3, 8)
    a, b = FAVORPlus(seed=1), FAVORPlus(seed=1)
    assert_close(a(t), b(t))
    b.redraw()
    assert not torch.allclose(a(t), b(t))


def test_cosformer_reweights_by_cosine_of_distance():
    """φ(q_i)·φ(k_j) = relu(q_i)·relu(k_j) · cos(π/2 · (i - j)/M) (cosFormer eq. 9)."""
    M, n = 20, 7
    q, k = x(n, 3), x(n, 3, seed=1)
    phi = CosReweight(M)
    fq, fk = phi(q, start=5), phi(k, start=5)
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    expected = (q.clamp_min(0) @ k.clamp_min(0).T) * torch.cos(math.pi / 2 * (i - j).double() / M)
    assert_close(fq @ fk.T, expected)


def test_cosformer_horizon():
    assert CosReweight().for_call(9, stateful=False).max_len == 9
    with pytest.raises(ValueError, match="max_len"):
        CosReweight().for_call(9, stateful=True)
    with pytest.raises(ValueError, match="max_len"):
        CosReweight(8).for_call(9, stateful=False)
    with pytest.raises(ValueError, match="max_len"):
        CosReweight(0)


def test_normalising_wrappers():
    t = x(4, 6)
    unit = L2Norm(SiLU())(t)
    assert_close(unit.norm(dim=-1), F.silu(t).norm(dim=-1) / torch.sqrt(F.silu(t).square().sum(-1) + 1e-6))
    summed = SumNorm(DPFP(2))(t)
    assert_close(summed.sum(-1), torch.ones(4, dtype=torch.float64))
    zero = SumNorm(DPFP(1))(torch.zeros(2, 3, dtype=torch.float64))
    assert bool(torch.isfinite(zero).all()) and bool((zero == 0).all())


def test_named_maps_and_errors():
    for name in FEATURE_MAPS:
        phi = feature_map(name).for_call(2, stateful=False)
        assert phi(x(2, 4), 0).shape[-1] == phi.out_dim(4)
    with pytest.raises(ValueError, match="feature_map"):
        feature_map("softmax")
    with pytest.raises(ValueError, match="nu"):
        DPFP(0)
    with pytest.raises(ValueError, match="num_features"):
        FAVORPlus(num_features=0)
