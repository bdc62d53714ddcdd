"""Quest (arXiv 2406.10774): the page bound is an upper bound of every true logit in the
page; the page selection equals the literal rule; nothing is evicted; a decoding step
equals dense attention restricted to the selected pages."""

import pytest
import torch
from eager_reference import LayerMasks, attention_layers, padded_batch, positions
from tiny_models import build

import attnkit.kv as kv
from attnkit.kernels.cpu import kv as native_kv
from attnkit.kv.policies import Quest, page_bounds, page_extremes, page_mask


def test_page_bound_is_an_upper_bound_of_every_logit_in_the_page():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Nq, L, D, P = 2, 4, 2, 3, 21, 8, 4
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64) * 3
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) * 2
    valid = torch.rand(B, Hkv, L, generator=g) > 0.3
    kmin, kmax, has = page_extremes(k, valid, P)
    bound = page_bounds(q, kmin, kmax)  # (B, Hq, Nq, pages)
    checked = 0
    for b in range(B):
        for h in range(Hq):
            entries = valid[b, h // 2].nonzero().flatten().tolist()  # pages are cut over the entries held
            for i in range(Nq):
                for r, j in enumerate(entries):
                    logit = float((q[b, h, i] * k[b, h // 2, j]).sum())
                    assert logit <= float(bound[b, h, i, r // P]) + 1e-12
                    checked += 1
    assert checked > 100
    # and the bound is attained by some channel pattern: it is the max over the box's corners
    b, h, i, p = 0, 1, 2, 2
    members = valid[b, 0].nonzero().flatten().tolist()[p * P : (p + 1) * P]
    lo = torch.stack([k[b, 0, j] for j in members]).min(0).values
    hi = torch.stack([k[b, 0, j] for j in members]).max(0).values
    corner = torch.where(q[b, h, i] > 0, hi, lo)
    torch.testing.assert_close(bound[b, h, i, p], (q[b, h, i] * corner).sum(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("heads", ["query", "group"])
@pytest.mark.parametrize("L", [19, 18])  # an incomplete last page (always read), and none
def test_page_selection_equals_the_literal_rule(heads, L):
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, Nq, D = 2, 4, 2, 2, 6
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    valid = torch.rand(B, Hkv, L, generator=g) > 0.25
    tokens = torch.tensor([7, 10])
    policy = Quest(page_size=3, heads=heads)
    got = page_mask(q, k, valid, tokens, 3, per_group=policy.per_group)
    assert torch.equal(got, policy.reference_pages(q, k, valid, tokens))
    if heads == "group":  # the query heads of a KV head read the same pages
        assert torch.equal(got[:, 0::2], got[:, 1::2])


@torch.no_grad()
@pytest.mark.parametrize(
    "rows,heads,native",
    [(3, "query", True), (1, "query", True), (1, "query", False), (1, "group", True), (1, "group", False), (3, "group", True)],
)
def test_decoding_step_equals_dense_attention_on_the_selected_pages(rows, heads, native, monkeypatch):
    """Three padded rows take the masked path; one row of 17 tokens (an incomplete last
    page) runs the C++ step over the pages where they lie, or without the operators
    gathers each head's pages: all equal the literal rule's dense attention."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=9, n=16, pads=(0, 3, 5))
    if rows == 1:
        ids, mask = torch.cat([ids[:1], ids[:1, :1]], 1), torch.ones(1, 17, dtype=mask.dtype)
    gathered, stepped = [], []
    original = Quest.read_slots
    monkeypatch.setattr(Quest, "read_slots", lambda *a: gathered.append(original(*a)) or gathered[-1])
    original_step = native_kv.quest_attention
    monkeypatch.setattr(native_kv, "quest_attention", lambda *a: stepped.append(original_step(*a)) or stepped[-1])
    if not native:
        monkeypatch.setattr(native_kv, "available", lambda: False)
    elif not native_kv.available():
        pytest.skip("the C++ operators are unavailable")
    cache = kv.policy_cache(model, "quest", budget=4, page_size=2, dense_layers=1, heads=heads)
    model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    before = cache.kv_nbytes()
    if rows == 3:
        assert [int(cache.lengths(0)[b, 0]) for b in range(3)] == [16, 13, 11]  # only padding goes

    captured = {}
    hooks = [
        a.register_forward_pre_hook(
            lambda m, a_, kw: captured.__setitem__(m.layer_idx, (kw["hidden_states"], kw["position_embeddings"])),
            with_kwargs=True,
        )
        for a in attention_layers(model)
    ]
    x = torch.tensor([[3], [4], [5]])[:rows]
    full = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], 1)
    got = model(x, attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits[:, -1]
    for h in hooks:
        h.remove()
    assert cache.kv_nbytes() > before  # nothing evicted: the cache only grew
    if rows == 1 and native:  # the C++ step in every paged layer, which chose as many pages as the budget allows
        assert not gathered and len(stepped) == len(cache.layers) - 1
        assert stepped[0][1].sum(-1).unique().tolist() == [2]
    else:
        assert not stepped and gathered and all((slots is not None) == (rows == 1) for slots in gathered)

    # The reference: each layer's queries from its inputs (q_proj, RoPE), the literal page
    # rule on the keys held before the step, and dense attention over those entries.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    policy = Quest(page_size=2, dense_layers=1, heads=heads)
    seq = torch.cat([ids, x], 1)
    N = seq.shape[1]
    real = full.bool()
    j = torch.arange(N)
    masks = LayerMasks(model)
    try:
        for layer in attention_layers(model):
            i = layer.layer_idx
            see = ((j[:, None] >= j[None, :])[None] & real[:, None, :]) | torch.eye(N, dtype=torch.bool)
            see = see[:, None].repeat(1, 4, 1, 1)
            B = see.shape[0]
            if i >= policy.dense_layers:
                hidden, (cos, sin) = captured[i]
                q = layer.q_proj(hidden).view(B, 1, 4, 16).transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                lay = cache.layers[i]
                held = lay.valid.clone()
                held[..., -1] = held[..., -1] & (lay.pos[..., -1] < N - 1)  # entries before the step
                L = lay.length - 1
                chosen = policy.reference_pages(q, lay.keys[:, :, :L], held[:, :, :L], torch.tensor([4] * B))
                row = torch.zeros(B, 4, N, dtype=torch.bool)
                for b in range(B):
                    for h in range(4):
                        row[b, h, lay.pos[b, h // 2, :L][chosen[b, h, 0]]] = True
                row[:, :, -1] = True
                see[:, :, -1] = row
            masks.masks[i] = see
        want = model(seq, attention_mask=full, position_ids=positions(full)).logits[:, -1]
    finally:
        masks.remove()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@torch.no_grad()
@pytest.mark.parametrize("pads", [(0, 2, 3), (0, 0, 0)])
def test_page_extremes_kept_between_steps_equal_a_fresh_computation(pads):
    """The page extremes a layer keeps (only the pages touched by new tokens are
    recomputed; the C++ step of unpadded rows folds each new key in instead)
    equal page_extremes over the slots held, across page boundaries, and the
    teacher-forced logits equal those of recomputing every step."""
    model = build("llama", "sdpa").double()
    ids, mask = padded_batch(seed=11, n=10, pads=pads)
    forced = torch.randint(1, 97, (3, 7), generator=torch.Generator().manual_seed(12))

    def run(forget):
        cache = kv.policy_cache(model, "quest", budget=4, page_size=3, dense_layers=1)
        out = [model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache).logits]
        full = mask
        for s in range(forced.shape[1]):
            if forget:
                for lay in cache.layers:
                    lay.memo = {}
            full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], 1)
            out.append(model(forced[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache).logits)
            for lay in cache.layers[1:]:
                kmin, kmax, has, size, upto = lay.memo["quest_pages"]
                # the masked path computes them before the step's token came; the C++ step adds it
                assert size == 3 and upto == lay.length - (1 if any(pads) or not native_kv.available() else 0)
                fresh = page_extremes(lay.keys[:, :, :upto], lay.valid[:, :, :upto], 3)
                for a, b in zip((kmin, kmax, has), fresh):
                    assert torch.equal(a[:, :, : b.shape[2]], b)
        return torch.cat(out, 1)

    torch.testing.assert_close(run(False), run(True), atol=0, rtol=0)
