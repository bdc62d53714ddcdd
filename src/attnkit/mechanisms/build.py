"""``build_mechanism``: a mechanism instance for one layer of a model, its constructor
given the layer's sizes. Used by ``nn`` layers, ``hf`` and ``diffusion`` switches alike
(``attnkit.nn`` re-exports it)."""

from __future__ import annotations

import inspect

from torch import nn

from .base import Mechanism, get_mechanism, mechanism_class


def build_mechanism(
    mechanism, params: dict, heads: int, head_dim: int, kv_heads: int, value_dim: int, context: int | None = None
) -> Mechanism:
    """A mechanism instance for a layer. Mechanisms whose constructor takes the layer's
    sizes (``heads``/``num_heads``, ``head_dim``, ``kv_heads``, ``value_dim``/``v_dim``;
    those with learnable weights) get them now, so their parameters exist before the
    first call (and before loading saved weights); those that take ``context`` get the
    model's context length (when known). A mechanism narrows what it wants with the
    classmethod ``layer_keywords(params)`` (neighborhood: ``num_heads`` only with a bias
    table). Keywords in ``params`` always win."""
    if isinstance(mechanism, Mechanism):
        return get_mechanism(mechanism, **params)
    if not isinstance(mechanism, str):
        raise ValueError(f"mechanism: expected a registered name or a Mechanism, got {type(mechanism).__name__}")
    cls = mechanism_class(mechanism)
    # The names mechanisms use for their sizes (the linear family's, and the aliases others use).
    shapes = dict(heads=heads, num_heads=heads, head_dim=head_dim, kv_heads=kv_heads, value_dim=value_dim, v_dim=value_dim)
    if context is not None:
        shapes["context"] = context
    accepted = _init_keywords(cls)
    wanted = cls.layer_keywords(params) if hasattr(cls, "layer_keywords") else None
    if wanted is not None:
        accepted &= set(wanted)
    params = {**{k: v for k, v in shapes.items() if k in accepted and k not in params}, **params}
    return get_mechanism(mechanism, **params)


def _init_keywords(cls) -> set[str]:
    """Keyword names a mechanism class's constructor accepts, following ``**overrides``
    up to the parent constructors they are forwarded to."""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in params) or klass is nn.Module:
            break
    return names
