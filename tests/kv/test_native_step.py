"""The C++ decoding step of H2O and TOVA (``kernels.cpu.kv``): evicting the lowest-scoring
entry per (row, KV head) must keep exactly what the policies' PyTorch ``select`` keeps
(the tie rule included, on layouts that are not in position order), and writing the
next token into the evicted slot must equal the scatter it replaces; end to end, the
kept sets and logits equal the PyTorch path's through many steps."""

import pytest
import torch
from eager_reference import padded_batch, positions
from tiny_models import build

import attnkit.kv as kv
from attnkit.kernels import cpu
from attnkit.kernels.cpu import kv as native_kv
from attnkit.kv.policies import POLICIES
from attnkit.kv.policies.base import Step

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"operators unavailable: {cpu.status().reason}")


def _layout(g, B, H, Hq, L, dtype, holes):
    """Shuffled positions, a few empty slots, weights on a 1/8 grid (exact sums: real ties)."""
    pos = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).view(B, H, L)
    valid = torch.ones(B, H, L, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            valid[b, h, torch.randperm(L, generator=g)[: holes[(b * H + h) % len(holes)]]] = False
    mass = (torch.randint(0, 4, (B, Hq, L), generator=g) / 8).to(dtype)
    return mass, valid, pos


@pytest.mark.parametrize("name,params", [("tova", {}), ("h2o", {}), ("h2o", {"recent": 0.25}), ("h2o", {"recent": 1.0})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_operator_keeps_what_select_keeps(name, params, dtype):
    g = torch.Generator().manual_seed(7)
    policy = POLICIES[name](**params)
    B, H, Hq, L = 3, 2, 8, 13
    for trial in range(40):
        holes = (0, 1, 3, 2)
        mass, valid, pos = _layout(g, B, H, Hq, L, dtype, holes)
        held = valid.sum(-1)
        # one over the capacity (a decoding step), exactly at it, or under it
        # one over the capacity everywhere (a decoding step), or per head one over, at it or under it
        over = torch.ones(B, H, dtype=torch.long) if trial % 3 == 0 else torch.randint(-1, 2, (B, H), generator=g)
        capacity = (held - over).clamp(min=0)
        score = torch.randint(0, 6, (B, H, L), generator=g).double() / 4
        step = Step(0, 1, "decode", torch.zeros(B, H, L, 4), valid.clone(), pos, capacity, mass, score.clone(), L, None, pos)
        keep = policy.select(step)
        v, s = valid.clone(), score.clone()
        slot, fewest, most = native_kv.evict_lowest(mass, v, pos, capacity, s if name == "h2o" else None, *policy.lowest_rule)
        assert torch.equal(v, valid & keep), trial
        if name == "h2o":
            assert torch.equal(s, step.score), trial  # the accumulated score, every slot
        gone = valid & ~keep
        assert torch.equal(slot, torch.where(gone.any(-1), gone.to(torch.uint8).argmax(-1), -1)), trial
        assert (fewest, most) == tuple(int(x) for x in v.sum(-1).aminmax())


def test_operator_leaves_a_layer_over_by_two_unchanged():
    g = torch.Generator().manual_seed(1)
    mass, valid, pos = _layout(g, 1, 2, 4, 9, torch.float32, (0,))
    v = valid.clone()
    slot, _, _ = native_kv.evict_lowest(mass, v, pos, torch.tensor([[8, 7]]), None, native_kv.TOVA)
    assert slot is None and torch.equal(v, valid)


def test_fill_writes_what_the_scatter_writes():
    """Into views of larger storage (the cache's rooms), each head's first empty slot."""
    g = torch.Generator().manual_seed(2)
    B, H, L, D = 2, 3, 7, 5
    room = torch.randn(B, H, L + 4, D, generator=g)
    keys, values = room[:, :, :L], torch.randn(B, H, L, D, generator=g)
    valid = torch.rand(B, H, L, generator=g) > 0.3
    valid[:, :, 2] = False  # every head has a hole
    pos, rope = torch.randint(0, 50, (2, B, H, L), generator=g)
    score = torch.rand(B, H, L, generator=g).double()
    k_new, v_new = torch.randn(2, B, H, 1, D, generator=g)
    rope_new = torch.tensor([40, 41])
    want = [t.clone() for t in (keys, values, valid, pos, rope, score)]
    past_view = room[:, :, L:].clone()
    slot = (~valid).to(torch.uint8).argmax(-1, keepdim=True)
    want[0].scatter_(2, slot[..., None].expand(B, H, 1, D), k_new)
    want[1].scatter_(2, slot[..., None].expand(B, H, 1, D), v_new)
    want[2].scatter_(2, slot, True)
    want[3].scatter_(2, slot, 60)
    want[4].scatter_(2, slot, rope_new[:, None, None].expand(B, H, 1))
    want[5].scatter_(2, slot, 0.0)
    native_kv.fill_hole(keys, values, valid, pos, rope, score, k_new, v_new, rope_new, 60)
    for got, expected in zip((keys, values, valid, pos, rope, score), want):
        assert torch.equal(got, expected)
    assert torch.equal(room[:, :, L:], past_view)  # nothing written past the view
    full = torch.ones(1, 1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="no empty slot"):
        native_kv.fill_hole(
            torch.zeros(1, 1, 3, 2),
            torch.zeros(1, 1, 3, 2),
            full,
            torch.zeros(1, 1, 3, dtype=torch.long),
            None,
            None,
            torch.zeros(1, 1, 1, 2),
            torch.zeros(1, 1, 1, 2),
            torch.tensor([0]),
            3,
        )


@torch.no_grad()
@pytest.mark.parametrize("name,params", [("h2o", {}), ("tova", {})])
def test_decoding_with_the_operators_equals_the_pytorch_path(name, params, monkeypatch):
    """A padded batch of 3 decoded 30 steps (one eviction each, slots refilled, gathers
    after 16 holes): the same kept sets and logits with and without the operators."""
    model = build("llama", "sdpa").double()
    prompt, mask = padded_batch(seed=3, n=10, pads=(0, 2, 5))
    forced = torch.randint(1, 97, (3, 30), generator=torch.Generator().manual_seed(6))

    def run():
        cache = kv.policy_cache(model, name, budget=6, **params)
        outs, kept, full = [model(prompt, attention_mask=mask, position_ids=positions(mask), cache=cache).logits], [], mask
        for s in range(forced.shape[1]):
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            outs.append(
                model(forced[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits
            )
            kept.append([cache.kept_positions(i) for i in range(len(cache.layers))])
        return torch.cat(outs, 1), kept

    calls = {"evict": 0, "fill": 0}
    for op in ("evict_lowest", "fill_hole"):
        real = getattr(native_kv, op)

        def counted(*a, _real=real, _op=op, **k):
            calls["evict" if _op == "evict_lowest" else "fill"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(native_kv, op, counted)
    native, native_kept = run()
    assert calls["evict"] > 0 and calls["fill"] > 0  # the operators ran
    monkeypatch.setattr(native_kv, "available", lambda: False)
    torch_path, torch_kept = run()
    assert native_kept == torch_kept
    # float64, same entries. At the prompt's padding positions the outputs are unused and
    # differ by design (H2O's fused prefill lets a padding query see itself, sdpa follows
    # transformers' mask for an empty row), so only real positions are compared
    real = torch.cat([mask, torch.ones(3, forced.shape[1], dtype=mask.dtype)], 1).bool()
    torch.testing.assert_close(native[real], torch_path[real], atol=1e-10, rtol=1e-10)


def _dense_step(q, keys, values, visible, scale):
    """softmax(q k^T * scale | visible) v for one query per head, GQA by repeating heads."""
    g = q.shape[1] // keys.shape[1]
    logits = (q * scale) @ keys.repeat_interleave(g, 1).transpose(-1, -2)  # (B, Hq, 1, L)
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    return (logits.softmax(-1) @ values.repeat_interleave(g, 1)).transpose(1, 2)  # (B, 1, Hq, Dv)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_packed_attention_equals_dense_attention_over_the_kept_entries(dtype, tol):
    from attnkit.kv.packed import PackedKV

    g = torch.Generator().manual_seed(3)
    B, Hq, H, L, D, Dv = 2, 8, 2, 41, 32, 24
    keys, values = torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, H, L, Dv, generator=g, dtype=dtype)
    valid = torch.rand(B, H, L, generator=g) > 0.4  # heads of different lengths
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=dtype)
    packed = PackedKV(keys, values, valid)
    packed.append(keys[:, :, :1], values[:, :, :1])  # a token every head receives, at the end of the rows
    visible = torch.cat([valid, torch.ones(B, H, 1, dtype=torch.bool)], -1).repeat_interleave(Hq // H, 1)
    want = _dense_step(q, torch.cat([keys, keys[:, :, :1]], 2), torch.cat([values, values[:, :, :1]], 2), visible, 0.3)
    got = native_kv.packed_attention(q, packed.k, packed.v, packed.source, packed.empty_row, 0.3)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)  # float32: exp and sums over 42 entries
    with pytest.raises(RuntimeError, match="outside the"):
        native_kv.packed_attention(q, packed.k[:3], packed.v[:3], packed.source, packed.empty_row, 0.3)


@pytest.mark.parametrize("heads", ["query", "group"])
@pytest.mark.parametrize("cached", [37, 36])  # an incomplete last page, and none (the next key opens a page)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_quest_attention_chooses_pages_attends_and_folds_as_the_pytorch_rule(heads, cached, dtype, tol):
    from attnkit.kv.policies.quest import page_choice, page_extremes

    g = torch.Generator().manual_seed(4)
    B, Hq, H, D, size = 2, 8, 2, 16, 4
    keys = torch.randn(B, H, cached + 1, D, generator=g, dtype=dtype)
    values = torch.randn(B, H, cached + 1, D, generator=g, dtype=dtype)
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=dtype)
    budget = torch.tensor([16, 9])  # 4 and 3 pages
    every = torch.ones(B, H, cached, dtype=torch.bool)
    extremes = page_extremes(keys[:, :, :cached], every, size)
    room = [torch.cat([t, torch.zeros_like(t[:, :, :2])], 2) for t in extremes]  # space for the page after
    out, chosen = native_kv.quest_attention(q, keys, values, *room, budget, size, cached, heads == "group", 0.3, True)
    want_pages = page_choice(q, every, budget, size, extremes, heads == "group")[:, :, 0]
    assert torch.equal(chosen, want_pages)
    pages = want_pages.repeat_interleave(Hq // chosen.shape[1], 1)
    visible = torch.cat([pages.repeat_interleave(size, -1)[..., :cached], torch.ones(B, Hq, 1, dtype=torch.bool)], -1)
    torch.testing.assert_close(out, _dense_step(q, keys, values, visible, 0.3), atol=tol, rtol=tol)
    after = page_extremes(keys, torch.ones(B, H, cached + 1, dtype=torch.bool), size)  # the new key folded in
    for stored, fresh in zip(room, after):
        assert torch.equal(stored[:, :, : fresh.shape[2]], fresh)


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_step_attention_returns_the_output_and_weights_of_dense_attention(hidden, dtype, tol):
    """Over the slots of views into larger storage (the cache's rooms), some hidden."""
    g = torch.Generator().manual_seed(5)
    B, Hq, H, L, D = 2, 8, 2, 45, 32
    keys = torch.randn(B, H, L + 5, D, generator=g, dtype=dtype)[:, :, :L]
    values = torch.randn(B, H, L + 5, D, generator=g, dtype=dtype)[:, :, :L]
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=dtype)
    hide = (torch.rand(B, H, L, generator=g) < 0.3) if hidden else None
    visible = torch.ones(B, Hq, L, dtype=torch.bool) if hide is None else ~hide.repeat_interleave(Hq // H, 1)
    out, weights = native_kv.step_attention(q, keys, values, hide, 0.2)
    torch.testing.assert_close(out, _dense_step(q, keys, values, visible, 0.2), atol=tol, rtol=tol)
    logits = ((q * 0.2) @ keys.repeat_interleave(Hq // H, 1).transpose(-1, -2))[:, :, 0]
    want = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, want, atol=tol, rtol=tol)
    assert not bool(weights[~visible].any())  # a hidden slot receives nothing
    every = torch.ones(B, H, L, dtype=torch.bool)
    out, weights = native_kv.step_attention(q, keys, values, every, 0.2)  # nothing visible: zeros, not NaN
    assert not bool(out.any()) and not bool(weights.any())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_prefill_attention_returns_causal_attention_and_the_mass_each_key_receives(dtype, tol):
    """Two rows, the second left-padded over its first 9 positions: a real query sees the
    real keys up to itself, a padding query itself alone, and only real queries give mass."""
    g = torch.Generator().manual_seed(6)
    B, Hq, H, N, D, Dv = 2, 8, 2, 75, 16, 24
    q = torch.randn(B, Hq, N, D, generator=g, dtype=dtype)
    k, v = torch.randn(B, H, N, D, generator=g, dtype=dtype), torch.randn(B, H, N, Dv, generator=g, dtype=dtype)
    start = torch.tensor([0, 9])
    out, mass = native_kv.prefill_attention(q, k, v, 0.25, start)
    j = torch.arange(N)
    real = j[None, :] >= start[:, None]  # (B, N)
    sees = (j[:, None] >= j[None, :]) & real[:, None, :] & real[:, :, None] | torch.eye(N, dtype=torch.bool)
    logits = (q * 0.25) @ k.repeat_interleave(Hq // H, 1).transpose(-1, -2)
    weights = logits.masked_fill(~sees[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (weights @ v.repeat_interleave(Hq // H, 1)).transpose(1, 2), atol=tol, rtol=tol)
    assert mass.dtype == torch.float64
    received = (weights * real[:, None, :, None]).sum(2).double()  # padding queries give nothing
    # column sums of up to N weights: float32 rounding grows with the count
    torch.testing.assert_close(mass, received, atol=N * tol, rtol=tol)
    assert not bool(mass[1, :, :9].any())  # no real query sees the padding


@torch.no_grad()
@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_h2o_prefill_with_the_fused_pass_keeps_the_reference_sets(model_name, monkeypatch):
    """An unpadded batch: H2O's prefill runs its attention and mass in one C++ pass; the
    kept sets equal the paper's rule on eager weights (prefill, then three steps), and the
    prefill's logits equal the model's own."""
    from eager_reference import fraction_capacity, simulate

    ids = torch.randint(1, 97, (2, 23), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    steps = torch.randint(1, 97, (2, 3), generator=torch.Generator().manual_seed(9))
    policy = kv.POLICIES["h2o"](recent=0.5)
    expected = simulate(build(model_name, "eager").double(), policy, ids, mask, fraction_capacity(0.4), steps)
    model = build(model_name, "sdpa").double()
    called = []
    original = native_kv.prefill_attention
    monkeypatch.setattr(native_kv, "prefill_attention", lambda *a: called.append(1) or original(*a))
    cache = kv.policy_cache(model, "h2o", budget=0.4, recent=0.5)
    logits = model(ids, attention_mask=mask, cache=cache).logits
    # the fused pass in every layer without a sliding window (qwen2's two windowed layers take the other path)
    from attnkit.kv.model_parts import attention_modules, sliding_window

    assert len(called) == sum(sliding_window(m) is None for m in attention_modules(model)) > 0
    torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits, atol=1e-10, rtol=1e-10)
    full = mask
    for s in range(steps.shape[1] + 1):
        for layer, want in expected[s].items():
            assert torch.equal(cache.kept_mask(layer), want), (s, layer)
        if s < steps.shape[1]:
            full = torch.cat([full, torch.ones(2, 1, dtype=full.dtype)], 1)
            model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache)


@torch.no_grad()
@pytest.mark.parametrize("name", ["h2o", "tova", "adakv", "quest"])
def test_a_bf16_model_takes_the_pytorch_path(name, monkeypatch):
    """The attention operators take float32 and float64: a bf16 model's steps (a padded
    batch, so that AdaKV packs its heads) never reach them (the eviction and the slot fill
    run, on float32 weights and bytes) and generate as with the operators off."""
    model = build("llama", "sdpa").to(torch.bfloat16)
    prompt, mask = padded_batch(seed=3, n=24, pads=(0, 2, 5))
    reached = []
    for op in ("step_attention", "prefill_attention", "packed_attention", "quest_attention"):
        monkeypatch.setattr(native_kv, op, lambda *a, _op=op: reached.append(_op))

    def generate():
        cache = kv.policy_cache(model, name, budget=0.5, **({"dense_layers": 1} if name == "quest" else {}))
        return model.generate(prompt, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)

    tokens = generate()
    assert not reached
    monkeypatch.setattr(native_kv, "available", lambda: False)
    assert torch.equal(tokens, generate())
