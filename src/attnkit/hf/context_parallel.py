"""``attnkit.hf.use(model, context_parallel=group)``: a transformers model sharded by sequence.

Each rank runs the model on its shard of the tokens and every attention call goes through
``attnkit.distributed.attention``. Two things must hold on top of the sharded calls:

- Positions are global. A transformers model without ``position_ids`` numbers its tokens
  0 .. n_r - 1, which is wrong on every rank but the first (RoPE and absolute embeddings
  would see the shard as a sequence of its own). A pre-hook on the model fills in each
  rank's global positions from the layout, so a rank passes only its shard of the ids.
- Refusals are collective. A rank that finds its input unusable (a padding mask, say) while
  the others go on would leave them waiting in the first exchange until the group's
  timeout; instead the ranks agree on every check, and all raise the same ValueError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch

from ..distributed.call import attention as sharded
from ..distributed.call import refuse
from ..distributed.comm import agree, resolve_group
from ..distributed.layout import layout_for

Tensor = torch.Tensor


def install(model, group, layout: str) -> Callable[[], None]:
    """Hook every (sub)model that takes ``position_ids``; returns the function that removes
    the hooks. Inner models are hooked too, so calling ``model.model`` directly is covered;
    an outer call then checks twice (one all-gather of two ints each)."""
    from transformers import PreTrainedModel

    handles = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and "position_ids" in _parameters(m):
            hook = partial(_shard_inputs, group=group, layout=layout)
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


def _parameters(module) -> dict:
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _shard_inputs(module, args, kwargs, *, group, layout: str):
    """Check the shards together (lengths form the layout, no rank is padded) and give
    every rank without ``position_ids`` the global positions of its tokens."""
    g = resolve_group(group)
    bound: inspect.BoundArguments | None
    error: ValueError | None
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError as err:
        bound, error, n_local = None, ValueError(f"{type(module).__name__}.forward: {err}"), -1
    else:
        n_local, error = _local_length(bound.arguments)
        error = error or _mask_error(bound.arguments.get("attention_mask"))
    lengths = [row[0] for row in agree(error, [n_local], g, "context_parallel's input check")]
    assert bound is not None  # a rank that could not bind its call passed an error, and agree raised it
    lay = layout_for(sum(lengths), g.world, layout)
    expected = [lay.local_length(r) for r in range(g.world)]
    if lengths != expected:
        raise ValueError(
            f"input_ids: shard lengths per rank {lengths} are not the {layout!r} layout of N={sum(lengths)} over "
            f"{g.world} ranks (expected {expected}); cut them with attnkit.distributed.shard(input_ids, 1, group, layout={layout!r})"
        )
    if bound.arguments.get("position_ids") is not None:
        return None
    ids = bound.arguments.get("input_ids")
    like = ids if ids is not None else bound.arguments["inputs_embeds"]
    positions = lay.positions(g.rank).to(like.device).unsqueeze(0).expand(like.shape[0], -1)
    return _with_argument(module, args, kwargs, "position_ids", positions)


def _with_argument(module, args: tuple, kwargs: dict, name: str, value):
    """(args, kwargs) with ``name`` set, where the caller put it or as a keyword. The call
    keeps its own shape otherwise: wrappers around transformers' forwards add keywords of
    their own, which a call rebuilt from a signature binding would pass twice."""
    index = list(_parameters(module)).index(name)
    if index < len(args):
        args = (*args[:index], value, *args[index + 1 :])
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs


def _local_length(arguments: dict) -> tuple[int, ValueError | None]:
    ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    if isinstance(ids, Tensor) and ids.dim() >= 1:
        return ids.shape[-1], None
    if isinstance(embeds, Tensor) and embeds.dim() >= 2:
        return embeds.shape[-2], None
    return -1, ValueError(
        "input_ids: context_parallel needs input_ids (B, n) or inputs_embeds (B, n, hidden) to know this rank's shard"
    )


def _mask_error(mask) -> ValueError | None:
    """A mask over this rank's slots cannot be sharded: only none, or one that keeps every token."""
    if mask is None or (isinstance(mask, Tensor) and mask.dim() == 2 and bool(mask.all())):
        return None
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return ValueError(
            "attention_mask: context_parallel takes unpadded shards (no attention_mask, or one of all ones), "
            "but a rank passed padding (zeros); pack the sequences into one row without padding"
        )
    return ValueError(
        f"attention_mask: context_parallel cannot shard a custom mask ({_describe(mask)}) that covers one rank's "
        "slots; pass no attention_mask (the model's causal and sliding-window masks apply at global positions)"
    )


def _describe(mask) -> str:
    return f"{mask.dim()}-D tensor" if isinstance(mask, Tensor) else type(mask).__name__


def sharded_attention(
    switch, layer, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling, kwargs
) -> Tensor:
    """One attention call of the model sharded over ``switch.context_parallel``; (B, Hq, n_r, Dv).
    A call this rank cannot make is refused on every rank of the group."""
    from .attention import model_attention

    try:
        model = model_attention(module, query, key, _global_mask(attention_mask), scaling, kwargs)
        call = _call(switch, layer, query, key, value, model)
    except ValueError as err:
        refuse(err, query.shape[2], switch.context_parallel)
    return sharded(query, key, value, group=switch.context_parallel, scale=model.scale, layout=switch.context_layout, **call)


def _global_mask(attention_mask):
    """None for a sharded call: transformers built its mask over this rank's slots (and
    takes zigzag position_ids for packed sequences), so the model's causal / sliding-window
    structure is read from the module's own flags instead (``_model_mask`` without a mask)."""
    from .masks import MaskSpec

    if isinstance(attention_mask, MaskSpec):
        if attention_mask.padding is not None and not bool(attention_mask.padding.all()):
            raise ValueError(
                "attention_mask: context_parallel takes unpadded shards, but this rank's mask has padding; "
                "shard unpadded input_ids"
            )
        return None
    if attention_mask is not None:
        raise ValueError("attention_mask: context_parallel cannot shard a custom mask tensor that covers one rank's slots")
    return None


def _call(switch, layer, query: Tensor, key: Tensor, value: Tensor, model) -> dict:
    """The keyword arguments of the sharded call. The model's causal and sliding-window
    masks are relative positions, evaluated at global positions by attnkit.distributed;
    masks that name local slots (padding, packed documents) or a local position-bias
    tensor cannot be, and are refused."""
    from .attention import _and, _padding_keep
    from .heads import combine_sinks

    if query.shape[2] != key.shape[2]:
        raise ValueError(
            "use_cache: context_parallel shards are whole sequences of new tokens: run the prefill or training step with use_cache=False"
        )
    if _padding_keep(model.mask) is not None or model.position_bias is not None or model.steer:
        raise ValueError(
            "context_parallel: the model passed a padding mask or a position-bias tensor over this rank's slots only; "
            "shard unpadded input_ids without attention_mask (pack sequences into one row of one length)"
        )
    if not switch.applies_to(layer):
        return dict(mask=model.mask, score=model.score() or None, sinks=model.sinks, mechanism=None)
    if switch.heads is not None or switch.observers:
        raise ValueError("context_parallel: heads= and observers= are not supported with context parallelism")
    sink_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    extra = switch.sinks_for(layer, query.shape[1], query.device)
    scores = model.score() + ([switch.score] if switch.score is not None else [])
    return dict(
        mask=_and(model.mask, switch.mask),
        score=scores or None,
        sinks=combine_sinks(model.sinks, extra, None, sink_dtype),
        mechanism=switch.mechanism_for(layer, query, key, value),
    )
