"""``attnkit.hf.use``: switch a loaded transformers model to attnkit, and back.

attnkit registers one attention function and one mask function, both named "attnkit".
The mask function matters as much as the attention function: transformers builds masks
only for implementations that have one, and silently passes ``attention_mask=None``
otherwise, so padding and causal masking would vanish. ``use`` sets the model's
``attn_implementation`` to "attnkit" for its duration and records, for every submodule,
what the switch asks for; on exit (also after an exception) the previous implementation
and any enclosing switch come back.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..mechanisms import Mechanism, build_mechanism, get_mechanism
from ..mods import Mask, ScoreMod, as_mask, as_score

Tensor = torch.Tensor
NAME = "attnkit"

# Module -> the switch in force for the model it belongs to.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register() -> None:
    """Register attnkit's attention and mask functions in transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import attnkit_attention_forward
    from .masks import mask_spec

    AttentionInterface.register(NAME, attnkit_attention_forward)
    AttentionMaskInterface.register(NAME, mask_spec)


@dataclass
class Switch:
    """What ``use`` asked for; yielded by the context manager.

    ``mechanisms`` holds the mechanism built for each layer (one instance per layer, so a
    mechanism with learnable parameters keeps them per layer)."""

    model: nn.Module
    mechanism: str | Mechanism
    params: dict
    mask: Mask | None
    score: ScoreMod | None
    layers: frozenset[int] | None
    heads: tuple[int, ...] | None
    observers: list | None
    sinks: Tensor | Mapping[int, Tensor] | None
    mechanisms: dict[int | None, Mechanism] = field(default_factory=dict)
    #: True when the mechanism is softmax: attnkit's exact kernels run it directly
    plain: bool = False
    #: the model's context length (config ``max_position_embeddings``), given to mechanisms
    #: that take ``context`` (sigmoid's n, cosFormer's horizon)
    context: int | None = None
    #: per layer, (state, tokens seen) a ``cache_state`` mechanism left after its last call
    decode_states: dict[int | None, tuple[Tensor, int]] = field(default_factory=dict)
    _layer_of: dict[int, int] = field(default_factory=dict)
    #: a torch.distributed group: every attention call is sharded over it by sequence
    #: (attnkit.distributed), with ``context_layout`` cutting the sequence
    context_parallel: object = None
    context_layout: str = "zigzag"

    def applies_to(self, layer: int | None) -> bool:
        return self.layers is None or layer in self.layers

    def mechanism_for(self, layer: int | None, q: Tensor, k: Tensor, v: Tensor) -> Mechanism | None:
        """The layer's mechanism for a call on q, k, v, or None for plain softmax
        (attnkit's exact kernels). A named one is built on the layer's first call, with
        the call's sizes when its constructor takes them (as attnkit.nn layers do)."""
        if self.plain:
            return None
        if isinstance(self.mechanism, Mechanism):
            return self.mechanism
        if layer not in self.mechanisms:
            mech = build_mechanism(self.mechanism, self.params, q.shape[1], q.shape[-1], k.shape[1], v.shape[-1], self.context)
            # Parameters follow the model's device and float dtype.
            self.mechanisms[layer] = mech.to(device=q.device, dtype=q.dtype)
        return self.mechanisms[layer]

    def decode_state_before(self, layer: int | None, batch: int, past: int, name: str) -> Tensor | None:
        """The state the layer's previous calls left after ``past`` cached tokens (None for
        a call without cached keys)."""
        if past == 0:
            return None
        state, seen = self.decode_states.get(layer, (None, 0))
        if state is None or seen != past or state.shape[0] != batch:
            held = "none" if state is None else f"one after {seen} tokens for a batch of {state.shape[0]}"
            raise ValueError(
                f"mechanism: {name!r} decodes with state its earlier queries leave behind, but this call continues a cache of "
                f"{past} tokens for a batch of {batch} and the switch holds {held} for layer {layer}; fill the cache (the "
                "prefill and every step before this one) inside the same attnkit.hf.use block"
            )
        return state

    def sinks_for(self, layer: int | None, num_heads: int, device) -> Tensor | None:
        sinks = self.sinks
        if isinstance(sinks, Mapping):
            sinks = None if layer is None else sinks.get(layer)  # the mapping's keys are layer indices
        if sinks is None:
            return None
        if sinks.shape != (num_heads,):
            raise ValueError(
                f"sinks: expected one logit per query head, shape ({num_heads},), for layer {layer}; got {tuple(sinks.shape)}"
            )
        return sinks.to(device)

    def head_flags(self, num_heads: int, device) -> Tensor:
        heads = self.heads
        assert heads is not None  # asked only of a switch made with heads=
        if max(heads) >= num_heads:
            raise ValueError(f"heads: {list(heads)} names a head >= the layer's {num_heads} query heads")
        flags = torch.zeros(num_heads, dtype=torch.bool, device=device)
        flags[list(heads)] = True
        return flags

    def layer_of(self, module: nn.Module) -> int:
        """A module's layer index when it has no ``layer_idx``: its rank among the
        model's modules of the same class."""
        key = id(module)
        if key not in self._layer_of:
            same = [m for m in self.model.modules() if type(m) is type(module)]
            for i, m in enumerate(same):
                self._layer_of[id(m)] = i
        return self._layer_of[key]


