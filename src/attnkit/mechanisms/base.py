"""What every attention mechanism is, and the registry that names them.

A mechanism is a small ``torch.nn.Module`` (so learnable parameters — a differential
attention lambda, talking-heads matrices, an adaptive span — train with the model) with:

- ``name``: the registry key, used by ``attnkit.attention(mechanism="...")``, the CLI and
  ``attnkit.hf``;
- ``reference(q, k, v, **call)``: the paper's formula written as literally as possible,
  O(N^2) where the paper is; the oracle its fast path is tested against;
- ``forward(q, k, v, **call)``: the fast path built on ``attnkit.kernels``. The base
  class's ``forward`` is a template: options checked, request made (``call_request``),
  ``reference`` run for ``backend="reference"`` (``reference_result``) or else
  ``fast_path``, observers fed (``observe_call``), the output checked. A mechanism
  fills in those hooks (and declares ``backends``, ``has_lse``, ``takes_sinks``) instead
  of writing that preamble; one whose call differs overrides ``forward`` itself and says
  why. Two extensions of the template serve mechanisms with more to a call:

  - ``call_keywords``: the mechanism's own keyword arguments (forgetting attention's
    gates, ``initial_state`` / ``return_state`` of a ``cache_state`` mechanism); the
    template takes those names besides ``attnkit.attention``'s, hands the ones given to
    every hook by name, and then returns ``call_result`` (which adds the state);
  - a run (``fast_path``, ``reference_result``) returns ``(out, lse or None)`` and may
    add a third item, what it found that ``observe_call`` and ``call_result`` need (the
    keys top-k kept, the selection state selective attention accumulated); they then
    receive it after their usual arguments.

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
from typing import TypeVar

from torch import nn

from ..kernels.mechanism_call import check_options, finish
from ..kernels.request import Request, make_request

_REGISTRY: dict[str, Callable[..., Mechanism]] = {}
_M = TypeVar("_M", bound="Mechanism")


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
    #: the ``backend=`` values the template ``forward`` accepts
    backends: tuple[str, ...] = ("auto", "chunked", "reference")
    #: whether there is a softmax normaliser (``return_lse=True`` allowed)
    has_lse: bool = True
    #: whether attention sinks are supported
    takes_sinks: bool = False
    #: the template's keyword arguments beyond ``attnkit.attention``'s (see above)
    call_keywords: tuple[str, ...] = ()

    def forward(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        score=None,
        scale=None,
        sinks=None,
        return_lse=False,
        backend="auto",
        check_finite=True,
        observers=None,
        layer=None,
        **own,
    ):
        """The template: check the options, make the request (``call_request``), run the
        literal ``reference`` for ``backend="reference"`` or else ``fast_path``, feed
        ``observers`` (``observe_call``), refuse a non-finite output (``check_finite``).
        ``own``: those of the mechanism's ``call_keywords`` given; with them, the call
        returns ``call_result``."""
        for name in own:
            if name not in self.call_keywords:  # as Python words it for a keyword forward does not take
                raise TypeError(f"Mechanism.forward() got an unexpected keyword argument {name!r}")
        check_options(
            self.name,
            sinks=sinks,
            return_lse=return_lse,
            backend=backend,
            backends=self.backends,
            lse=self.has_lse,
            allow_sinks=self.takes_sinks,
        )
        req = self.call_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, **own)
        if backend == "reference":
            ran = self.reference_result(req, q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, **own)
        else:
            ran = self.fast_path(req, backend, **own)
        out, lse, found = ran[0], ran[1], ran[2:]  # found: () or (what the run leaves for the hooks after it,)
        if observers:
            self.observe_call(req, lse, observers, layer, *found, **own)
        finish(req, out, check_finite)
        if own:
            return self.call_result(req, out, lse, return_lse, *found, **own)
        return (out, lse) if return_lse else out

    def call_request(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, **own) -> Request:
        """The kernels' request for a call (a mechanism that adds its own mask overrides this)."""
        return make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks)

    def reference_result(self, req: Request, q, k, v, *, mask=None, score=None, scale=None, sinks=None, **own):
        """(out, lse or None) of ``reference`` for the template's ``backend="reference"``."""
        call = dict(mask=mask, score=score, scale=scale, **({"sinks": sinks} if sinks is not None else {}), **own)
        if self.has_lse:
            return self.reference(q, k, v, return_lse=True, **call)
        return self.reference(q, k, v, **call), None

    def fast_path(self, req: Request, backend: str, **own):
        """The fast path of the template ``forward``: (out, lse or None), and optionally
        what it found for ``observe_call`` and ``call_result``."""
        raise NotImplementedError(f"{type(self).__name__} has no fast_path; it overrides forward instead")

    def observe_call(self, req: Request, lse, observers, layer, found=None, **own) -> None:
        """Feed ``observers`` the weights the call applied (template ``forward``)."""
        raise ValueError(f"observers: mechanism {self.name!r} cannot feed observers")

    def call_result(self, req: Request, out, lse, return_lse: bool, found=None, **own):
        """What a template call given own keywords returns (``return_state=True`` adds a
        state); without them, and by default, ``(out, lse)`` for ``return_lse``, else ``out``."""
        return (out, lse) if return_lse else out

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


def register(name: str) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: make a Mechanism subclass available by ``name``."""

    def deco(cls: type[_M]) -> type[_M]:
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
