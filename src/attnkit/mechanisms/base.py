"""What every attention mechanism is, and the registry that names them.

A mechanism is a small ``torch.nn.Module`` (so learnable parameters — a differential
attention lambda, talking-heads matrices, an adaptive span — train with the model) with:

- ``name``: the registry key, used by ``attnkit.attention(mechanism="...")``, the CLI and
  ``attnkit.hf``;
- ``reference(q, k, v, **call)``: the paper's formula written as literally as possible,
  O(N^2) where the paper is; the oracle its fast path is tested against;
- ``forward(q, k, v, **call)``: the fast path built on ``attnkit.kernels``.

Both take the SDPA layout — q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) —
and the keyword arguments of ``attnkit.attention`` that make sense for them (``mask``,
``score``, ``scale``, ``return_lse``, ``backend``...). A mechanism that cannot honour one
raises ``ValueError`` naming it. Mechanisms whose state is a fixed-size recurrence
(linear attention) set ``recurrent = True`` and also accept ``initial_state=`` and
``return_state=True`` (returning ``(out, state)``), which ``attnkit.nn`` uses in place of
a KV cache when decoding.

Decoding contract (``tests/mechanisms/test_decoding_contract.py``): a causal call's
rows for the first n tokens do not depend on what follows, so a prefix call, the full
call and token-by-token decoding with a KV cache (or state) agree. Quantities a paper
ties to "the sequence length" are fixed properties of the mechanism (``context`` of
sigmoid and cosFormer), never the key count of a call. Two kinds of mechanism need
more than keys and values:

- ``cache_state = True``: the mechanism also needs what earlier queries leave behind
  (selective attention's accumulated selection F per key, multi-token attention's last
  queries for its convolution over queries); it takes ``initial_state`` and
  ``return_state=True``, ``initial_state_for(state, new_tokens)`` turns the returned
  state into the next call's, and ``attnkit.nn`` / ``attnkit.hf`` keep it beside the
  KV cache;
- ``decodes = False``: a query's row depends on the other queries of the call (an
  approximation built from the whole call: HyperAttention's LSH blocks and samples,
  MInference's pattern estimated from the last queries), so a cached call would give
  another model; ``attnkit.nn`` and ``attnkit.hf`` refuse to decode it with a cache
  and say why (``decode_note``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_REGISTRY: dict[str, Callable[..., "Mechanism"]] = {}


class Mechanism(nn.Module):
    name: str = "mechanism"
    #: arXiv id (or other citation) of the paper the mechanism comes from
    paper: str = ""
    #: True for fixed-size-state mechanisms (decoding passes a state, not a KV cache)
    recurrent: bool = False
    #: True when decoding also carries state left by earlier queries (see above)
    cache_state: bool = False
    #: False when a row depends on the other queries of the call: no cached decoding
    decodes: bool = True
    #: why a mechanism with ``decodes = False`` cannot decode (one sentence)
    decode_note: str = ""

    def initial_state_for(self, state, new_tokens: int):
        """``cache_state`` mechanisms: the ``initial_state`` of a call adding ``new_tokens``
        after the call that returned ``state`` (None: nothing cached yet)."""
        return state

    @classmethod
    def layer_keywords(cls, params: dict) -> set[str] | None:
        """Which of the layer's sizes (``heads``, ``num_heads``, ``head_dim``, ``kv_heads``,
        ``value_dim``, ``v_dim``, ``context``) ``attnkit.nn`` / ``attnkit.hf`` should
        pass when building this mechanism with ``params``; None: every one the
        constructor accepts."""
        return None

    def reference(self, q, k, v, **call):
        raise NotImplementedError(f"{type(self).__name__} has no reference implementation")

    def extra_repr(self) -> str:
        return f"name={self.name!r}" + (f", paper={self.paper!r}" if self.paper else "")


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a Mechanism subclass available by ``name``."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"mechanism name {name!r} is already registered to {_REGISTRY[name]!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _registered(name: str):
    """The registered class for ``name``, or None; the families load at the first miss."""
    cls = _REGISTRY.get(name)
    if cls is None:
        from . import _load_all

        _load_all()
        cls = _REGISTRY.get(name)
    return cls


def available() -> list[str]:
    """Names of every registered mechanism."""
    from . import _load_all

    _load_all()
    return sorted(_REGISTRY)


def mechanism_class(name: str) -> type:
    """The registered class for ``name`` (to inspect its constructor before building it)."""
    cls = _registered(name)
    if cls is None:
        raise ValueError(f"mechanism: unknown name {name!r}; registered: {', '.join(available())}")
    return cls


def get_mechanism(mechanism, **params) -> Mechanism:
    """A Mechanism instance from a registered name (built with ``params``) or an instance."""
    if isinstance(mechanism, Mechanism):
        if params:
            raise ValueError(f"mechanism: parameters {sorted(params)} given with an already built {mechanism.name!r} instance")
        return mechanism
    if not isinstance(mechanism, str):
        raise TypeError(f"mechanism: expected a name or an attnkit Mechanism, got {type(mechanism).__name__}")
    return mechanism_class(mechanism)(**params)
