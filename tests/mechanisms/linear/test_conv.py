"""The short causal convolution against its definition, and its cache."""

import pytest
import torch
import torch.nn.functional as F
from linear_cases import qkv

import attnkit as ak
from attnkit.mechanisms import get_mechanism
from attnkit.mechanisms.linear import LinearAttention
from attnkit.mechanisms.linear.conv import ShortConv
from helpers import assert_close


def literal_conv(x, w):
    """y_t = silu(Σ_i w[..., i] x_{t-w+1+i}), zero before the sequence; w (H, D, width)."""
    N = x.shape[2]
    width = w.shape[-1]
    y = torch.zeros_like(x)
    for t in range(N):
        for i in range(width):
            s = t - width + 1 + i
            if s >= 0:
                y[:, :, t] += w[:, :, i] * x[:, :, s]
    return F.silu(y)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_definition_and_caches_the_last_inputs(width):
    conv = ShortConv(width).double()
    q, k, v = qkv(2, 4, 2, 9, 9, 3, 5)
    cq, ck, cv, cache = conv(q, k, v)
    assert conv.weight_q.shape == (4, 3, width) and conv.weight_v.shape == (2, 5, width)
    for x, y, w in ((q, cq, conv.weight_q), (k, ck, conv.weight_k), (v, cv, conv.weight_v)):
        assert_close(y, literal_conv(x, w))
    for x, c in zip((q, k, v), cache):
        assert_close(c, x[:, :, 9 - (width - 1) :])
    # continuing from the cache equals convolving the whole sequence
    more = qkv(2, 4, 2, 3, 3, 3, 5, seed=1)
    tail = conv(*more, cache)
    whole = conv(*(torch.cat([a, b], dim=2) for a, b in zip((q, k, v), more)))
    for a, b in zip(tail[:3], whole[:3]):
        assert_close(a, b[:, :, 9:])


def test_bfloat16_inputs_convolve_in_float32():
    conv = ShortConv(3)
    q, k, v = qkv(1, 2, 2, 6, 6, 4, 4, dtype=torch.bfloat16)
    out = conv(q, k, v)
    assert out[0].dtype == torch.float32
    assert_close(out[0], literal_conv(q.float(), conv.weight_q.detach()), dtype=torch.float32)


def test_mechanism_with_conv_is_the_mechanism_on_convolved_inputs():
    mech = get_mechanism("deltanet", short_conv=4).double()
    q, k, v = qkv(1, 2, 2, 12, 12, 4, 3)
    out = mech(q, k, v, mask=ak.causal())
    cq, ck, cv, _ = mech.conv(q, k, v)
    plain = get_mechanism("deltanet").double()
    assert_close(out, plain(cq, ck, cv, mask=ak.causal()))


def test_bad_widths_and_shapes():
    with pytest.raises(ValueError, match="short_conv"):
        ShortConv(0)
    conv = ShortConv(2)
    q, k, v = qkv(1, 2, 2, 4, 4, 3, 3)
    conv(q, k, v)
    with pytest.raises(ValueError, match="k: the short convolution was built for 2 heads"):
        conv(q, torch.zeros(1, 3, 4, 3, dtype=torch.float64), v)


def test_weights_created_at_construction_survive_the_first_call():
    # With heads= and head_dim= the weights exist before any call; the lazy-module hook
    # still runs on the first call and used to materialise them again, failing with
    # "'Parameter' object has no attribute 'materialize'".
    mech = LinearAttention(short_conv=4, heads=2, head_dim=8, kv_heads=1, value_dim=5).double()
    conv = mech.conv
    assert conv.weight_q.shape == (2, 8, 4) and conv.weight_k.shape == (1, 8, 4) and conv.weight_v.shape == (1, 5, 4)
    before = [w.detach().clone() for w in (conv.weight_q, conv.weight_k, conv.weight_v)]
    q, k, v = qkv(1, 2, 1, 7, 7, 8, 5)
    out = mech(q, k, v, mask=ak.causal())
    for w, b in zip((conv.weight_q, conv.weight_k, conv.weight_v), before):
        assert torch.equal(w.detach(), b)
    cq, ck, cv, _ = conv(q, k, v)
    assert_close(out, LinearAttention().double()(cq, ck, cv, mask=ak.causal()))
    assert mech(q, k, v, mask=ak.causal()).shape == (1, 2, 7, 5)  # and every later call
