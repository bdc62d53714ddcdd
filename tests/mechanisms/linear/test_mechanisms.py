"""The named mechanisms through attnkit.attention: their papers' dense formulas, argument
validation, dtypes, empty calls, and the weights shown to observers."""

import math

import pytest
import torch
import torch.nn.functional as F
from linear_cases import Recorder, dense_weights, qkv

import attnkit as ak
from attnkit.mechanisms import available, get_mechanism
from attnkit.mechanisms.linear import NAMED, LinearAttention, LinearState
from helpers import assert_close


def causal_matrix(n, m=None):
    m = n if m is None else m
    return torch.ones(n, m, dtype=torch.bool).tril(m - n)


def test_every_named_mechanism_is_registered_and_recurrent():
    for name in NAMED:
        assert name in available()
        mech = get_mechanism(name)
        assert mech.name == name and mech.recurrent and mech.paper.startswith("arXiv:")


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_by_name_matches_reference(name, causal):
    """A fresh instance per call (zero-initialised gate outputs, seeded FAVOR+) gives the
    same answer as another instance's reference."""
    q, k, v = qkv(2, 4, 2, 40, 40, 8, 5)
    mask = ak.causal() if causal else None
    out = ak.attention(q, k, v, mechanism=name, mask=mask)
    assert out.shape == (2, 4, 40, 5) and out.dtype == torch.float64
    assert_close(out, get_mechanism(name).reference(q, k, v, mask=mask))


def dense_normalised(phi_q, phi_k, v, mask, eps=1e-6):
    a = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~mask, 0)
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_katharopoulos_formula(causal):
    """Transformers are RNNs, eq. 6: V'_i = Σ_j φ(Q_i)ᵀφ(K_j) V_j / Σ_j φ(Q_i)ᵀφ(K_j)."""
    q, k, v = qkv(1, 2, 2, 12, 12, 4, 3)
    mask = causal_matrix(12) if causal else torch.ones(12, 12, dtype=torch.bool)
    expected = dense_normalised(F.elu(q) + 1, F.elu(k) + 1, v, mask)
    assert_close(ak.attention(q, k, v, mechanism="linear_elu", mask=ak.causal() if causal else None), expected)


def test_cosformer_formula():
    """cosFormer eq. 9 with M = sequence length: weights relu(q)·relu(k)·cos(π/2·(i-j)/M), normalised."""
    n = 12
    q, k, v = qkv(1, 2, 2, n, n, 4, 3)
    i = torch.arange(n).view(-1, 1).double()
    j = torch.arange(n).view(1, -1).double()
    a = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * torch.cos(math.pi / 2 * (i - j) / n)
    a = a.masked_fill(~causal_matrix(n), 0)
    assert_close(ak.attention(q, k, v, mechanism="cosformer", mask=ak.causal()), (a @ v) / (a.sum(-1, keepdim=True) + 1e-6))


def softmax_attention(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_based_is_softmax_for_small_logits():
    """1 + s + s²/2 = exp(s) - O(s³): with |scale·q·k| <= 0.1 Based is softmax attention to ~2e-4."""
    q, k, v = qkv(1, 2, 2, 16, 16, 4, 3)
    q, k = 0.15 * q, 0.15 * k
    assert float((q @ k.transpose(-1, -2)).abs().max()) / 2 < 0.1
    out = ak.attention(q, k, v, mechanism="based", mask=ak.causal())
    torch.testing.assert_close(out, softmax_attention(q, k, v, True), atol=2e-3, rtol=0)


def test_performer_approximates_softmax():
    """FAVOR+ with many features is close to softmax attention and far closer than
    elu+1 linear attention on the same inputs (Performer, Sec. 4). Logits of moderate
    size: the estimator's variance grows like exp(|q|² + |k|²)."""
    q, k, v = qkv(1, 2, 2, 32, 32, 8, 4)
    q, k = 0.5 * q, 0.5 * k
    exact = softmax_attention(q, k, v, False)
    performer = get_mechanism("performer", feature_map=ak_favor(4096))
    err = (performer(q, k, v) - exact).abs().mean()
    assert err < 0.02
    assert err < 0.25 * (ak.attention(q, k, v, mechanism="linear_elu") - exact).abs().mean()


def ak_favor(m):
    from attnkit.mechanisms.linear import FAVORPlus

    return FAVORPlus(num_features=m, seed=0)


def test_fast_weight_is_the_delta_rule_on_sum_normalised_dpfp():
    q, k, v = qkv(1, 2, 2, 10, 10, 3, 3)
    beta = torch.sigmoid(torch.randn(1, 2, 10, dtype=torch.float64))
    mech = get_mechanism("fast_weight")

    def phi(t):  # DPFP-1: r ⊙ roll(r, 1), r = [relu(t), relu(-t)]
        r = torch.cat([F.relu(t), F.relu(-t)], -1)
        return r * r.roll(1, dims=-1)

    fk, fq = phi(k), phi(q)
    fk, fq = fk / fk.sum(-1, keepdim=True).clamp_min(1e-6), fq / fq.sum(-1, keepdim=True).clamp_min(1e-6)  # all-zero rows stay 0
    S = torch.zeros(1, 2, 6, 3, dtype=torch.float64)
    outs = []
    for t in range(10):  # Schlag et al. 2021, eq. 23-25
        v_bar = torch.einsum("bhfv,bhf->bhv", S, fk[:, :, t])
        S = S + beta[:, :, t, None, None] * torch.einsum("bhf,bhv->bhfv", fk[:, :, t], v[:, :, t] - v_bar)
        outs.append(torch.einsum("bhfv,bhf->bhv", S, fq[:, :, t]) / math.sqrt(3))
    assert_close(mech(q, k, v, mask=ak.causal(), beta=beta), torch.stack(outs, 2))


@pytest.mark.parametrize(
    "mask", [ak.window(4), ak.causal() & ak.window(4), ak.document(torch.zeros(8, dtype=torch.long)), lambda b, h, q, k: k <= q]
)
def test_other_masks_are_refused(mask):
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 3)
    with pytest.raises(ValueError, match="mask"):
        ak.attention(q, k, v, mechanism="gla", mask=mask)