def active_switch(module: nn.Module) -> tuple[Switch | None, int | None]:
    """The switch in force for ``module`` and the module's layer index."""
    switch = _ACTIVE.get(module)
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int) and switch is not None:
        layer = switch.layer_of(module)
    return switch, layer


@contextmanager
def use(
    model: nn.Module,
    mechanism: str | Mechanism = "softmax",
    mask=None,
    score=None,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    observers=None,
    sinks: Tensor | Mapping[int, Tensor] | None = None,
    context_parallel=None,
    context_layout: str = "zigzag",
    **params,
):
    """Run ``model`` (a transformers >= 5 model) on attnkit inside the ``with`` block.

    Args:
        model: a loaded ``PreTrainedModel`` whose attention goes through
            ``AttentionInterface`` (Llama, Mistral, Qwen2/3, Gemma 2/3, GPT-2, BERT, ...).
        mechanism: a registered mechanism name or a Mechanism instance; ``params`` build
            it (one instance per layer for a name).
        mask: an attnkit mask and-ed with the model's own (causal, sliding window, padding).
        score: score mods applied after the model's own logits (scaled, soft-capped).
        layers: layer indices to change (default: all); the others keep the model's own
            attention, computed by attnkit.
        heads: query-head indices to change (default: all); the others keep the model's
            own attention. With softmax the change is gated per head in one call, and
            mods see the real head indices. Another mechanism runs on the selected heads
            as a call of its own (its mods see those heads numbered 0, 1, ...).
        observers: attnkit meters; they see every attention call of the changed layers,
            tagged with its layer index.
        sinks: extra learned sink logits (Hq,), or a mapping layer -> (Hq,); they join
            the model's own sinks, if it has any. Gradients reach them.
        context_parallel: a torch.distributed process group: every attention call is
            sharded over it by sequence (``attnkit.distributed``). Each rank passes its
            shard of ``input_ids`` (``attnkit.distributed.shard(ids, 1, group,
            context_layout)``) and ``use_cache=False``; no padding mask (every rank raises
            the same ValueError if any rank has one). Without ``position_ids`` each rank
            gets the global positions of its tokens from the layout. Its logits are its
            shard of the single-process logits (training too).
        context_layout: "zigzag" (default) or "contiguous", as in ``attnkit.distributed``.

    In a vision-language model (a composite config with a text sub-config) the switch,
    its observers, ``layers`` and ``heads`` act on the text decoder only; the vision tower
    runs on attnkit unchanged (``switched_modules``).

    The model's own behaviour — its scaling, sliding-window layers, logit soft-capping,
    sinks and position biases — is carried over from what it passes, not dropped.
    Padded slots (of a padding mask) are zeroed before any mechanism sees them, so
    NaN or inf there never reaches an output. A mechanism whose constructor takes
    ``context`` (sigmoid's n of b = -log n, cosFormer's horizon M) gets the config's
    ``max_position_embeddings`` unless ``params`` set it, so prefix, full and cached
    calls agree. Decoding with ``use_cache`` works for every mechanism but those with
    ``decodes = False`` (``hyper_attention``, ``block_sparse``), which refuse a cache
    with a ValueError. What earlier queries leave behind (selective attention's F,
    multi-token attention's last queries) is kept in the switch, so the prefill and
    the decoding steps of one generation belong in one ``with`` block.
    Yields the ``Switch``, whose ``mechanisms`` maps layers to the mechanisms built.
    """
    every = list(model.modules())  # walked once here: a generation opens a block per call
    check_model(model, every)
    switch = _make_switch(model, mechanism, mask, score, layers, heads, observers, sinks, params)
    if context_parallel is not None:
        from ..distributed.layout import check_layout

        switch.context_parallel, switch.context_layout = context_parallel, check_layout(context_layout)
    register()
    configs = _configs(every)
    saved_impl = {id(c): (c, c._attn_implementation_internal) for c in configs}
    modules = switched_modules(model, every)
    saved_active = {m: _ACTIVE.get(m) for m in modules}
    unhook = None
    try:
        if context_parallel is not None:
            from .context_parallel import install

            unhook = install(model, context_parallel, context_layout)  # global position_ids, collective checks
        model.set_attn_implementation(NAME)  # type: ignore[operator]  # nn.Module.__getattr__: Tensor | Module
        for m in modules:
            _ACTIVE[m] = switch
        yield switch
    finally:
        if unhook is not None:
            unhook()
        for config, impl in saved_impl.values():
            config._attn_implementation_internal = impl
        for m, previous in saved_active.items():
            if previous is None:
                _ACTIVE.pop(m, None)
            else:
                _ACTIVE[m] = previous


