"""While decoding, an evicted entry becomes a hole (``PolicyLayer.drop``) that the next
token fills when every head has one (``PolicyLayer.fill``); otherwise holes are masked
and the layer is gathered only once enough have gathered. The kept sets and the model's
outputs must be those of gathering at every step, across several gathers."""

import pytest
import torch
from eager_reference import padded_batch, positions
from tiny_models import build

import attnkit.kv as kv
import attnkit.kv.cache as kv_cache
import attnkit.kv.layer as kv_layer
import attnkit.kv.masks as kv_masks
import attnkit.kv.steps as kv_steps


def _teacher_forced(model, name, params, budget, prompt, mask, forced):
    cache = kv.policy_cache(model, name, budget=budget, **params)
    outs = [model(prompt, attention_mask=mask, position_ids=positions(mask), cache=cache).logits]
    full, kept, lengths = mask, [], []
    for s in range(forced.shape[1]):
        full = torch.cat([full, torch.ones(mask.shape[0], 1, dtype=full.dtype)], 1)
        outs.append(model(forced[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits)
        kept.append(cache.kept_positions(0))
        lengths.append(cache.layers[0].length)
    _teacher_forced.last_cache = cache
    return torch.cat(outs, 1), kept, lengths


@torch.no_grad()
def test_streaming_ring_matches_selecting_every_step(monkeypatch):
    """Every row over its budget from the first step: StreamingLLM's evicted slots go
    round a ring after the sinks, which the cache follows without calling ``select``;
    kept sets and logits equal the general path's, through several turns of the ring."""
    from attnkit.kv.policies.streaming import Streaming

    sinks, budget, steps = 2, 4, 17
    model = build("llama", "sdpa").double()
    prompt, mask = padded_batch(seed=3, n=10, pads=(0, 2, 5))  # 10, 8 and 5 real tokens: all over 4
    forced = torch.randint(1, 97, (3, steps), generator=torch.Generator().manual_seed(5))
    ring, ring_kept, _ = _teacher_forced(model, "streaming", {"sinks": sinks}, budget, prompt, mask, forced)
    cache = _teacher_forced.last_cache
    rings = [cache.rolling_ring(i) for i in range(len(cache.layers))]
    assert all(r is not None and r[:2] == (sinks, budget + 1 - sinks) for r in rings)
    monkeypatch.setattr(Streaming, "rolling", False)
    general, general_kept, _ = _teacher_forced(model, "streaming", {"sinks": sinks}, budget, prompt, mask, forced)
    cache = _teacher_forced.last_cache
    assert not any(cache.rolling_ring(i) for i in range(len(cache.layers)))
    assert ring_kept == general_kept
    torch.testing.assert_close(ring, general, atol=1e-10, rtol=1e-10)
    for s, kept in enumerate(ring_kept):
        for b, pad in enumerate((0, 2, 5)):
            real = list(range(pad, 10 + s + 1))
            assert kept[b] == [real[:sinks] + real[-(budget - sinks) :]] * 2


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("streaming", {"sinks": 2}), ("h2o", {}), ("tova", {})])
def test_filled_slots_and_holes_match_gathering_every_step(name, params, monkeypatch):
    budget, steps = 6, 40  # 40 steps of one eviction each: a gather after every 16 holes
    model = build("llama", "sdpa").double()
    prompt, mask = padded_batch(seed=3, n=10, pads=(0, 2, 5))
    forced = torch.randint(1, 97, (3, steps), generator=torch.Generator().manual_seed(4))
    # every row evicts one entry per step: the next token takes its slot, the layer keeps its size
    filled, filled_kept, filled_len = _teacher_forced(model, name, params, budget, prompt, mask, forced)
    monkeypatch.setattr(kv_layer.PolicyLayer, "one_hole_each", lambda self: False)  # no filling: holes pile up
    lazy, lazy_kept, lazy_len = _teacher_forced(model, name, params, budget, prompt, mask, forced)
    slack = kv_cache.DECODE_SLACK_MIN  # layers this short gather after more than 16 holes
    monkeypatch.setattr(kv_cache, "DECODE_SLACK_MIN", 0)
    monkeypatch.setattr(kv_cache, "DECODE_SLACK_DIV", 10**9)  # any hole: gather at once
    eager, eager_kept, eager_len = _teacher_forced(model, name, params, budget, prompt, mask, forced)
    assert lazy_kept == eager_kept and filled_kept == eager_kept
    # float64, same kept entries: only the order of summation over the slots differs
    torch.testing.assert_close(lazy, eager, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(filled, eager, atol=1e-10, rtol=1e-10)
    assert max(eager_len) == budget  # gathered every step: exactly the budget
    assert set(filled_len) == {budget + 1}  # the budget and the one slot a step's token takes
    assert max(lazy_len) == budget + slack  # holes accumulate up to the slack
    assert any(b < a for a, b in zip(lazy_len, lazy_len[1:]))  # and a gather shrank the layer
    if name == "streaming":
        for s, kept in enumerate(filled_kept):
            seen = 10 + s + 1
            for b, pad in enumerate((0, 2, 5)):
                real = list(range(pad, seen))
                assert kept[b] == [real[:2] + real[-(budget - 2) :]] * 2  # the sinks and the most recent, both heads


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("knorm", {}), ("snapkv", {"window": 4}), ("streaming", {"sinks": 2})])
def test_unmasked_single_token_steps_match_the_masked_path(name, params, monkeypatch):
    """One row, heads of equal length, no holes: a decoding step runs with no mask (as
    with a full cache); its logits must be the masked path's."""
    model = build("llama", "sdpa").double()
    prompt = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    forced = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(6))
    built = []
    original = kv_cache.PolicyCache._mask
    monkeypatch.setattr(kv_cache.PolicyCache, "_mask", lambda self, *a: built.append(1) or original(self, *a))
    fast, fast_kept, _ = _teacher_forced(model, name, params, 8, prompt, mask, forced)
    assert not built  # streaming's evicted slot is filled by the next token: no hole to mask either
    for where in (kv_cache, kv_masks, kv_steps):  # a window that hides nothing forces the mask
        monkeypatch.setattr(where, "sliding_window", lambda module: 10**9)
    built.clear()
    masked, masked_kept, _ = _teacher_forced(model, name, params, 8, prompt, mask, forced)
    assert built and fast_kept == masked_kept
    torch.testing.assert_close(fast, masked, atol=1e-10, rtol=1e-10)
