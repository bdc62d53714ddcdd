"""Decoding with a cache equals full recomputation: keys and values (softmax-like
mechanisms), the MLA latent, and the recurrent state of linear mechanisms. float64,
TOL[float64]."""

import pytest
import torch

from attnkit.nn import Attention, Cache, LayerCache
from helpers import assert_close

D_MODEL = 32
CHUNKS = (5, 1, 3, 1, 1)  # a prefill, single tokens, a chunk of 3

LAYERS = {
    "gqa rope": dict(n_kv_heads=2, rope=True),
    "mqa alibi sinks gate": dict(n_kv_heads=1, alibi=True, sinks=True, gate="headwise"),
    "window qk_norm": dict(window=2, rope=True, qk_norm=True),
    "mla absorbed at decode": dict(latent=dict(kv_rank=8, rope_dim=4), rope=True),
    "mla expanded": dict(latent=dict(kv_rank=8, rope_dim=4, absorb=False), rope=True),
    "sigmoid": dict(mechanism="sigmoid", mechanism_params=dict(bias=-1.0), rope=True),
    "linear (recurrent state)": dict(mechanism="linear", mechanism_params=dict(feature_map="elu+1", normalize=True), rope=True),
    "gla (recurrent, gates from k)": dict(mechanism="gla", n_kv_heads=2),
    "gated deltanet (recurrent)": dict(mechanism="gated_deltanet"),
}


def decode(layer, x, cache):
    outs, start = [], 0
    for n in CHUNKS:
        outs.append(layer(x[:, start : start + n], cache=cache))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_cached_decoding_equals_full_recomputation(name):
    torch.manual_seed(0)
    layer = Attention(D_MODEL, 4, **LAYERS[name]).double()
    x = torch.randn(2, sum(CHUNKS), D_MODEL, dtype=torch.float64)
    cache = LayerCache()
    assert_close(decode(layer, x, cache), layer(x))
    assert cache.length == sum(CHUNKS)
    assert (cache.state is not None) == layer.recurrent


def test_select_reorders_rows_like_running_them_alone():
    torch.manual_seed(0)
    layer = Attention(D_MODEL, 4, rope=True).double()
    x = torch.randn(3, 6, D_MODEL, dtype=torch.float64)
    cache = LayerCache()
    layer(x[:, :5], cache=cache)
    cache.select(torch.tensor([2, 0]))
    out = layer(x[[2, 0], 5:], cache=cache)
    assert_close(out, layer(x[[2, 0]])[:, 5:])


def test_model_cache_and_misuse():
    cache = Cache(2)
    assert len(cache) == 2 and cache.length == 0
    layer = cache[0]
    layer.extend(k=torch.zeros(1, 1, 3, 2), v=torch.zeros(1, 1, 3, 2))
    assert cache.length == 3
    with pytest.raises(ValueError, match=r"cache: expected tensors named \['k', 'v'\]"):
        layer.extend(latent=torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match="cache: new tensors disagree on the number of tokens"):
        layer.extend(k=torch.zeros(1, 1, 1, 2), v=torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="cache: this layer holds keys and values"):
        layer.set_state(object(), 1)
    other = cache[1]
    other.set_state("state", 2)
    with pytest.raises(ValueError, match="cache: this layer holds a recurrent state"):
        other.extend(k=torch.zeros(1, 1, 1, 2))
