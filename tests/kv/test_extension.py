"""Adding a KV policy is one class plus its registration: the cache routes by the
capabilities a policy declares, never by its name. Two toy policies defined here (not in
attnkit) run end to end with ``generate`` and are held to their literal ``reference`` on
eager weights, with no edit of the cache; and the cache's machinery names no policy."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from eager_reference import fraction_capacity, padded_batch, positions, simulate
from tiny_models import build

from attnkit import kv
from attnkit.kv.policies.base import Policy, Step
from attnkit.kv.select import group_mean, top

MACHINERY = ("cache.py", "hooks.py", "masks.py", "steps.py", "ring.py", "layer.py")


class GroupLeast(Policy):
    """Toy: whenever a layer holds more than its budget, each KV head drops the entries
    its query heads (their mean) attend to least from the current query: TOVA's rule per
    KV head instead of per layer. Reads weights, evicts while decoding."""

    name = "group-least"
    needs_weights = True
    decodes = True

    def rows(self, phase, q_len):
        return (q_len - 1, q_len)

    def select(self, step: Step) -> torch.Tensor:
        score = group_mean(step.mass, step.keys.shape[1]).to(torch.float64)
        return top(score, step.valid, step.capacity, step.order)

    def reference(self, weights, keys, held, capacity, state, phase):
        B, H, N = held.shape
        g = weights.shape[1] // H
        last = weights[:, :, -1].to(torch.float64).view(B, H, g, N).mean(2)
        keep = torch.zeros_like(held)
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (-float(last[b, h, j]), j))
                keep[b, h, idx[: int(capacity[b, h])]] = True
        return keep


class EvenFirst(Policy):
    """Toy: at prefill, keep the entries at even positions first (earliest first), then
    the odd ones, up to the budget; reads nothing, evicts nothing while decoding, holds
    its heads packed after the prefill."""

    name = "even-first"
    packs_heads = True

    def select(self, step: Step) -> torch.Tensor:
        odd = (step.pos % 2).to(torch.float64)
        return top(-odd, step.valid, step.capacity, step.order)

    def reference(self, weights, keys, held, capacity, state, phase):
        keep = torch.zeros_like(held)
        B, H, _ = held.shape
        for b in range(B):
            for h in range(H):
                idx = held[b, h].nonzero().flatten().tolist()
                idx.sort(key=lambda j: (j % 2, j))
                keep[b, h, idx[: int(capacity[b, h])]] = True
        return keep


@pytest.fixture
def registered(monkeypatch):
    for p in (GroupLeast, EvenFirst):
        monkeypatch.setitem(kv.POLICIES, p.name, p)


def test_the_cache_machinery_names_no_policy():
    root = pathlib.Path(kv.__file__).parent
    names = sorted(kv.POLICIES) + ["streamingllm", "heavy-hitter"]
    for file in MACHINERY:
        text = (root / file).read_text().lower()
        found = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]
        assert not found, f"kv/{file} names {found}: route by the policy's capabilities instead"


@torch.no_grad()
@pytest.mark.parametrize("policy", [GroupLeast, EvenFirst])
def test_a_toy_policy_keeps_what_its_reference_keeps(policy, registered):
    """Prefill and teacher-forced steps of a left-padded batch: the cache keeps, in every
    layer, what the toy's literal rule keeps on eager weights."""
    f = 0.5
    ids, mask = padded_batch(seed=21, n=12, pads=(0, 3, 5))
    steps = torch.randint(1, 97, (3, 4), generator=torch.Generator().manual_seed(22))
    eager = build("llama", "eager").double()
    expected = simulate(eager, policy(), ids, mask, fraction_capacity(f), steps)
    model = build("llama", "sdpa").double()
    cache = kv.policy_cache(model, policy.name, budget=f)
    model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True)
    full = mask
    for s in range(steps.shape[1] + 1):
        for layer, want in expected[s].items():
            assert torch.equal(cache.kept_mask(layer), want), f"{policy.name} step {s} layer {layer}"
        if s == steps.shape[1]:
            break
        full = torch.cat([full, torch.ones(3, 1, dtype=full.dtype)], dim=1)
        model(steps[:, s : s + 1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache, use_cache=True)
    assert model.config._attn_implementation == "sdpa"


@torch.no_grad()
@pytest.mark.parametrize("policy", [GroupLeast, EvenFirst])
def test_a_toy_policy_generates_with_generate(policy, registered):
    """``generate`` with the toy by name (its registration) and as an instance; at budget
    1.0 a policy that evicts at prefill alone keeps the full cache: the same tokens as
    transformers' own cache."""
    model = build("llama", "sdpa")
    ids, mask = padded_batch(seed=23, n=10, pads=(0, 2, 4))
    for cache in (kv.policy_cache(model, policy.name, budget=0.5), kv.policy_cache(model, policy(), budget=0.5)):
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape == (3, 14)
        assert int(cache.lengths(0).max()) <= 5 + (0 if policy.decodes else 4)
    if not policy.decodes:
        full = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        cache = kv.policy_cache(model, policy.name, budget=1.0)
        got = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(got, full)
