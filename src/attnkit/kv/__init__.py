"""KV-cache policies as transformers caches.

    cache = attnkit.kv.policy_cache(model, "snapkv", budget=0.5)
    model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20)

Each policy cites its paper and has a ``reference`` rule written from it, which the tests
hold the cache to. Heads keep different numbers of entries, stored compactly, so the
bytes held (``cache.nbytes()``) fall with the budget; scores that need attention weights
come from attnkit's observers on the query rows involved, never ``output_attentions``.
"""

from __future__ import annotations

from ..extras import require

require("transformers", "attnkit.kv")  # the [hf] extra; named in the error when missing

from .budget import check_budget
from .cache import PolicyCache
from .hooks import detach, install_hooks
from .model_parts import attention_modules, can_recompute_queries, rotary_module
from .policies import POLICIES, Policy

__all__ = ["POLICIES", "Policy", "PolicyCache", "compare", "detach", "policy_cache"]


def policy_cache(model, policy: str | Policy, budget: float | int = 0.5, **params) -> PolicyCache:
    """A transformers ``Cache`` that keeps, in every layer, what ``policy`` selects.

    Args:
        model: a transformers causal LM (Llama, Mistral, Qwen2/3, ...) in eval mode.
        policy: a name in ``POLICIES`` (streaming, h2o, snapkv, tova, quest, pyramid, adakv,
            knorm, selective) or a ``Policy`` instance.
        budget: a fraction of each row's prompt in (0, 1] or a token count >= 1, per layer
            and KV head (PyramidKV spreads it over depth, AdaKV over a layer's heads).
        params: the policy's parameters (e.g. ``sinks=4`` for streaming, ``window=32``
            for snapkv); an unknown one is a ValueError naming it.

    Hooks are installed on ``model`` once (``attnkit.kv.detach(model)`` removes them);
    they act only when the forward's cache is a policy cache. The prompt may be
    left-padded: padded entries are never kept.
    """
    from transformers import PreTrainedModel

    if isinstance(policy, Policy):
        if params:
            raise ValueError(f"{sorted(params)[0]}: parameters go to the Policy instance itself, not to policy_cache")
        chosen = policy
    elif isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        chosen = POLICIES[policy](**params)
    else:
        raise ValueError(f"policy: expected a policy name or a Policy, got {type(policy).__name__}")
    spec = check_budget(budget)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"model: {type(model).__name__} has no attention layers that use a KV cache (modules with a layer_idx)")
    if chosen.needs_weights:
        from ..hf.switch import check_model

        try:
            check_model(model)
        except ValueError as e:
            raise ValueError(
                f"model: policy {chosen.name!r} reads attention weights through attnkit, which cannot switch this model ({e})"
            ) from None
    else:
        impl = model.config._attn_implementation
        if impl not in ("eager", "sdpa", "attnkit"):
            raise ValueError(
                f"model: attn_implementation {impl!r} cannot take per-head cache masks; load the model with 'sdpa' or 'eager'"
            )
    if chosen.recomputes_queries and not all(can_recompute_queries(m) for m in modules):
        raise ValueError(
            f"policy: {chosen.name!r} recomputes each layer's queries (q_proj + RoPE), which {type(modules[0]).__name__} does not expose"
        )
    if chosen.rerotates_keys and rotary_module(model) is None:
        raise ValueError(
            "positions: 'cache' re-rotates keys with the model's RoPE, and this model has no rotary embedding module"
        )
    cache = PolicyCache(model, chosen, spec, len(modules))
    install_hooks(model)
    return cache


from .compare import compare  # noqa: E402  (uses policy_cache)
