"""The hooks ``policy_cache`` installs on a model, and the switch that lets attnkit's
observers see a forward's attention weights.

A transformers cache only receives keys and values; the hooks hand a ``HookedCache``
the rest: the forward's padding (``begin_forward``), each attention call's inputs before
it runs (``before_attention``, which may rewrite the call's keyword arguments) and the
end of the call (``after_attention``) and of the forward (``end_forward``, always
called). They act only on forwards whose cache is a ``HookedCache``."""

from __future__ import annotations

from collections.abc import Callable

from .model_parts import attention_modules
from .step_attention import register as register_step_attention

HOOKS_ATTR = "_attnkit_kv_hooks"


class HookedCache:
    """What the hooks call on a cache (``PolicyCache`` implements it)."""

    def begin_forward(self, model, kwargs: dict) -> None:
        raise NotImplementedError

    def end_forward(self) -> None:
        raise NotImplementedError

    def before_attention(self, module, args: tuple, kwargs: dict) -> tuple:
        raise NotImplementedError

    def after_attention(self, module) -> None:
        raise NotImplementedError


def _cache_of(kwargs: dict) -> HookedCache | None:
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    return cache if isinstance(cache, HookedCache) else None


def _model_pre(model, args, kwargs):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.begin_forward(model, kwargs)


def _model_post(model, args, kwargs, output):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.end_forward()


def _attn_pre(module, args, kwargs):
    cache = _cache_of(kwargs)
    if cache is not None:
        return cache.before_attention(module, args, kwargs)
    return None


def _attn_post(module, args, kwargs, output):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.after_attention(module)


def install_hooks(model) -> None:
    """Hook ``model`` once; the hooks act only on forwards whose cache is a HookedCache."""
    register_step_attention()
    if getattr(model, HOOKS_ATTR, None):
        return
    handles = [
        model.register_forward_pre_hook(_model_pre, with_kwargs=True),
        model.register_forward_hook(_model_post, with_kwargs=True, always_call=True),
    ]
    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(_attn_pre, with_kwargs=True))
        handles.append(m.register_forward_hook(_attn_post, with_kwargs=True))
    object.__setattr__(model, HOOKS_ATTR, handles)


def detach(model) -> None:
    """Remove the hooks ``policy_cache`` installed on ``model`` (policy caches then stop
    working with it)."""
    for handle in getattr(model, HOOKS_ATTR, None) or ():
        handle.remove()
    if hasattr(model, HOOKS_ATTR):
        object.__delattr__(model, HOOKS_ATTR)


def outer_switch(module):
    """The ``attnkit.hf.use`` block the module runs in, or None."""
    from ..hf.switch import active_switch

    return active_switch(module)[0]


def observe(model, scorer) -> Callable[[], object]:
    """Run the model's attention through attnkit with ``scorer`` watching; returns the
    function that undoes it. Inside an ``attnkit.hf.use`` block the scorer joins it."""
    from ..hf.switch import active_switch, use

    modules = attention_modules(model)
    outer, _ = active_switch(modules[0])
    if outer is not None:
        before = outer.observers
        outer.observers = list(before or []) + [scorer]

        def undo():
            outer.observers = before

        return undo
    ctx = use(model, observers=[scorer])
    ctx.__enter__()
    return lambda: ctx.__exit__(None, None, None)
