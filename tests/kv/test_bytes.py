"""Cache bytes fall with the budget: the cache gathers kept entries into smaller tensors
(no masked placeholders), and reports what it holds. Policies that evict at prefill only
then hold exactly the kept entries, without padding to the longest (row, head)."""

import pytest
import torch
from eager_reference import padded_batch
from tiny_models import build
from transformers import DynamicCache

import attnkit.kv as kv
from attnkit.kv.layer import PolicyLayer


@torch.no_grad()
@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", {"window": 4}),
        ("knorm", {}),
        ("streaming", {}),
        ("h2o", {}),
        ("adakv", {"window": 4}),
        ("pyramid", {"window": 4}),
    ],
)
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
        expected = 0
        for i, layer in enumerate(cache.layers):
            if name in ("streaming", "h2o") or bool(layer.valid.all()):
                # evicting while decoding, or no empty slot: keys + values of (B, Hkv, longest kept, D)
                expected += 2 * 3 * 2 * layer.length * 16 * 4
            else:
                # the kept entries themselves (+ one row of zeros the empty slots read), 2 x 16 x 4 bytes each
                expected += 2 * (int(cache.lengths(i).sum()) + 1) * 16 * 4
        assert cache.kv_nbytes() == expected
        assert cache.nbytes() > cache.kv_nbytes()  # plus the per-entry bookkeeping, counted too
        sizes.append(cache.kv_nbytes())
    assert sizes[0] <= dense_bytes and sizes[0] > sizes[1] > sizes[2], (sizes, dense_bytes)
    if name in ("streaming", "h2o"):
        # longest row: 32 real tokens -> 32, 16, 8 entries per head, in each of 3 layers
        assert sizes == [3 * 2 * 3 * 2 * n * 16 * 4 for n in (32, 16, 8)]
    elif name in ("snapkv", "knorm"):
        # rows of 32, 28 and 24 real tokens keep floor(f n) entries in each of 2 heads and 3 layers
        assert sizes == [3 * 2 * (2 * sum(int(f * n) for n in (32, 28, 24)) + 1) * 16 * 4 for f in (1.0, 0.5, 0.25)]


@torch.no_grad()
def test_adakv_holds_its_budget_in_bytes_and_decodes_as_the_padded_layout(monkeypatch):
    """AdaKV's heads keep different counts: packed, the bytes are those of the budget
    (floor(f n) x Hkv entries per row and layer), and teacher-forced decoding gives the
    same logits and kept entries as the padded layout."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=11, n=24, pads=(0, 3, 6))
    forced = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(12))

    def run():
        cache = kv.policy_cache(model, "adakv", budget=0.25, window=2, kernel=3)
        logits = [model(ids, attention_mask=mask, cache=cache).logits]
        full = mask
        for s in range(forced.shape[1]):
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            logits.append(model(forced[:, s : s + 1], attention_mask=full, cache=cache).logits)
        return cache, torch.cat(logits, 1)

    packed, a = run()
    lengths = torch.stack([packed.lengths(i) for i in range(3)])
    assert (lengths[..., 0] != lengths[..., 1]).any()  # ragged heads
    prompt_kept = [2 * sum(int(0.25 * n) for n in (24, 21, 18))] * 3  # the budget, shared by the 2 heads
    decoded = 3 * 2 * 4  # 4 tokens in every row and head
    assert packed.kv_nbytes() == sum(2 * (n + 1 + decoded) * 16 * 8 for n in prompt_kept)
    monkeypatch.setattr(PolicyLayer, "pack", lambda self: False)  # the padded layout
    padded, b = run()
    assert padded.kv_nbytes() > packed.kv_nbytes()
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    for i in range(3):
        assert packed.kept_positions(i) == padded.kept_positions(i)
