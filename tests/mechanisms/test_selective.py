"""Selective attention (arXiv 2410.02703) against the paper's listing; state carried across
calls; the context-pruning rule against a literal simulation."""

import mechanism_contract as mc
import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.kernels import make_request, reference_attention
from attnkit.mechanisms.selective import Selective, prune_context
from helpers import assert_close, qkv


def test_matches_reference():
    mc.grid(Selective())
    mc.matches_reference(Selective(selector_head=3), mc.SHAPES["bottom_right"], ak.causal(), return_lse=True)


def test_small_tiles(monkeypatch):
    with mc.small_tiles(monkeypatch):
        for name in ("none", "causal", "window", "document"):
            mc.matches_reference(
                Selective(selector_head=1),
                dict(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=8),
                mc.MASKS[name](37),
                ak.alibi(4),
                return_lse=True,
            )


def test_gradcheck(monkeypatch):
    with mc.small_tiles(monkeypatch):
        mc.gradchecks(Selective(), mask=ak.causal(), score=ak.softcap(2.0))


def test_low_precision_dead_rows_observers_empty():
    mc.low_precision(Selective(), mask=ak.causal())
    mc.dead_rows(Selective())
    mc.observers(Selective(), mask=ak.causal())
    mc.empty_sequences(Selective())


def test_by_name():
    mc.by_name("selective", Selective())


def test_no_positive_selection_is_softmax():
    # selector head logits all <= 0: S = 0, F = 0, plain softmax
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Nq=10, Nk=10, D=4)
    q[:, 0] = -1.0
    k = k.abs()
    out = Selective()(q, k, v, mask=ak.causal())
    assert_close(out, reference_attention(make_request(q, k, v, mask=ak.causal()))[0])


def test_state_carries_across_calls(monkeypatch):
    """Decoding in two calls with the returned F as initial_state == one call."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Nq=30, Nk=30, D=8)
    mech = Selective()
    with mc.small_tiles(monkeypatch):
        full, state = mech(q, k, v, mask=ak.causal(), return_state=True)
        first, s1 = mech(q[:, :, :18], k[:, :, :18], v[:, :, :18], mask=ak.causal(), return_state=True)
        rest, s2 = mech(q[:, :, 18:], k, v, mask=ak.causal(), initial_state=F.pad(s1, (0, 12)), return_state=True)
    assert_close(torch.cat([first, rest], dim=2), full)
    assert_close(s2, state)
    ref = mech.reference(q[:, :, 18:], k, v, mask=ak.causal(), initial_state=F.pad(s1, (0, 12)))
    assert_close(rest, ref)


def _literal_pruning(q, k, budget, head=0):
    """The eviction rule on the dense F of the paper's listing, one query at a time."""
    N = q.shape[2]
    s = torch.matmul(q[:, head], k[:, head // (q.shape[1] // k.shape[1])].transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    S = torch.relu(s)
    S[..., 0] = 0
    S = S * (1 - torch.eye(N, dtype=S.dtype))
    Fm = torch.cumsum(torch.roll(S, 1, -2).index_fill(-2, torch.tensor([0]), 0.0), dim=-2)
    keep = torch.zeros(q.shape[0], N, dtype=torch.bool)
    for b in range(q.shape[0]):
        held = set()
        for i in range(N):
            held.add(i)
            while len(held) > budget:
                worst = max((j for j in held if j != 0), key=lambda j: (float(Fm[b, i, j]), -j))
                held.remove(worst)
        keep[b, sorted(held)] = True
    return keep


@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_pruning_rule(budget):
    q, k, _ = qkv(B=2, Hq=2, Hkv=1, Nq=40, Nk=40, D=8, seed=budget)
    got = prune_context(q, k, budget, mask=ak.causal(), q_block=7)
    assert torch.equal(got, _literal_pruning(q, k, budget))
    assert (got.sum(-1) == min(budget, 40)).all() and got[:, 0].all()


def test_rejects_bad_input():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="selector_head"):
            Selective(selector_head=bad)
    with pytest.raises(ValueError, match="selector_head"):
        Selective(selector_head=2)(q, k, v)
    with pytest.raises(ValueError, match="initial_state"):
        Selective()(q, k, v, initial_state=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="budget"):
        prune_context(q, k, 0)
