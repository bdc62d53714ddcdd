"""Every scored policy keeps what its ``reference`` rule (written from the paper) keeps
when run on transformers' eager attention weights: tiny Llama / Qwen2 / Mistral (GQA,
sliding-window layers), a left-padded batch of 3, at prefill and after decoding steps.
The policy cache gets its weights from attnkit's observers; the reference from
``output_attentions`` with its own kept sets carried step to step."""

import pytest
import torch
from eager_reference import fraction_capacity, padded_batch, positions, pyramid_budgets, simulate
from tiny_models import build

import attnkit.kv as kv

CASES = [
    ("h2o", {}, 0.5),
    ("h2o", {"recent": 0.25}, 0.6),
    ("snapkv", {"window": 3, "kernel": 3}, 0.5),
    ("snapkv", {"window": 4, "kernel": 5, "pooling": "avg"}, 0.6),
    ("tova", {}, 0.5),
    ("pyramid", {"window": 2, "kernel": 3, "beta": 2}, 0.5),
    ("adakv", {"window": 2, "kernel": 3, "floor": 0.25}, 0.5),
    ("knorm", {}, 0.4),
    ("streaming", {"sinks": 2}, 0.5),
]


def capacity_for(name, params, f, num_layers):
    base = fraction_capacity(f)
    if name != "pyramid":
        return base

    def pyramid(layer, real):
        ks = base(layer, real).tolist()
        return torch.tensor([pyramid_budgets(k, int(n), num_layers, params["beta"])[layer] for k, n in zip(ks, real.tolist())])

    return pyramid


@torch.no_grad()
@pytest.mark.parametrize("model_name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("name,params,f", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_kept_sets_equal_reference(model_name, name, params, f):
    eager = build(model_name, "eager").double()
    ids, mask = padded_batch(seed=1, n=12, pads=(0, 3, 5))
    steps = torch.randint(1, 97, (3, 3), generator=torch.Generator().manual_seed(2))
    policy = kv.POLICIES[name](**params)
    expected = simulate(eager, policy, ids, mask, capacity_for(name, params, f, eager.config.num_hidden_layers), steps)

    model = build(model_name, "sdpa").double()  # the same weights; attnkit for the policies that read weights

    cache = kv.policy_cache(model, name, budget=f, **params)
    model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True)
    full = mask
    for s in range(steps.shape[1] + 1):
        for layer, want in expected[s].items():
            got = cache.kept_mask(layer)
            assert torch.equal(got, want), f"{name} step {s} layer {layer}:\n{got.int()}\nvs\n{want.int()}"
        if s == steps.shape[1]:
            break
        full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], dim=1)
        model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache, use_cache=True)
    assert model.config._attn_implementation == "sdpa"  # the switch for the weights was undone


@torch.no_grad()
@pytest.mark.parametrize("native", [True, False])
def test_adakv_heads_keep_different_lengths_and_match_masked_dense_attention(native, monkeypatch):
    """AdaKV's per-head lengths differ, are stored compactly, and the cache's next-token
    logits equal a dense eager forward of the whole sequence where the new token sees
    exactly the kept entries of each layer and head: decoding steps read the packed rows
    where they lie (the C++ step), or without the operators the padded layout."""
    from attnkit.kernels.cpu import kv as native_kv

    stepped = []
    original = native_kv.packed_attention
    monkeypatch.setattr(native_kv, "packed_attention", lambda *a: stepped.append(1) or original(*a))
    if not native:
        monkeypatch.setattr(native_kv, "available", lambda: False)
    elif not native_kv.available():
        pytest.skip("the C++ operators are unavailable")
    model = build("llama", "sdpa").double()  # the dense reference: torch SDPA in float64, per-layer masks
    cached = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=3, n=14, pads=(0, 2, 4))
    cache = kv.policy_cache(cached, "adakv", budget=0.4, window=2, kernel=3, floor=0.0)
    cached(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True)
    lengths = torch.stack([cache.lengths(i) for i in range(3)])
    assert (lengths[..., 0] != lengths[..., 1]).any(), lengths  # heads of one layer and row keep different counts
    for i in range(3):
        assert cache.layers[i].keys.shape[2] == int(cache.lengths(i).max())  # no longer than the longest head
    x = torch.tensor([[5, 6, 9], [7, 8, 2], [11, 3, 4]])  # three decoding steps (the mask is extended per step)
    full, got = mask, []
    for s in range(x.shape[1]):
        full = torch.cat([full, torch.ones(3, 1, dtype=mask.dtype)], 1)
        out = cached(x[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache, use_cache=True)
        got.append(out.logits[:, -1])
    got = torch.stack(got, 1)
    S = x.shape[1]
    assert len(stepped) == (S * 3 if native else 0)  # every layer's step, packed

    from eager_reference import LayerMasks, attention_layers, layer_window

    seq = torch.cat([ids, x], 1)
    N = seq.shape[1]
    masks = LayerMasks(model)
    try:
        real = full.bool()
        causal = torch.tril(torch.ones(N, N, dtype=torch.bool))
        for i, layer in enumerate(attention_layers(model)):
            m = (causal[None] & real[:, None, :]).clone()  # prompt rows: the model's own mask
            w = layer_window(layer)
            m = m[:, None].repeat(1, 4, 1, 1)
            kept = cache.kept_mask(i)[..., : N - S].repeat_interleave(2, 1)  # (B, Hq, prompt)
            assert cache.kept_mask(i)[..., N - S :].all()  # decoding evicts nothing
            m[:, :, -S:, : N - S] = kept[:, :, None, :]
            m[:, :, -S:, -S:] = torch.tril(torch.ones(S, S, dtype=torch.bool))
            if w is not None:
                q = torch.arange(N)
                m &= q[:, None] - q[None, :] < w
            masks.masks[i] = m | torch.eye(N, dtype=torch.bool)  # a padded query sees itself (no empty rows)
        want = model(seq, attention_mask=full, position_ids=positions(full)).logits[:, -S:]
    finally:
        masks.remove()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("streaming", {"sinks": 2}), ("h2o", {"recent": 0.4}), ("tova", {})])
def test_decoding_into_evicted_slots_keeps_the_reference_sets(name, params):
    """A token budget gives every row the same capacity, so each decoding step evicts one
    entry per head and the next token takes its slot (the layout leaves position order):
    the kept sets still follow the reference rule, step after step."""
    eager = build("llama", "eager").double()
    ids, mask = padded_batch(seed=5, n=12, pads=(0, 3, 5))
    steps = torch.randint(1, 97, (3, 8), generator=torch.Generator().manual_seed(6))
    budget = 5
    expected = simulate(
        eager, kv.POLICIES[name](**params), ids, mask, lambda layer, real: torch.full((len(real),), budget), steps
    )
    model = build("llama", "sdpa").double()
    cache = kv.policy_cache(model, name, budget=budget, **params)
    model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True)
    full, orders = mask, []
    for s in range(steps.shape[1] + 1):
        for layer, want in expected[s].items():
            assert torch.equal(cache.kept_mask(layer), want), f"{name} step {s} layer {layer}"
        orders.append(cache.layers[0].ordered)
        if s == steps.shape[1]:
            break
        full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], dim=1)
        model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache, use_cache=True)
    assert not all(orders)  # tokens did fill evicted slots
    assert {cache.layers[i].length for i in range(len(cache.layers))} == {budget + 1}
