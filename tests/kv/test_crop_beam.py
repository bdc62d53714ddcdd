"""Beam search and rollback: ``reorder_cache`` / ``batch_select_indices`` move every
row's entries (and the bookkeeping beside them) with its beam, and ``crop`` forgets the
last tokens as transformers' own ``DynamicCache.crop`` does."""

import pytest
import torch
from eager_reference import padded_batch, positions
from tiny_models import build
from transformers import DynamicCache

import attnkit.kv as kv

STATE = ("keys", "values", "valid", "pos", "rope", "score", "capacity")


def state(layer):
    """The layer's tensors (``rope`` and ``score`` only where its policy keeps them)."""
    return [n for n in STATE if getattr(layer, n) is not None]


def _feed(model, cache, ids, mask, steps):
    """Prefill then one token per column of ``steps``; returns the 2-D mask and the logits."""
    outs = [model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache).logits[:, -1]]
    full = mask
    for s in range(steps.shape[1]):
        full = torch.cat([full, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
        outs.append(
            model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits[:, -1]
        )
    return full, outs


@torch.no_grad()
@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", {"window": 3}),
        ("h2o", {}),
        ("streaming", {"sinks": 2}),
        ("quest", {"page_size": 2, "dense_layers": 1}),
        ("adakv", {"window": 3}),
    ],
)
def test_beam_search_with_room_for_everything_equals_the_full_cache(name, params):
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=22, n=10, pads=(0, 2, 4))
    gen = dict(attention_mask=mask, max_new_tokens=8, num_beams=2, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **gen)
    cache = kv.policy_cache(model, name, budget=64, **params)
    moves = []
    original = cache.reorder_cache
    cache.reorder_cache = lambda idx: moves.append(idx.clone()) or original(idx)
    got = model.generate(ids, cache=cache, **gen)
    assert torch.equal(got, want)
    # beams really swapped rows (a cache that ignored reorder_cache generates other tokens here)
    assert any(not torch.equal(m, torch.arange(len(m))) for m in moves)


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("h2o", {}), ("snapkv", {"window": 3}), ("adakv", {"window": 3})])
def test_reorder_cache_moves_every_row_with_its_beam(name, params):
    model = build("qwen2", "sdpa")
    ids, mask = padded_batch(seed=22, n=12, pads=(0, 3, 5))
    cache = kv.policy_cache(model, name, budget=0.5, **params)
    full, _ = _feed(model, cache, ids, mask, torch.tensor([[3, 4], [5, 6], [7, 8]]))
    before = [{n: getattr(layer, n).clone() for n in state(layer)} for layer in cache.layers]
    kept = [cache.kept_positions(i) for i in range(3)]
    beam_idx = torch.tensor([2, 2, 0])
    cache.reorder_cache(beam_idx)
    for i, layer in enumerate(cache.layers):
        for n in state(layer):
            assert torch.equal(getattr(layer, n), before[i][n][beam_idx]), (i, n)
        assert cache.kept_positions(i) == [kept[i][b] for b in (2, 2, 0)]
    # the reordered cache keeps decoding as the selected rows would
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.kept_positions(0) == [kept[0][2], kept[0][0]]


@torch.no_grad()
@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", {"window": 3}),
        ("knorm", {}),
        ("quest", {"page_size": 2, "dense_layers": 1}),
        ("h2o", {}),
        ("streaming", {"sinks": 2}),
    ],
)
def test_crop_with_room_for_everything_equals_the_full_cache_crop(name, params):
    """Feed 4 tokens, crop 3 (as assisted decoding rejects draft tokens), feed 2 others:
    the logits equal the full cache's under the same calls."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=23, n=10, pads=(0, 2, 4))
    draft = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(1))
    after = torch.randint(1, 97, (3, 2), generator=torch.Generator().manual_seed(2))
    results = []
    for cache in (DynamicCache(), kv.policy_cache(model, name, budget=64, **params)):
        full, _ = _feed(model, cache, ids, mask, draft)
        cache.crop(-3)
        assert cache.get_seq_length() == 11
        full = full[:, :-3]
        outs = []
        for s in range(2):
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            outs.append(model(after[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits)
        results.append(torch.cat(outs, 1))
    torch.testing.assert_close(results[1], results[0], atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_crop_after_eviction_undoes_the_tokens_exactly_for_prefill_only_policies():
    """SnapKV evicts at prefill only: after crop(-3) the layer is the one that saw only
    the first decoded token (same entries, same tensors), and it says it is croppable."""
    model = build("mistral", "sdpa").double()
    ids, mask = padded_batch(seed=24, n=12, pads=(0, 3, 5))
    steps = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(3))
    a = kv.policy_cache(model, "snapkv", budget=0.5, window=3)
    b = kv.policy_cache(model, "snapkv", budget=0.5, window=3)
    _feed(model, a, ids, mask, steps)
    _feed(model, b, ids, mask, steps[:, :1])
    a.crop(-3)
    assert a.is_croppable
    for la, lb in zip(a.layers, b.layers):
        assert la.seen == lb.seen
        assert state(la) == state(lb)
        for n in state(la):
            assert torch.equal(getattr(la, n), getattr(lb, n)), n


@torch.no_grad()
def test_crop_after_decoding_evictions_forgets_the_tokens_and_says_it_is_not_a_rollback():
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=25, n=10, pads=(0, 2, 4))
    cache = kv.policy_cache(model, "streaming", budget=6, sinks=2)
    _feed(model, cache, ids, mask, torch.randint(1, 97, (3, 20), generator=torch.Generator().manual_seed(4)))
    before = cache.kept_positions(0)
    cache.crop(-3)
    assert not cache.is_croppable  # streaming evicted while decoding: those entries do not come back
    assert cache.get_seq_length() == 27
    assert cache.kept_positions(0) == [[[p for p in head if p < 27] for head in row] for row in before]


@torch.no_grad()
def test_assisted_generation_with_a_croppable_policy_cache():
    model = build("llama", "sdpa")
    assistant = build("llama", "sdpa")
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(5))
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **gen)
    got = model.generate(ids, assistant_model=assistant, cache=kv.policy_cache(model, "snapkv", budget=64, window=3), **gen)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cropped"):
        model.generate(ids, assistant_model=assistant, cache=kv.policy_cache(model, "h2o", budget=64), **gen)
