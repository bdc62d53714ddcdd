"""Key-norm eviction (arXiv 2406.11430) breaks ties as documented: equal keys have equal
norms, and the earlier position stays. A token repeated through a float32 prompt gives
equal keys in the first layer; once rotated by RoPE and rounded their norms differ in
the last bits, which must not decide. The reference ranks float64 norms of the keys
projected in float64 (before RoPE), ties to the earlier position."""

import torch
from tiny_models import build

import attnkit.kv as kv


def reference_kept(model, ids, budget: int) -> tuple[list[list[int]], torch.Tensor]:
    """Positions the first layer keeps per KV head (the ``budget`` lowest norms), and the
    norms (N, Hkv)."""
    attn = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)).double()
    keys = torch.nn.functional.linear(hidden, attn.k_proj.weight.double())[0].view(ids.shape[1], -1, attn.head_dim)
    norms = keys.norm(dim=-1)  # (N, Hkv)
    kept = []
    for h in range(norms.shape[1]):
        order = sorted(range(ids.shape[1]), key=lambda j: (float(norms[j, h]), j))
        kept.append(sorted(order[:budget]))
    return kept, norms


@torch.no_grad()
def test_equal_keys_keep_the_earlier_positions():
    model = build("llama", "sdpa")  # float32: rotated keys are rounded to 24 bits
    ids = torch.tensor([[5, 7, 5, 5, 9, 5, 5, 11, 5, 5, 5, 13, 5, 5, 5, 5, 17, 5, 5, 5]])
    budget = 10
    want, norms = reference_kept(model, ids, budget)
    # the cut falls inside the repeated token's tie in every head: the rule decides there
    for h, kept in enumerate(want):
        tie = [j for j in range(ids.shape[1]) if ids[0, j] == 5]
        assert any(j in kept for j in tie) and not all(j in kept for j in tie), h
        assert len({float(norms[j, h]) for j in tie}) == 1  # exactly equal before RoPE
    cache = kv.policy_cache(model, "knorm", budget=budget)
    model(ids, cache=cache)
    assert cache.kept_positions(0)[0] == want
