"""Forgetting attention (FoX, arXiv 2503.02130) against its literal formula; gate gradients;
a constant gate is ALiBi."""

import math

import mechanism_contract as mc
import pytest
import torch

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.forgetting import Forgetting
from helpers import assert_close, qkv


def gates(shape, per_query_head=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = shape["Hq"] if per_query_head else shape["Hkv"]
    return {"log_forget": (-0.3 * torch.rand(shape["B"], heads, shape["Nk"], generator=g, dtype=torch.float64)).requires_grad_()}


@pytest.mark.parametrize("per_query_head", [True, False])
def test_matches_reference(per_query_head):
    mc.grid(Forgetting(), extra_fn=lambda shape: gates(shape, per_query_head), return_lse=True)


def test_multi_tile_and_sinks():
    shape = dict(B=1, Hq=4, Hkv=2, Nq=300, Nk=330, D=8)
    mc.matches_reference(Forgetting(), shape, ak.causal() & ak.window(90), ak.alibi(4), extra=gates(shape), return_lse=True)
    sinks = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64).requires_grad_()
    mc.matches_reference(
        Forgetting(), mc.SHAPES["gqa"], ak.causal(), extra={**gates(mc.SHAPES["gqa"]), "sinks": sinks}, return_lse=True
    )


def test_gradcheck():
    shape = dict(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=3, Dv=2)
    mc.gradchecks(Forgetting(), shape=shape, mask=ak.causal(), extra=gates(shape))


def test_learned_gates_low_precision_dead_rows_observers_empty():
    mech = Forgetting(num_heads=4).double()
    mc.matches_reference(mech, mc.SHAPES["gqa"], ak.causal(), ak.softcap(3.0))
    mc.low_precision(Forgetting(num_heads=4), mask=ak.causal())
    mc.dead_rows(Forgetting(num_heads=2))
    mc.observers(Forgetting(num_heads=4), mask=ak.causal())
    mc.empty_sequences(Forgetting(num_heads=2))
    mc.by_name("forgetting", Forgetting(num_heads=4), sinks_allowed=True)


def test_constant_gate_is_alibi():
    # log f = -slope at every position: Lambda_i - Lambda_j = -slope * (i - j), ALiBi's bias
    q, k, v = qkv(B=1, Hq=4, Hkv=4, Nq=20, Nk=20, D=8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    log_f = (-slopes).view(1, 4, 1).expand(1, 4, 20)
    out = Forgetting()(q, k, v, mask=ak.causal(), log_forget=log_f)
    ref, _ = reference_attention(make_request(q, k, v, mask=ak.causal(), score=ak.alibi(slopes=slopes)))
    assert_close(out, ref)
    assert_close(Forgetting()(q, k, v, mask=ak.causal(), forget=torch.exp(log_f)), ref)


def test_learned_gates_start_as_alibi():
    mech = Forgetting(num_heads=8)
    assert_close(-torch.nn.functional.logsigmoid(mech.gate_logit.double()), ak.mods.alibi_slopes(8).double(), dtype=torch.float32)


def test_rejects_bad_gates():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=4, Nk=4, D=4)
    with pytest.raises(ValueError, match="no forget gates"):
        Forgetting()(q, k, v)
    for bad in (torch.zeros(1, 2, 4), torch.full((1, 2, 4), 1.5), torch.full((1, 2, 4), math.nan)):
        with pytest.raises(ValueError, match="forget"):
            Forgetting()(q, k, v, forget=bad)
    with pytest.raises(ValueError, match="log_forget"):
        Forgetting()(q, k, v, log_forget=torch.full((1, 2, 4), 0.1))
    with pytest.raises(ValueError, match="log_forget"):
        Forgetting()(q, k, v, log_forget=torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="one of them"):
        Forgetting()(q, k, v, forget=torch.ones(1, 2, 4), log_forget=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="num_heads"):
        Forgetting(num_heads=0)
    with pytest.raises(ValueError, match="heads"):
        Forgetting(num_heads=3)(q, k, v)
