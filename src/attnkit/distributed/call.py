"""``attnkit.distributed.attention``: one attention call sharded over a process group."""

from __future__ import annotations

import torch
from torch.nn.parameter import is_lazy

from ..kernels import make_request
from ..mechanisms import get_mechanism
from ..mechanisms.linear import LinearAttention
from ..mods import as_mask, as_score
from .comm import Group, agree, resolve_group
from .layout import Layout, check_layout, layout_for
from .linear import linear_attention
from .ring import RingAttention, RingPlan

Tensor = torch.Tensor


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    mask=None,
    score=None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    mechanism=None,
    layout: str = "zigzag",
    return_lse: bool = False,
    backend: str = "auto",
):
    """This rank's shard of ``attnkit.attention`` on the whole sequence, exactly.

    Args:
        q, k, v: this rank's shard of the sequence dimension (dim 2), as cut by
            ``shard(x, 2, group, layout)``: (B, Hq, n_r, D), (B, Hkv, n_r, D), (B, Hkv, n_r, Dv).
        group: a torch.distributed process group (None: the default group).
        mask, score: as in ``attnkit.attention``, over the *whole* sequence: they see global
            positions (``document(ids)`` takes the global ids, shape (N,) or (B, N)).
        sinks: (Hq,) learned sink logits, counted once per row in the merge.
        mechanism: None / "softmax", "sigmoid", or a causal linear-attention mechanism
            (``LinearAttention`` instance or name; its weights must be equal on every rank).
            Others raise ValueError: they do not split exactly over key blocks.
        layout: "zigzag" (load-balanced for causal masks) or "contiguous".
        return_lse: also return this rank's rows of the logsumexp (softmax only).

    Every rank must make the same call (same mask, score, options). Gradients of q, k, v
    are this rank's; gradients of sinks, score parameters and mechanism weights are this
    rank's queries' share: sum them over the group (as data parallelism does) for the whole.
    """
    g = resolve_group(group)
    check_layout(layout)
    # Validate locally, then agree: a rank with bad input makes every rank raise, not hang.
    error, n_local = None, q.shape[2] if isinstance(q, Tensor) and q.dim() == 4 else -1
    try:
        mech = _mechanism(mechanism)
        make_request(q, k, v, scale=scale, sinks=sinks)
        if k.shape[2] != q.shape[2]:
            raise ValueError(
                f"k: a sharded call is self-attention over one sequence: k's shard length must equal q's {q.shape[2]}, got {k.shape[2]}"
            )
    except (ValueError, TypeError) as err:
        error = err
    table = _agree_on_inputs(error, n_local, g)
    n = sum(t[0] for t in table)
    lay = layout_for(n, g.world, layout)
    expected = [lay.local_length(r) for r in range(g.world)]
    got = [t[0] for t in table]
    if got != expected:
        raise ValueError(
            f"q: shard lengths per rank {got} are not the {layout!r} layout of N={n} over {g.world} ranks "
            f"(expected {expected}); cut inputs with attnkit.distributed.shard(x, 2, group, layout={layout!r})"
        )
    B, Hq = q.shape[0], q.shape[1]
    if isinstance(mech, LinearAttention):
        return _linear(mech, g, lay, q, k, v, mask, score, sinks, return_lse)
    kind = "softmax" if mech is None else "sigmoid"
    if kind == "sigmoid" and (sinks is not None or return_lse):
        raise ValueError("sigmoid attention has no softmax: sinks and return_lse do not apply")
    bound_mask = None if mask is None else as_mask(mask).bind(B, Hq, n, n)
    bound_score = None if score is None else as_score(score).bind(B, Hq, n, n)
    scale = 1.0 / q.shape[3] ** 0.5 if scale is None else float(scale)
    plan = RingPlan(g, lay, kind, bound_mask, bound_score, scale, backend, mech)
    params = [] if bound_score is None else bound_score.parameters()
    result = RingAttention.apply(plan, q, k, v, sinks, *params)
    if kind == "sigmoid":
        return result
    out, lse = result
    return (out, lse) if return_lse else out


def refuse(error: Exception, q_len: int, group=None):
    """Raise ``error`` on every rank of the group: for a caller (``attnkit.hf``) that finds
    this rank's call invalid before it reaches ``attention`` while the other ranks are
    already inside it. This rank joins their input check as a failing rank, so every rank
    raises the same ValueError and none waits for an exchange that will not come."""
    _agree_on_inputs(error, q_len, resolve_group(group))
    raise error  # not reached: the check raises on every rank when one rank fails


def _agree_on_inputs(error: Exception | None, q_len: int, g: Group) -> list[list[int]]:
    """Each rank's shard length, after the group agrees every rank's inputs are valid
    (``attention`` and ``refuse`` must exchange exactly this, in this order)."""
    return agree(error, [q_len], g, "the input check before attention")


def _mechanism(mechanism):
    if mechanism is None or mechanism == "softmax":
        return None
    mech = get_mechanism(mechanism)
    if mech.name == "softmax":
        return None
    if isinstance(mech, LinearAttention) and any(is_lazy(p) for p in mech.parameters()):
        # a lazy weight is drawn at the first call, on each rank apart (and never on a rank
        # holding no tokens), so the ranks would not share one mechanism
        raise ValueError(
            f"mechanism: {mech.name!r} has weights not created yet (sized by its first call); build it with "
            "heads= and head_dim= (the same seed on every rank, or load its weights) before the sharded call"
        )
    if mech.name == "sigmoid" or isinstance(mech, LinearAttention):
        return mech
    raise ValueError(
        f"mechanism: {mech.name!r} cannot be sharded exactly over the sequence (its weights are not "
        "a merge of per-key-block partial results, nor a recurrence with a passable state); "
        "attnkit.distributed supports softmax, 'sigmoid' and the causal linear-attention family"
    )


def _linear(mech, g: Group, lay: Layout, q, k, v, mask, score, sinks, return_lse):
    mask = None if mask is None else as_mask(mask)
    if type(mask).__name__ != "Causal":
        raise ValueError(
            "mask: a sharded linear-attention call must be causal (mask=attnkit.causal()); "
            "non-causal linear attention reads the state after every key, which the state chain does not provide"
        )
    if score is not None or sinks is not None or return_lse:
        raise ValueError("score, sinks, return_lse: linear attention has no logits, sink or logsumexp")
    return linear_attention(mech, g, lay, q, k, v)
