"""Budgets hold what the docs promise (issue 31): PyramidKV's layers keep a mean of
exactly the requested budget wherever the prompt allows it (what a layer cannot hold
goes to the others), and budget 1.0 is the full cache for every policy that stops
evicting after the prefill, Quest included: greedy decoding in float64 gives
transformers' ``DynamicCache`` logits, padded batch or not, across page boundaries."""

import pytest
import torch
import transformers as T
from eager_reference import greedy, padded_batch, pyramid_budgets
from tiny_models import build
from transformers import DynamicCache

import attnkit.kv as kv
from attnkit.kernels.cpu import kv as native_kv


def four_layers():
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return T.LlamaForCausalLM(config).eval().double()


@torch.no_grad()
@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75, 1.0, 40, 300])
def test_pyramid_keeps_the_requested_mean(budget):
    """200 and 150 real tokens over 4 layers at beta 20: the paper's sequence would put
    the first layers above the prompt (0.75 of 200: 292, 197, 102, 7); each layer keeps
    the reference budget, and the layers' mean is the budget (or the whole prompt)."""
    model = four_layers()
    ids, mask = padded_batch(seed=3, n=200, pads=(0, 50))
    cache = kv.policy_cache(model, "pyramid", budget=budget, window=8)
    model(ids, attention_mask=mask, cache=cache)
    for b, n in enumerate((200, 150)):
        k = budget if isinstance(budget, int) else int(budget * n)
        kept = [int(cache.lengths(i)[b, 0]) for i in range(4)]
        assert kept == pyramid_budgets(k, n, 4, 20), (b, kept)
        assert sum(kept) == 4 * min(k, n)


@torch.no_grad()
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "name,params",
    [
        ("quest", {"page_size": 16, "dense_layers": 1}),
        ("quest", {"page_size": 4, "dense_layers": 0, "heads": "group"}),
        ("pyramid", {"window": 4}),
        ("snapkv", {"window": 4}),
        ("adakv", {"window": 4}),
        ("knorm", {}),
    ],
)
@pytest.mark.parametrize("pads", [(0,), (0, 5)], ids=["one-row", "padded"])
def test_budget_one_is_the_full_cache(name, params, pads, native, monkeypatch):
    """A prompt of 32 tokens fills two pages of 16 exactly: every decoded token opens or
    extends a page past the prompt, which a page budget fixed at the prompt would leave
    out (or drop a prompt page for)."""
    if not native:
        monkeypatch.setattr(native_kv, "available", lambda: False)
    elif not native_kv.available():
        pytest.skip("the C++ operators are unavailable")
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=7, n=32, pads=pads)
    want_tokens, want = greedy(model, ids, mask, DynamicCache(), 18)
    got_tokens, got = greedy(model, ids, mask, kv.policy_cache(model, name, budget=1.0, **params), 18)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert torch.equal(got_tokens, want_tokens)


@torch.no_grad()
@pytest.mark.parametrize("name", ["streaming", "h2o", "tova"])
def test_evicting_policies_hold_the_prompt_length_at_budget_one(name):
    """Documented, not the full cache: the policies that evict while decoding keep each
    row's budget, at 1.0 its prompt length, as tokens come."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=8, n=12, pads=(0, 4))
    cache = kv.policy_cache(model, name, budget=1.0)
    greedy(model, ids, mask, cache, 5)
    for i in range(len(cache.layers)):
        assert cache.lengths(i)[:, 0].tolist() == [12, 8]
