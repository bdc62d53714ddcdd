"""Selective attention's context pruning (arXiv 2410.02703) as a cache policy: the kept
entries after the prefill and every decoding step equal ``prune_context`` (the paper's
rule, in attnkit.mechanisms.selective) run over all queries and keys the model computed,
each row without its padding."""

import pytest
import torch
from eager_reference import attention_layers, padded_batch, positions
from tiny_models import build
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import attnkit
import attnkit.kv as kv
from attnkit.mechanisms.selective import prune_context
from attnkit.mods import causal


@torch.no_grad()
def test_kept_entries_equal_prune_context_over_the_whole_run():
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=11, n=10, pads=(0, 2, 4))
    steps = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(12))
    seen = {i: ([], []) for i in range(3)}

    def capture(module, args, kwargs):
        h = kwargs["hidden_states"]
        B, N = h.shape[:2]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(h).view(B, N, 4, 16).transpose(1, 2)
        k = module.k_proj(h).view(B, N, 2, 16).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        seen[module.layer_idx][0].append(q)
        seen[module.layer_idx][1].append(k)

    hooks = [a.register_forward_pre_hook(capture, with_kwargs=True) for a in attention_layers(model)]
    budget = 5
    try:
        with attnkit.hf.use(model, mechanism="selective"):
            cache = kv.policy_cache(model, "selective", budget=budget)
            model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
            full = mask
            for s in range(steps.shape[1]):
                full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
                model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache)
    finally:
        for h in hooks:
            h.remove()
    real = full.bool()
    for layer in range(3):
        q, k = torch.cat(seen[layer][0], 2), torch.cat(seen[layer][1], 2)
        got = cache.kept_mask(layer)
        assert torch.equal(got[:, 0], got[:, 1])  # one set per row
        for b in range(3):
            idx = real[b].nonzero().flatten()
            want = prune_context(q[b : b + 1, :, idx], k[b : b + 1, :, idx], budget, mask=causal(), scale=16**-0.5)
            assert torch.equal(got[b, 0, idx], want[0]), (layer, b)
            assert int(got[b, 0].sum()) == budget


def test_selective_needs_the_selective_switch():
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=0, n=6, pads=(0, 1, 2))
    cache = kv.policy_cache(model, "selective", budget=3)
    with pytest.raises(ValueError, match="^policy: 'selective' prunes"):
        model(ids, attention_mask=mask, cache=cache)
    assert model.config._attn_implementation == "sdpa"