def test_unsupported_arguments_are_refused():
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 3)
    with pytest.raises(ValueError, match="score"):
        ak.attention(q, k, v, mechanism="retnet", score=ak.softcap(5.0))
    with pytest.raises(ValueError, match="sinks"):
        ak.attention(q, k, v, mechanism="retnet", sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="return_lse"):
        ak.attention(q, k, v, mechanism="retnet", return_lse=True)
    with pytest.raises(ValueError, match="backend"):
        ak.attention(q, k, v, mechanism="retnet", backend="sdpa")
    with pytest.raises(ValueError, match="q: causal linear attention needs Nq <= Nk"):
        ak.attention(q, k[:, :, :4], v[:, :, :4], mechanism="retnet", mask=ak.causal())
    with pytest.raises(ValueError, match="v:"):
        ak.attention(q, k, v[:, :, :5], mechanism="retnet")
    with pytest.raises(ValueError, match="q: with short_conv"):
        get_mechanism("based", short_conv=2)(q[:, :, :4], k, v, mask=ak.causal())
    with pytest.raises(ValueError, match="scale"):
        ak.attention(q, k, v, mechanism="based", scale=-1.0)
    with pytest.raises(ValueError, match="rule"):
        LinearAttention(rule="hebbian")


def test_non_finite_inputs_are_named():
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 3)
    v = v.clone()
    v[0, 1, 3, 0] = math.nan
    with pytest.raises(ValueError, match="v: contains NaN"):
        ak.attention(q, k, v, mechanism="linear_elu", mask=ak.causal())
    out = ak.attention(q, k, v, mechanism="linear_elu", mask=ak.causal(), check_finite=False)
    assert torch.isnan(out).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtype_follows_the_inputs(dtype):
    q, k, v = qkv(1, 2, 2, 20, 20, 8, 8, dtype=dtype)
    for name in ("gla", "deltanet", "performer"):
        out = ak.attention(q, k, v, mechanism=name, mask=ak.causal())
        assert out.dtype == dtype
        ref = get_mechanism(name).reference(q.double(), k.double(), v.double(), mask=ak.causal())
        assert_close(out, ref, dtype=dtype)


def test_scale_multiplies_the_readout():
    q, k, v = qkv(1, 2, 2, 10, 10, 4, 3)
    base = ak.attention(q, k, v, mechanism="gla", mask=ak.causal(), scale=1.0)
    assert_close(ak.attention(q, k, v, mechanism="gla", mask=ak.causal(), scale=0.25), 0.25 * base)


def test_empty_calls():
    mech = get_mechanism("linear_elu")
    q, k, v = qkv(1, 2, 2, 0, 0, 4, 3)
    out, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    assert out.shape == (1, 2, 0, 3) and state.position == 0
    memory, z = torch.randn(1, 2, 4, 3, dtype=torch.float64), torch.rand(1, 2, 4, dtype=torch.float64) + 1
    q1 = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    out = mech(q1, k, v, initial_state=LinearState(memory, z, 5))  # non-causal: read the state
    phi = F.elu(q1) + 1
    assert_close(out, (phi @ memory) / ((phi * z.unsqueeze(-2)).sum(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("name", ["linear_elu", "retnet", "gla", "deltanet", "gated_deltanet", "performer"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_observers_see_the_weights_that_make_the_output(name, causal, monkeypatch):
    """Σ_j W_ij v_j reproduces the output; tiles cover each visible pair exactly once."""
    from attnkit.mechanisms.linear import observe

    monkeypatch.setattr(observe, "OBSERVE_K_BLOCK", 16)  # several key blocks and query blocks
    monkeypatch.setattr(observe, "OBSERVE_Q_BLOCK", 8)
    B, H, Nq, Nk = 1, 2, 30, 37
    q, k, v = qkv(B, H, H, Nq, Nk, 4, 3)
    rec = Recorder()
    mask = ak.causal() if causal else None
    out = ak.attention(q, k, v, mechanism=name, mask=mask, observers=[rec], layer=3)
    call = rec.calls[0]
    assert (call.mechanism, call.layer, call.q_len, call.k_len, call.q_start) == (name, 3, Nq, Nk, Nk - Nq)
    w, seen = dense_weights(rec, B, H, Nq, Nk)
    assert_close(w @ v, out)
    visible = causal_matrix(Nq, Nk) if causal else torch.ones(Nq, Nk, dtype=torch.bool)
    assert bool((seen[visible] == 1).all()) and bool((w[..., ~visible] == 0).all())
    assert all(t.scores is None for t in rec.tiles)
