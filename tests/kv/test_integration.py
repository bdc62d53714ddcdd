"""How a policy cache meets the model: transformers' eager implementation, an enclosing
``attnkit.hf.use`` block, and a forward that fails half-way."""

import pytest
import torch
from eager_reference import padded_batch, positions
from tiny_models import build

import attnkit
import attnkit.kv as kv
from attnkit.hf.switch import active_switch


@torch.no_grad()
@pytest.mark.parametrize(
    "name,params", [("streaming", {"sinks": 2}), ("knorm", {}), ("quest", {"page_size": 3, "dense_layers": 1})]
)
def test_weightless_policies_under_eager(name, params):
    model = build("llama", "eager")
    ids, mask = padded_batch(seed=13, n=10, pads=(0, 2, 4))
    gen = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    full = model.generate(ids, **gen)
    assert torch.equal(model.generate(ids, cache=kv.policy_cache(model, name, budget=64, **params), **gen), full)
    small = kv.policy_cache(model, name, budget=4, **params)
    model.generate(ids, cache=small, **gen)
    if name != "quest":
        assert int(small.lengths(0).max()) <= 4 + (0 if name == "streaming" else 4)


@torch.no_grad()
def test_weights_inside_an_enclosing_switch():
    model = build("qwen2", "sdpa")
    ids, mask = padded_batch(seed=14, n=12, pads=(0, 3, 5))
    outside = kv.policy_cache(model, "snapkv", budget=0.5, window=3)
    model(ids, attention_mask=mask, position_ids=positions(mask), cache=outside)
    meter = attnkit.observe.SinkMass()
    with attnkit.hf.use(model, observers=[meter]) as switch:
        inside = kv.policy_cache(model, "snapkv", budget=0.5, window=3)
        model(ids, attention_mask=mask, position_ids=positions(mask), cache=inside)
        assert switch.observers == [meter]  # the scorer joined for the forward only
    for layer in range(3):
        assert torch.equal(inside.kept_mask(layer), outside.kept_mask(layer))
    assert meter.rows()  # the user's meter still saw the calls


def test_a_failing_forward_leaves_the_model_as_it_was(monkeypatch):
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=0, n=6, pads=(0, 1, 2))
    cache = kv.policy_cache(model, "h2o", budget=0.5)

    def broken(step):
        raise RuntimeError("boom")

    monkeypatch.setattr(cache.policy, "select", broken)
    with pytest.raises(RuntimeError, match="boom"):
        model(ids, attention_mask=mask, cache=cache)
    assert model.config._attn_implementation == "sdpa"
    assert active_switch(model.model.layers[0].self_attn)[0] is None


@torch.no_grad()
@pytest.mark.parametrize(
    "name,params", [("h2o", {}), ("snapkv", {"window": 3}), ("tova", {}), ("adakv", {"window": 3}), ("pyramid", {"window": 3})]
)
def test_scored_policies_with_room_for_everything_generate_the_full_cache_tokens(name, params):
    """Greedy and sampled, a left-padded batch of 3: weights read through attnkit, the
    baseline on sdpa."""
    model = build("qwen2", "sdpa")
    ids, mask = padded_batch(seed=15, n=10, pads=(0, 2, 4))
    gen = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    budget = 1000 if name == "pyramid" else 64  # pyramid's last layer gets budget / beta
    assert torch.equal(
        model.generate(ids, do_sample=False, cache=kv.policy_cache(model, name, budget=budget, **params), **gen),
        model.generate(ids, do_sample=False, **gen),
    )
    torch.manual_seed(3)
    sampled = model.generate(ids, do_sample=True, top_k=0, **gen)
    torch.manual_seed(3)
    cache = kv.policy_cache(model, name, budget=budget, **params)
    assert torch.equal(model.generate(ids, do_sample=True, top_k=0, cache=cache, **gen), sampled)
