"""StreamingLLM (arXiv 2309.17453) as a cache: with a budget that holds everything it
generates what the full cache generates (greedy and sampled, padded batch of 3, under
sdpa and attnkit); with a window, its teacher-forced logits equal dense attention under
the mask ``sinks | window``; with ``positions="cache"`` kept keys are re-rotated to
their place in the cache."""

import pytest
import torch
from eager_reference import LayerMasks, attention_layers, padded_batch, positions
from tiny_models import build

import attnkit
import attnkit.kv as kv
from attnkit.kv.model_parts import rotate


@torch.no_grad()
@pytest.mark.parametrize("model_name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("positions_mode", ["original", "cache"])
def test_budget_holding_everything_generates_the_full_cache_tokens(model_name, positions_mode):
    model = build(model_name, "sdpa")
    ids, mask = padded_batch(seed=4, n=10, pads=(0, 2, 4))
    gen = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    full = model.generate(ids, do_sample=False, **gen)
    cache = kv.policy_cache(model, "streaming", budget=64, sinks=2, positions=positions_mode)
    assert torch.equal(model.generate(ids, do_sample=False, cache=cache, **gen), full)
    with attnkit.hf.use(model):  # attnkit's attention with the cache's per-head masks
        cache = kv.policy_cache(model, "streaming", budget=64, sinks=2, positions=positions_mode)
        assert torch.equal(model.generate(ids, do_sample=False, cache=cache, **gen), full)
    torch.manual_seed(7)
    sampled = model.generate(ids, do_sample=True, top_k=0, **gen)
    torch.manual_seed(7)
    cache = kv.policy_cache(model, "streaming", budget=64, sinks=2, positions=positions_mode)
    assert torch.equal(model.generate(ids, do_sample=True, top_k=0, past_key_values=cache, **gen), sampled)


@torch.no_grad()
@pytest.mark.parametrize("attnkit_switch", [False, True])
def test_teacher_forced_logits_equal_dense_sink_window_attention(attnkit_switch):
    sinks, budget = 2, 6
    model = build("llama", "sdpa").double()
    prompt, mask = padded_batch(seed=5, n=4, pads=(0, 1, 2))
    forced = torch.randint(1, 97, (3, 8), generator=torch.Generator().manual_seed(6))
    cache = kv.policy_cache(model, "streaming", budget=budget, sinks=sinks)
    got = []
    with attnkit.hf.use(model) if attnkit_switch else _nothing():
        got.append(model(prompt, attention_mask=mask, position_ids=positions(mask), cache=cache).logits)
        full = mask
        for s in range(forced.shape[1]):
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            got.append(model(forced[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits)
            assert int(cache.lengths(0).max()) <= budget
    got = torch.cat(got, 1)

    # Dense: query t sees real key j <= t when j is one of the row's first `sinks` real
    # tokens or at most budget - sinks real tokens back (the entries held, plus itself).
    seq = torch.cat([prompt, forced], 1)
    N = seq.shape[1]
    real = full.bool()
    rank = real.long().cumsum(-1) - 1  # a token's index among its row's real tokens
    t, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    see = (j <= t)[None] & real[:, None, :]
    see &= (rank[:, None, :] < sinks) | (rank[:, :, None] - rank[:, None, :] <= budget - sinks)
    see |= torch.eye(N, dtype=torch.bool)  # padded queries see themselves (their outputs are unused)
    masks = LayerMasks(model)
    try:
        for layer in attention_layers(model):
            masks.masks[layer.layer_idx] = see[:, None]
        want = model(seq, attention_mask=full, position_ids=positions(full)).logits
    finally:
        masks.remove()
    torch.testing.assert_close(got[real], want[real], atol=1e-10, rtol=1e-10)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def test_cache_positions_rerotate_kept_keys():
    """A key rotated by RoPE at position p, turned by d, is the key at p + d; with
    positions='cache' the held keys sit at positions 0, 1, ... of the cache."""
    model = build("llama", "sdpa").double()
    rot = kv.rotary_module(model)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    attn = attention_layers(model)[0]
    k = attn.k_proj(x).view(1, 5, 2, 16).transpose(1, 2)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def at(pos):
        cos, sin = rot(x, torch.tensor([pos]))
        return apply_rotary_pos_emb(k, k, cos, sin)[1]

    p, d = [3, 7, 1, 0, 9], [-3, 2, 5, 0, -9]
    turned = rotate(at(p), torch.tensor(d).expand(1, 2, 5), rot.inv_freq)
    # transformers builds its cos/sin tables in float32 (then casts): float32 rounding of
    # the table entries (~6e-8) times keys of magnitude ~1, summed over two terms
    torch.testing.assert_close(turned, at([a + b for a, b in zip(p, d)]), atol=1e-6, rtol=1e-6)

    ids, mask = padded_batch(seed=8, n=10, pads=(0, 2, 4))
    cache = kv.policy_cache(model, "streaming", budget=5, sinks=1, positions="cache")
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, cache=cache)
    for layer in cache.layers:
        n = layer.valid.sum(-1)
        assert torch.equal(
            torch.where(layer.valid, layer.rope, -1),
            torch.where(layer.valid, torch.arange(layer.length)[None, None].expand_as(layer.rope), -1),
        )
        assert torch.equal(n, torch.full_like(n, 5))


@pytest.mark.parametrize("name,params", [("streaming", {"sinks": 2}), ("h2o", {}), ("tova", {}), ("quest", {"dense_layers": 1})])
def test_gradients_flow_through_a_cache_that_keeps_everything(name, params):
    """With autograd on, appended tokens are copied rather than written into storage that
    earlier steps' graphs still read, and the C++ steps (which have no backward) give way to
    the PyTorch path: a teacher-forced loss over a prefill and decoding steps
    differentiates as with transformers' own cache."""
    from transformers import DynamicCache

    model = build("llama", "sdpa").double()
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(8))

    def grads(cache):
        model.zero_grad()
        loss = model(ids[:, :8], cache=cache).logits.square().mean()
        for s in range(8, 12):
            loss = loss + model(ids[:, s : s + 1], cache=cache).logits.square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(DynamicCache())
    got = grads(kv.policy_cache(model, name, budget=64, **params))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
