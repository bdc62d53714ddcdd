"""Multi-head latent attention: equals its naive expansion written out from the paper,
and the absorbed form equals the expanded one (float64, TOL[float64])."""

import pytest
import torch
from literal import latent_layer

from attnkit.nn import Attention, LayerCache
from helpers import assert_close

D_MODEL = 48


def mla(absorb=None, **kwargs):
    torch.manual_seed(0)
    latent = dict(kv_rank=12, rope_dim=4, absorb=absorb, **kwargs.pop("latent", {}))
    layer = Attention(D_MODEL, 4, head_dim=8, latent=latent, rope=True, **kwargs).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


VARIANTS = {
    "plain": dict(),
    "q latent": dict(latent=dict(q_rank=10)),
    "v_dim and nope_dim": dict(latent=dict(nope_dim=6, v_dim=5)),
    "sinks + gate + alibi": dict(sinks=True, gate="elementwise", alibi=True),
    "window": dict(window=3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("absorb", [False, True])
def test_mla_equals_its_naive_expansion(variant, absorb):
    layer = mla(absorb, **VARIANTS[variant])
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    assert_close(layer(x), latent_layer(layer, x))


def test_the_cache_holds_only_the_latent_and_the_rotary_key():
    layer = mla()
    cache = LayerCache()
    layer(torch.randn(2, 5, D_MODEL, dtype=torch.float64), cache=cache)
    assert {k: tuple(t.shape) for k, t in cache.tensors.items()} == {"latent": (2, 1, 5, 12), "rope_key": (2, 1, 5, 4)}


def test_absorbing_another_mechanism_is_refused():
    layer = mla(absorb=True, mechanism="sigmoid")
    with pytest.raises(ValueError, match="latent absorb: the absorbed form is exact for softmax only"):
        layer(torch.randn(1, 3, D_MODEL, dtype=torch.float64))
    # The expanded form runs any mechanism.
    assert mla(absorb=False, mechanism="sigmoid")(torch.randn(1, 3, D_MODEL, dtype=torch.float64)).shape == (1, 3, D_MODEL)


@pytest.mark.parametrize("name, value", [("kv_rank", 0), ("rope_dim", 3)])
def test_bad_latent_config(name, value):
    with pytest.raises(ValueError, match=f"latent {name}"):
        Attention(D_MODEL, 4, latent={"kv_rank": 8, name: value})
