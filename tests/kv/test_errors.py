"""Bad input: a clear ValueError naming the argument, and the model left as it was."""

import pytest
import torch
from eager_reference import padded_batch
from tiny_models import build

import attnkit.kv as kv
from attnkit.kv.hooks import HOOKS_ATTR


@pytest.fixture(scope="module")
def model():
    return build("llama", "sdpa")


@pytest.mark.parametrize("budget", [0, -3, 0.0, -0.5, 1.5, float("nan"), True, "half", None])
def test_bad_budget(model, budget):
    with pytest.raises(ValueError, match="^budget: "):
        kv.policy_cache(model, "snapkv", budget=budget)


@pytest.mark.parametrize(
    "policy,params,name",
    [
        ("streaming", {"sinks": -1}, "sinks"),
        ("streaming", {"positions": "rope"}, "positions"),
        ("snapkv", {"window": 0}, "window"),
        ("snapkv", {"pooling": "min"}, "pooling"),
        ("snapkv", {"kernel": 1.5}, "kernel"),
        ("h2o", {"recent": 1.5}, "recent"),
        ("adakv", {"floor": -0.1}, "floor"),
        ("pyramid", {"beta": 0.5}, "beta"),
        ("quest", {"page_size": 0}, "page_size"),
        ("quest", {"heads": "kv"}, "heads"),
        ("snapkv", {"sinks": 4}, "sinks"),
        ("knorm", {"window": 4}, "window"),
    ],
)
def test_bad_parameter(model, policy, params, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        kv.policy_cache(model, policy, budget=0.5, **params)


def test_unknown_policy_and_bad_types(model):
    with pytest.raises(ValueError, match="^policy: unknown policy 'lru'"):
        kv.policy_cache(model, "lru", budget=0.5)
    with pytest.raises(ValueError, match="^policy: "):
        kv.policy_cache(model, 3, budget=0.5)
    with pytest.raises(ValueError, match="^model: "):
        kv.policy_cache(torch.nn.Linear(2, 2), "streaming", budget=0.5)
    with pytest.raises(ValueError, match="^window: "):
        kv.policy_cache(model, kv.POLICIES["snapkv"](), budget=0.5, window=3)


def test_model_attnkit_cannot_switch(monkeypatch):
    fresh = build("llama", "sdpa")
    monkeypatch.setattr(fresh, "_can_set_attn_implementation", lambda: False)
    with pytest.raises(ValueError, match="^model: policy 'snapkv' reads attention weights"):
        kv.policy_cache(fresh, "snapkv", budget=0.5)
    assert not hasattr(fresh, HOOKS_ATTR)  # a failure leaves the model as it was
    kv.policy_cache(fresh, "knorm", budget=0.5)  # a policy without weights does not need the switch


def test_unprepared_model_and_crop():
    a, b = build("llama", "sdpa"), build("llama", "sdpa")
    ids, mask = padded_batch(seed=0, n=6, pads=(0, 1, 2))
    cache = kv.policy_cache(a, "knorm", budget=0.5)
    with pytest.raises(ValueError, match="^cache: "):
        b(ids, attention_mask=mask, cache=cache)
    cache = kv.policy_cache(a, "knorm", budget=0.5)
    a(ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="^cache: crop takes"):
        cache.crop(2)  # transformers 5 crops by a count of tokens to remove, <= 0
    kv.detach(a)
    assert not hasattr(a, HOOKS_ATTR)
    with pytest.raises(ValueError, match="^cache: "):
        a(ids, attention_mask=mask, cache=kv.PolicyCache(a, kv.POLICIES["knorm"](), ("fraction", 0.5), 3))
