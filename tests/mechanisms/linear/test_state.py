"""States are first-class: N tokens at once == N/2 then N/2 with the state, decoding token by
token == one call, gradients flow through a state, and bad states are refused."""

import pytest
import torch
from linear_cases import qkv

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.linear import NAMED, CosReweight, LinearAttention, LinearState
from helpers import assert_close


def stateful(name, **kw):
    """The named mechanism, with the fixed cosFormer horizon that stateful calls need."""
    if name == "cosformer":
        kw.setdefault("feature_map", CosReweight(max_len=64))
    return get_mechanism(name, chunk_size=4, **kw)


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("form", ["reference", "parallel", "chunked", "recurrent"])
def test_halves_with_state_equal_one_call(name, form):
    mech = stateful(name)
    B, H, N, D = 2, 2, 18, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    full, full_state = mech(q, k, v, mask=ak.causal(), backend=form, return_state=True)
    h = N // 2
    first, state = mech(q[:, :, :h], k[:, :, :h], v[:, :, :h], mask=ak.causal(), backend=form, return_state=True)
    second, end = mech(
        q[:, :, h:], k[:, :, h:], v[:, :, h:], mask=ak.causal(), backend=form, initial_state=state, return_state=True
    )
    assert state.position == h and end.position == N
    assert_close(torch.cat([first, second], dim=2), full)
    assert_close(end.memory, full_state.memory)
    if mech.normalize:
        assert_close(end.normalizer, full_state.normalizer)


@pytest.mark.parametrize("name", NAMED)
def test_decoding_token_by_token_equals_one_call(name):
    mech = stateful(name)
    B, H, N, D = 1, 2, 12, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    full = mech(q, k, v, mask=ak.causal(), backend="chunked")
    state, outs = None, []
    for t in range(N):
        o, state = mech(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask=ak.causal(), initial_state=state, return_state=True
        )
        outs.append(o)
    assert_close(torch.cat(outs, dim=2), full)


@pytest.mark.parametrize("short_conv", [1, 3])
def test_short_conv_state_round_trip(short_conv):
    torch.manual_seed(0)
    mech = LinearAttention("elu+1", normalize=True, decay="gla", short_conv=short_conv, chunk_size=4).double()
    B, H, N, D = 1, 2, 14, 4
    q, k, v = qkv(B, H, H, N, N, D, 3)
    full = mech(q, k, v, mask=ak.causal())
    first, state = mech(q[:, :, :5], k[:, :, :5], v[:, :, :5], mask=ak.causal(), return_state=True)
    assert all(t.shape == (B, H, short_conv - 1, x) for t, x in zip(state.conv, (D, D, 3)))
    second = mech(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], mask=ak.causal(), initial_state=state)
    assert_close(torch.cat([first, second], dim=2), full)


def test_gradient_flows_through_the_state():
    """Backprop through a state passed between calls equals backprop through one call."""
    mech = get_mechanism("gated_deltanet", chunk_size=4).double()
    B, H, N, D = 1, 2, 16, 4
    q, k, v = qkv(B, H, H, N, N, D, 3, requires_grad=True)
    full = mech(q, k, v, mask=ak.causal())
    want = torch.autograd.grad(full.square().sum(), (q, k, v) + tuple(mech.parameters()))
    a, state = mech(q[:, :, :7], k[:, :, :7], v[:, :, :7], mask=ak.causal(), return_state=True)
    b = mech(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], mask=ak.causal(), initial_state=state)
    got = torch.autograd.grad(a.square().sum() + b.square().sum(), (q, k, v) + tuple(mech.parameters()))
    for x, y in zip(got, want):
        assert_close(x, y)


def test_state_methods():
    mech = get_mechanism("linear_elu", short_conv=2).double()
    q, k, v = qkv(3, 2, 2, 5, 5, 4, 3)
    _, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    assert state.batch == 3 and state.heads == 2
    picked = state.select(torch.tensor([2, 0]))
    assert_close(picked.memory, state.memory[[2, 0]])
    assert_close(picked.normalizer, state.normalizer[[2, 0]])
    assert_close(picked.conv[1], state.conv[1][[2, 0]])
    assert state.to(torch.float32).memory.dtype == torch.float32
    assert picked.position == state.position == 5
    grad_state = LinearState(state.memory.clone().requires_grad_(), state.normalizer, 5)
    assert not grad_state.detach().memory.requires_grad


def test_low_precision_inputs_keep_a_float32_state():
    mech = get_mechanism("retnet")
    q, k, v = qkv(1, 2, 2, 20, 20, 8, 8, dtype=torch.bfloat16)
    out, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    assert out.dtype == torch.bfloat16 and state.memory.dtype == torch.float32


def test_bad_states_are_refused():
    mech = get_mechanism("linear_elu")
    q, k, v = qkv(1, 2, 2, 6, 6, 4, 3)
    _, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    with pytest.raises(ValueError, match="initial_state"):
        mech(q, k, v, mask=ak.causal(), initial_state=state.memory)
    with pytest.raises(ValueError, match="initial_state: memory"):
        mech(q[:, :1], k[:, :1], v[:, :1], mask=ak.causal(), initial_state=state)
    with pytest.raises(ValueError, match="initial_state: normalizer"):
        mech(q, k, v, mask=ak.causal(), initial_state=LinearState(state.memory))
    with pytest.raises(ValueError, match="initial_state: has no convolution cache"):
        get_mechanism("linear_elu", short_conv=2)(q, k, v, mask=ak.causal(), initial_state=state)


def test_cosformer_needs_a_fixed_horizon_for_states():
    q, k, v = qkv(1, 2, 2, 6, 6, 4, 3)
    with pytest.raises(ValueError, match="max_len"):
        get_mechanism("cosformer")(q, k, v, mask=ak.causal(), return_state=True)
    mech = get_mechanism("cosformer", feature_map=CosReweight(max_len=8))
    _, state = mech(q, k, v, mask=ak.causal(), return_state=True)
    with pytest.raises(ValueError, match="max_len"):
        mech(q, k, v, mask=ak.causal(), initial_state=state)  # positions 6..11 pass M = 8