def switched_modules(model: nn.Module, every: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules a switch (and ``attnkit.steer``) acts on: all of ``model``'s, except,
    in a composite model whose text config is a sub-config (a vision-language model),
    those of its other towers (the vision encoder). Their layers are numbered apart
    from the decoder's, and ``layers=``/``heads=`` index the text config, so observers
    and interventions see the decoder only; the towers still run on attnkit, unchanged.
    Observe a tower by passing it as the model (``use(model.model.vision_tower)``)."""
    from transformers import PreTrainedModel

    every = list(model.modules()) if every is None else every
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # type: ignore[operator]  # nn.Module.__getattr__
    if text is config:
        return every
    skip: set[int] = set()
    for m in every:
        if isinstance(m, PreTrainedModel) and m.config is not config and m.config is not text and id(m) not in skip:
            skip.update(id(x) for x in m.modules())
    return [m for m in every if id(m) not in skip]


def check_model(model, every: list[nn.Module] | None = None) -> None:
    """Raise ValueError naming ``model`` unless attnkit can switch it: a transformers
    ``PreTrainedModel`` whose attention goes through ``AttentionInterface``. ``every``:
    ``model.modules()``, when the caller has them."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    for m in model.modules() if every is None else every:
        if isinstance(m, PreTrainedModel) and not m._can_set_attn_implementation():
            raise ValueError(
                f"model: {type(m).__name__} does not route its attention through transformers' AttentionInterface, "
                "so attnkit cannot switch it; models that do include Llama, Mistral, Qwen2/3, Gemma 2/3, GPT-2 and BERT"
            )


def _configs(every: list[nn.Module]) -> list:
    """Every config whose ``_attn_implementation`` the switch may change (``every``: the
    model's modules)."""
    from transformers import PreTrainedModel

    seen, out = set(), []
    stack = [m.config for m in every if isinstance(m, PreTrainedModel)]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        out.append(config)
        for key in getattr(config, "sub_configs", {}):
            sub = getattr(config, key, None)
            if sub is not None:
                stack.append(sub)
    return out


def _make_switch(model, mechanism, mask, score, layers, heads, observers, sinks, params) -> Switch:
    if isinstance(mechanism, Mechanism):
        mech = get_mechanism(mechanism, **params)  # raises when params come with an instance
        plain = mech.name == "softmax"
    elif mechanism == "softmax" and not params:
        plain = True  # nothing to validate (the commonest block: observers, steering)
    else:
        plain = _validate_named(model, mechanism, params).name == "softmax"
    user_mask = None if mask is None else as_mask(mask, "mask")
    user_score = None if score is None else as_score(score, "score")
    layer_set = None if layers is None else frozenset(_indices(layers, "layers", _text_config_int(model, "num_hidden_layers")))
    head_list = None if heads is None else tuple(_indices(heads, "heads", _text_config_int(model, "num_attention_heads")))
    if head_list == ():
        raise ValueError("heads: expected at least one head index, got an empty selection")
    if head_list is not None and not plain and observers:
        raise ValueError(
            "observers: with heads= and a mechanism other than softmax the selected heads run as a call of their own, "
            "so no observer could see the whole layer; observe without heads=, or with mechanism='softmax'"
        )
    if sinks is not None and not isinstance(sinks, (Tensor, Mapping)):
        raise ValueError(f"sinks: expected a tensor (Hq,) or a mapping layer -> tensor, got {type(sinks).__name__}")
    return Switch(
        model,
        mechanism,
        dict(params),
        user_mask,
        user_score,
        layer_set,
        head_list,
        list(observers) if observers else None,
        sinks,
        plain=plain,
        context=_text_config_int(model, "max_position_embeddings"),
    )


def _validate_named(model, mechanism: str, params: dict) -> Mechanism:
    """Build a named mechanism once now, with the sizes the config declares, so that a bad
    name or parameter fails at ``use`` and not in the middle of a forward pass."""
    heads = _text_config_int(model, "num_attention_heads")
    hidden = _text_config_int(model, "hidden_size")
    if heads is None:
        return get_mechanism(mechanism, **params)
    kv_heads = _text_config_int(model, "num_key_value_heads") or heads
    head_dim = _text_config_int(model, "head_dim") or (hidden // heads if hidden else 64)
    return build_mechanism(
        mechanism, params, heads, head_dim, kv_heads, head_dim, _text_config_int(model, "max_position_embeddings")
    )


def _text_config_int(model, name: str) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, name, None)
    return n if isinstance(n, int) else None


def _indices(values, name: str, limit: int | None) -> list[int]:
    if isinstance(values, int):
        values = [values]
    out = []
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (limit is not None and v >= limit):
            bound = f" below {limit}" if limit is not None else ""
            raise ValueError(f"{name}: expected non-negative ints{bound}, got {v!r}")
        out.append(v)
    return out
