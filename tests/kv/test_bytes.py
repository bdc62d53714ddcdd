"""Cache bytes fall with the budget: the cache gathers kept entries into smaller tensors
(no masked placeholders), and reports what it holds."""

import pytest
import torch
from eager_reference import padded_batch
from tiny_models import build
from transformers import DynamicCache

import attnkit.kv as kv


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("snapkv", {"window": 4}), ("knorm", {}), ("streaming", {}), ("h2o", {}),
                                         ("adakv", {"window": 4}), ("pyramid", {"window": 4})])
def test_bytes_fall_with_the_budget(name, params):
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=10, n=32, pads=(0, 4, 8))
    dense = DynamicCache()
    model(ids, attention_mask=mask, cache=dense)
    dense_bytes = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in dense.layers)
    sizes = []
    for budget in (1.0, 0.5, 0.25):
        cache = kv.policy_cache(model, name, budget=budget, **params)
        model(ids, attention_mask=mask, cache=cache)
        # what is held is exactly keys + values of (B, Hkv, longest kept, D)
        expected = sum(2 * 3 * 2 * layer.length * 16 * 4 for layer in cache.layers)
        assert cache.kv_nbytes() == expected
        assert cache.nbytes() > cache.kv_nbytes()  # plus the per-entry bookkeeping, counted too
        sizes.append(cache.kv_nbytes())
    assert sizes[0] <= dense_bytes and sizes[0] > sizes[1] > sizes[2], (sizes, dense_bytes)
    if name not in ("adakv", "pyramid"):
        # longest row: 32 real tokens -> 32, 16, 8 entries per head, in each of 3 layers
        assert sizes == [3 * 2 * 3 * 2 * n * 16 * 4 for n in (32, 16, 8)]
