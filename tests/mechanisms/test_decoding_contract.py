"""Every registered mechanism under the decoding contract (decoding_contract.py), through
attnkit.nn attention layers: prefix call == rows of the full call == token-by-token
decoding with the layer's KV cache / recurrent state / per-key state. float64,
TOL[float64]."""

import math

import decoding_contract as dc
import pytest
import torch

from attnkit.mechanisms import available
from attnkit.mechanisms.sigmoid import Sigmoid
from attnkit.nn import LayerCache


@pytest.mark.parametrize("name", sorted(set(available()) - dc.NO_CACHE))
def test_prefix_full_and_cached_decoding_agree(name):
    layer = dc.layer_for(name)
    x = dc.inputs()
    dc.prefix_agrees(layer, x)
    dc.cached_agrees(layer, x)


@pytest.mark.parametrize("name", sorted(dc.NO_CACHE))
def test_mechanisms_that_cannot_decode_refuse_a_cache_and_say_why(name):
    layer = dc.layer_for(name)
    assert layer.mechanism.decodes is False and layer.mechanism.decode_note
    x = dc.inputs()
    with pytest.raises(ValueError, match=f"cache: mechanism '{name}' cannot decode with a cache"):
        layer(x[:, :4], cache=LayerCache())
    assert layer(x).shape == x.shape  # without a cache it runs


def test_exactly_the_documented_mechanisms_refuse_to_decode():
    from attnkit.mechanisms import get_mechanism
    from attnkit.nn.attention import build_mechanism

    refusing = {n for n in available() if not build_mechanism(n, dict(dc.PARAMS.get(n, {})), 4, 8, 2, 8).decodes}
    assert refusing == dc.NO_CACHE
    assert get_mechanism("selective").cache_state and not get_mechanism("softmax").cache_state


class PerCallSigmoid(Sigmoid):
    """The bug this contract exists for: b = -log(number of keys of the call)."""

    name = "per_call_sigmoid_test"

    def bias_for(self, k_len=None):
        return -math.log(max(k_len, 1))


def test_the_contract_catches_a_bias_that_depends_on_the_call_length():
    layer = dc.layer_for("sigmoid", mechanism=PerCallSigmoid())
    x = dc.inputs()
    with pytest.raises(AssertionError, match="prefix"):
        dc.prefix_agrees(layer, x)
    with pytest.raises(AssertionError, match="cached decoding"):
        dc.cached_agrees(layer, x)


def test_selective_needs_its_state_beside_the_cache():
    """Without the carried F a cached call of selective attention computes other numbers:
    the contract's cached check is sharp for it."""
    layer = dc.layer_for("selective")
    x = dc.inputs()
    cache = LayerCache()
    with torch.no_grad():
        layer(x[:, :10], cache=cache)
        assert cache.decode_state is not None and cache.decode_state.shape == (2, 10)
        cache.decode_state = None  # forget F: as if the state were not carried
        lost = layer(x[:, 10:11], cache=cache)
        assert (lost - layer(x[:, :11])[:, 10:]).abs().max() > 1e-6


def test_cache_select_reorders_the_per_key_state():
    layer = dc.layer_for("selective")
    x = dc.inputs(batch=3)
    cache = LayerCache()
    with torch.no_grad():
        layer(x[:, :9], cache=cache)
        cache.select(torch.tensor([2, 0]))
        out = layer(x[[2, 0], 9:10], cache=cache)
        dc.assert_close(out, layer(x[[2, 0], :10])[:, 9:])
