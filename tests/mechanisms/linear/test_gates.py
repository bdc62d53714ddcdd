"""Decays and β: edge values (→0, →1) against closed forms, the papers' fixed and learned
gates, explicit tensors overriding them, and validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from linear_cases import qkv

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.linear import LinearAttention, LinearState
from attnkit.mechanisms.linear.gates import lightning_log_decays, retnet_log_decays
from attnkit.mods import alibi_slopes
from helpers import assert_close

FORMS = ["reference", "parallel", "chunked", "recurrent"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", ["scalar", "diag"])
@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_gate_one_is_no_decay(form, shape, rule):
    mech = LinearAttention("silu+l2", rule=rule, chunk_size=4)
    q, k, v = qkv(1, 2, 2, 11, 11, 4, 3)
    g = torch.zeros(1, 2, 11) if shape == "scalar" else torch.zeros(1, 2, 11, 4)
    beta = torch.full((1, 2, 11), 0.7, dtype=torch.float64) if rule == "delta" else None
    plain = mech(q, k, v, mask=ak.causal(), backend="reference", beta=beta)
    assert_close(mech(q, k, v, mask=ak.causal(), backend=form, g=g.double(), beta=beta), plain)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", ["scalar", "diag"])
@pytest.mark.parametrize("rule", ["sum", "delta"])
def test_gate_near_zero_forgets_everything_before(form, shape, rule):
    """α = e^-800 (0 in float64): o_t = scale · β_t (φ(q_t)·φ(k_t)) v_t, from any initial state."""
    mech = LinearAttention("elu+1", rule=rule, chunk_size=4)
    B, H, N, D = 1, 2, 9, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    g = torch.full((B, H, N) if shape == "scalar" else (B, H, N, D), -800.0, dtype=torch.float64)
    beta = torch.rand(B, H, N, dtype=torch.float64) if rule == "delta" else torch.ones(B, H, N, dtype=torch.float64)
    state = LinearState(torch.randn(B, H, D, 3, dtype=torch.float64), position=3)
    out = mech(q, k, v, mask=ak.causal(), backend=form, g=g, beta=beta if rule == "delta" else None, initial_state=state)
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    expected = (phi_q * phi_k).sum(-1, keepdim=True) * beta.unsqueeze(-1) * v / math.sqrt(D)
    assert_close(out, expected)


@pytest.mark.parametrize("form", FORMS)
def test_beta_zero_leaves_the_state_unchanged(form):
    mech = LinearAttention("silu+l2", rule="delta", chunk_size=4)
    B, H, N, D = 1, 2, 10, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    memory = torch.randn(B, H, D, 3, dtype=torch.float64)
    out, state = mech(
        q,
        k,
        v,
        mask=ak.causal(),
        backend=form,
        beta=torch.zeros(B, H, N, dtype=torch.float64),
        initial_state=LinearState(memory),
        return_state=True,
    )
    phi_q = F.silu(q) * torch.rsqrt(F.silu(q).square().sum(-1, keepdim=True) + 1e-6)  # L2Norm(SiLU), eps 1e-6
    assert_close(out, phi_q @ memory / math.sqrt(D))
    assert_close(state.memory, memory)


@pytest.mark.parametrize("form", FORMS)
def test_delta_rule_with_beta_one_overwrites_a_key(form):
    """With unit keys and β = 1 the delta rule replaces the value stored under a key
    (Schlag et al. 2021, Sec. 4.2): write (k, v1), then (k, v2); reading k returns v2."""
    mech = LinearAttention("identity", rule="delta", chunk_size=2)
    key = F.normalize(torch.randn(1, 1, 1, 4, dtype=torch.float64), dim=-1)
    k = key.expand(1, 1, 3, 4)
    v = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    q = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    _, state = mech(q, k, v, mask=ak.causal(), backend=form, beta=torch.ones(1, 1, 3, dtype=torch.float64), return_state=True)
    assert_close(key[0, 0, 0] @ state.memory[0, 0], v[0, 0, 2])


def test_retnet_and_lightning_decays_are_the_papers():
    for h in range(8):
        assert math.isclose(math.exp(float(retnet_log_decays(8)[h])), 1 - 2 ** (-5 - h), rel_tol=1e-12)
    torch.testing.assert_close(lightning_log_decays(8), -alibi_slopes(8).double())


@pytest.mark.parametrize("name,log_decays", [("retnet", retnet_log_decays), ("lightning", lightning_log_decays)])
def test_fixed_decay_mechanisms_are_decayed_linear_attention(name, log_decays):
    """(QKᵀ ⊙ D) V · scale with D_ij = γ_h^(i-j), written densely (RetNet eq. 5)."""
    B, H, N, D = 1, 4, 10, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    gamma = torch.exp(log_decays(H)).view(1, H, 1, 1)
    i = torch.arange(N).view(-1, 1)
    j = torch.arange(N).view(1, -1)
    decay = torch.where(j <= i, gamma ** (i - j).clamp_min(0), torch.zeros(()))
    expected = ((q @ k.transpose(-1, -2)) * decay) @ v / math.sqrt(D)
    assert_close(ak.attention(q, k, v, mechanism=name, mask=ak.causal()), expected)


def test_gla_gate_formula_and_initial_value():
    mech = get_mechanism("gla").double()
    q, k, v = qkv(1, 2, 2, 6, 6, 4, 3)
    mech(q, k, v, mask=ak.causal())  # materialises the gate
    gate = mech.decay
    assert gate.down.shape == (2, 4, 16) and gate.up.shape == (2, 16, 4) and gate.bias.shape == (2, 4)
    g = gate(k, 2, 4)
    assert_close(g, torch.full_like(g, F.logsigmoid(torch.tensor(0.0, dtype=torch.float64)).item() / 16))
    with torch.no_grad():
        gate.up.normal_()
        gate.bias.normal_()
    expected = F.logsigmoid(torch.einsum("bhnd,hdr,hrf->bhnf", k, gate.down, gate.up) + gate.bias[:, None]) / 16
    assert_close(gate(k, 2, 4), expected)


def test_gated_deltanet_gates_and_beta_formulas():
    mech = get_mechanism("gated_deltanet", heads=4, head_dim=8).double()
    gate, beta_gate = mech.decay, mech.beta
    quantile = (torch.arange(4, dtype=torch.float64) + 0.5) / 4
    a = 1 + 15 * quantile  # quantiles of Mamba-2's A ~ U[1, 16]
    dt = torch.exp(math.log(1e-3) + quantile * math.log(100))  # of Δt ~ logU[1e-3, 1e-1]
    assert_close(gate.A_log, torch.log(a), dtype=torch.float32)  # stored as float32 parameters
    assert_close(F.softplus(gate.dt_bias), dt, dtype=torch.float32)
    k = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        gate.weight.normal_()
        beta_gate.weight.normal_()
    expected = -torch.exp(gate.A_log)[:, None] * F.softplus(
        torch.einsum("bhnd,hd->bhn", k, gate.weight[..., 0]) + gate.dt_bias[:, None]
    )
    assert_close(gate(k, 4, 8), expected)
    assert_close(beta_gate(k, 4, 8), torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, beta_gate.weight[..., 0])))


def test_learned_beta_starts_at_one_half():
    mech = get_mechanism("deltanet").double()
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 3)
    half = torch.full((1, 2, 8), 0.5, dtype=torch.float64)
    assert_close(mech(q, k, v, mask=ak.causal()), mech(q, k, v, mask=ak.causal(), beta=half))


@pytest.mark.parametrize("name,params", [("gla", ["down", "up", "bias"]), ("gated_deltanet", ["weight", "A_log", "dt_bias"])])
def test_learnable_gates_get_gradients(name, params):
    mech = get_mechanism(name).double()
    q, k, v = qkv(1, 4, 2, 12, 12, 4, 3)  # GQA: gates per kv head, shared by two query heads
    with torch.no_grad():
        mech(q, k, v, mask=ak.causal())
        for p in mech.parameters():
            p.add_(0.1 * torch.randn_like(p))  # off the zero init, so every weight matters
    mech(q, k, v, mask=ak.causal()).square().sum().backward()
    for p in params:
        grad = getattr(mech.decay, p).grad
        assert grad is not None and grad.abs().sum() > 0, p


def test_explicit_gates_override_and_may_be_per_query_head():
    mech = get_mechanism("gla").double()
    q, k, v = qkv(1, 4, 2, 8, 8, 4, 3)
    g_kv = F.logsigmoid(torch.randn(1, 2, 8, 4, dtype=torch.float64))
    per_query = g_kv.repeat_interleave(2, dim=1)
    a = mech(q, k, v, mask=ak.causal(), g=g_kv)
    assert_close(a, mech(q, k, v, mask=ak.causal(), g=per_query))
    assert_close(a, LinearAttention()(q, k, v, mask=ak.causal(), g=g_kv))


def test_lazy_parameters_and_state_dict_round_trip():
    mech = get_mechanism("gated_deltanet")
    assert any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in mech.parameters())
    q, k, v = qkv(1, 2, 2, 8, 8, 4, 3, dtype=torch.float32)
    with torch.no_grad():
        mech(q, k, v, mask=ak.causal())
        for p in mech.parameters():
            p.add_(torch.randn_like(p))
    fresh = get_mechanism("gated_deltanet")
    fresh.load_state_dict(mech.state_dict())
    assert_close(fresh(q, k, v, mask=ak.causal()), mech(q, k, v, mask=ak.causal()))
    eager = get_mechanism("gated_deltanet", heads=2, head_dim=4, short_conv=3)
    assert not any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in eager.parameters())


def test_bad_gates_are_refused():
    mech = LinearAttention(chunk_size=4)
    q, k, v = qkv(1, 2, 2, 6, 6, 4, 3)
    with pytest.raises(ValueError, match="g: log-gates must be finite and <= 0"):
        mech(q, k, v, mask=ak.causal(), g=torch.full((1, 2, 6), 0.1, dtype=torch.float64))
    with pytest.raises(ValueError, match="g: log-gates must be finite"):
        mech(q, k, v, mask=ak.causal(), g=torch.full((1, 2, 6), -math.inf, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"g: expected a float tensor of shape \(B, H, Nk\) = \(1, 2, 6\)"):
        mech(q, k, v, mask=ak.causal(), g=torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="D_f = 4"):
        mech(q, k, v, mask=ak.causal(), g=torch.zeros(1, 2, 6, 3))
    with pytest.raises(ValueError, match="beta: only the delta rule"):
        mech(q, k, v, mask=ak.causal(), beta=torch.ones(1, 2, 6))
    delta = LinearAttention(rule="delta")
    with pytest.raises(ValueError, match="beta: expected a float tensor of shape"):
        delta(q, k, v, mask=ak.causal(), beta=torch.ones(1, 3, 6))
    with pytest.raises(ValueError, match="beta: contains NaN"):
        delta(q, k, v, mask=ak.causal(), beta=torch.full((1, 2, 6), math.nan))
    with pytest.raises(ValueError, match="decay"):
        LinearAttention(decay="bogus")
    with pytest.raises(ValueError, match="beta: only the delta rule"):
        LinearAttention(beta="learned")
