"""One generation with a policy cache beside the same generation with transformers'
full ``DynamicCache``: the tokens of each, where they first differ, and the bytes each
cache holds at the end (what ``attnkit kv`` prints and the kv benchmark measures)."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from . import policy_cache


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        # attention layers: transformers' union also names linear-attention layers (no keys), which these models lack
        for t in (layer.keys, layer.values):  # type: ignore[union-attr]
            if t is not None:
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def compare(model, input_ids, attention_mask=None, *, policy: str, budget, max_new_tokens: int = 16, **params) -> dict:
    """Greedy generation of ``input_ids`` (B, N) with the full cache and with ``policy``.

    Returns a dict: ``full`` and ``policy`` token lists (new tokens per row),
    ``first_difference`` (per row: index of the first differing new token, or None),
    ``full_bytes`` and ``policy_bytes`` (keys and values held after generating),
    ``policy_bytes_all`` (with the bookkeeping), ``kept`` (per layer, the mean entries
    per KV head), ``seconds`` (full, policy)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    cache = policy_cache(model, policy, budget=budget, **params)
    pad = getattr(model.generation_config, "pad_token_id", None)
    gen = dict(
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0 if pad is None else pad,
    )
    n = input_ids.shape[1]
    full_cache = DynamicCache()
    t0 = time.perf_counter()
    full = model.generate(input_ids, cache=full_cache, **gen)[:, n:]
    t1 = time.perf_counter()
    pruned = model.generate(input_ids, cache=cache, **gen)[:, n:]
    t2 = time.perf_counter()
    differ = []
    for a, b in zip(full.tolist(), pruned.tolist()):
        where = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        differ.append(where[0] if where else None)
    return {
        "policy": repr(cache.policy),
        "budget": budget,
        "full": full.tolist(),
        "pruned": pruned.tolist(),
        "first_difference": differ,
        "full_bytes": dynamic_cache_bytes(full_cache),
        "policy_bytes": cache.kv_nbytes(),
        "policy_bytes_all": cache.nbytes(),
        "kept": [float(cache.lengths(i).float().mean()) for i in range(len(cache.layers))],
        "seconds": [t1 - t0, t2 - t1],
    }
