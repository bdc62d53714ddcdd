"""Which steps of a policy cache run in one C++ operator (``attnkit.kernels.cpu.kv``),
and the switch that sends a layer's attention call to ``step_attention``.

The cache decides *whether* a call takes one of these paths (``cache.py``); this module
says *when it can* (dtype, autograd, the module's attention, padding) and runs it:

* ``runs_in_step_attention``: a one-token step of a plain-softmax module whose attention
  ``step_attention`` can replace;
* ``fused_prefill_start``: a prefill whose causal attention and per-key mass run in one
  pass (``prefill_attention``);
* ``evict_lowest``: a decoding step's eviction for the policies whose ``lowest_rule``
  the operator runs;
* ``packed_attend``: a packed layer's step read where its rows lie;
* ``StepSwitch``: names ``step_attention`` in the module's config for the length of one
  call and restores the model's own right after.

Why the config is written per call, not chosen once per module: transformers' attention
modules read ``config._attn_implementation`` at every forward, and the config object is
shared by every module of the model and by transformers' own mask builders
(``create_causal_mask`` dispatches on the same name). Naming ``step_attention`` there for
the whole forward would send every other layer's call, and the masks transformers builds
for them, to the wrong function; giving each module a config of its own would detach it
from the model's (``model.config`` changes no longer reaching it). So the switch covers
exactly one call of one module, and ``StepSwitch.leave`` runs after the call and again at
the end of the forward, whatever happened in between.
"""

from __future__ import annotations

import torch

from ..kernels.cpu import kv as native_kv
from .model_parts import sliding_window
from .step_attention import NAME as STEP_NAME
from .step_attention import StepCall

Tensor = torch.Tensor


def native_ok(hidden: Tensor) -> bool:
    """The C++ steps can take this call: float32/float64 (bf16 and fp16 take the PyTorch
    path) and no autograd (the operators have no backward)."""
    return hidden.dtype in (torch.float32, torch.float64) and not hidden.requires_grad and native_kv.available()


def _no_dropout(module) -> bool:
    return not (module.training and getattr(module, "attention_dropout", 0.0))


def runs_in_step_attention(module, n_new: int, real: bool) -> bool:
    """Whether this call's attention can run in ``step_attention``: one ``real`` token, a
    plain softmax on sdpa or eager, no sliding window, no dropout."""
    return (
        n_new == 1
        and module.config._attn_implementation in ("sdpa", "eager")
        and sliding_window(module) is None
        and _no_dropout(module)
        and real
    )


def left_padding_start(padding: Tensor | None, n: int, batch: int, device) -> Tensor | None:
    """(B,) each row's first real token when the forward's first ``n`` tokens are
    left-padded (or not padded at all), else None."""
    if padding is None or padding.shape[-1] < n:
        return torch.zeros(batch, dtype=torch.long, device=device)
    real = padding[:, :n].to(device=device, dtype=torch.bool)
    if not bool((real[:, 1:] >= real[:, :-1]).all()):
        return None  # a real token before a padded one: not left padding
    return n - real.sum(-1)


def fused_prefill_start(module, seen: int, hidden: Tensor, padding: Tensor | None) -> Tensor | None:
    """Each row's first real token (B,) when this prefill's attention can run in C++ with
    the mass each key receives (``prefill_attention``): a fresh layer (``seen == 0``),
    rows without padding or left-padded, a causal plain softmax on sdpa or eager, no
    sliding window or dropout, float32/float64, no autograd; else None."""
    if not (
        seen == 0
        and getattr(module, "is_causal", True)
        and module.config._attn_implementation in ("sdpa", "eager")
        and sliding_window(module) is None
        and _no_dropout(module)
        and native_ok(hidden)
    ):
        return None
    return left_padding_start(padding, hidden.shape[1], hidden.shape[0], hidden.device)


def prefill_attend(call: StepCall, start: Tensor):
    """The attention of a fused prefill: causal attention in C++, its mass (every real
    query's weights summed per key) left in ``call.mass`` for the policy."""

    def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        out, call.mass = native_kv.prefill_attention(q, k, v, scale, start)
        return out

    return attend


def packed_attend(packed):
    """A packed layer's one-token step over its rows where they lie (``packed_attention``)."""
    return lambda q, k, v, scale: native_kv.packed_attention(q, packed.k, packed.v, packed.source, packed.empty_row, scale)


def evict_lowest(rule: tuple[int, float] | None, layer, mass: Tensor | None, slack: int) -> bool:
    """A decoding step's eviction in one C++ pass for a policy whose ``lowest_rule`` is
    ``rule`` (add the step's weights to the score, exempt the recent share, drop each
    head's lowest entry), instead of ``select`` and ``drop``: the same kept sets. False
    (nothing done) without the operators, or when some head must drop more than one
    entry."""
    if rule is None or mass is None or mass.dtype not in (torch.float32, torch.float64) or not native_kv.available():
        return False
    slot, fewest, most = native_kv.evict_lowest(mass.contiguous(), layer.valid, layer.pos, layer.capacity, layer.score, *rule)
    if slot is None:
        return False
    layer.settle(slack, (fewest, most))
    return True


class StepSwitch:
    """Routes one module's attention call to ``step_attention`` (``enter``) and back to
    the model's own (``leave``; idempotent)."""

    __slots__ = ("_switched",)

    def __init__(self):
        self._switched = None  # (config, its attention implementation) while a call is routed

    def enter(self, module, kwargs: dict) -> StepCall:
        """Route this call; returns the ``StepCall`` the cache and ``step_attention`` share."""
        call = kwargs["attnkit_kv_step"] = StepCall()
        kwargs["attention_mask"] = None  # step_attention hides what the query must not see itself
        self.leave()
        self._switched = (module.config, module.config._attn_implementation_internal)
        module.config._attn_implementation_internal = STEP_NAME
        return call

    def leave(self) -> None:
        if self._switched is not None:
            config, impl = self._switched
            config._attn_implementation_internal = impl
            self._switched = None
