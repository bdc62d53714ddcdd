"""The ``DiffusionEdit`` protocol: how an intervention changes a diffusers model's
attention while ``attnkit.diffusion.use`` routes it (perturbed-attention guidance,
attend-and-excite's map recording, attention regulation, style injection, entropy
scaling, and any new one).

An edit is an object in ``EDITS[module]`` for one attention module, with three hooks run
on every routed SDPA call of that module, in this order:

- ``inputs(layout, query, key, value) -> (query, key, value)``: what attends (style
  injection swaps in a reference's keys and values); (B, H, N, D) tensors after the
  model's projections;
- ``scores(layout, query, key) -> [ScoreMod]``: score mods run inside the kernels after
  the model's own mask (regulation's bias, a temperature);
- ``output(layout, out) -> out``: the per-head output (B, H, Nq, Dv) before the heads
  merge (PAG's blend towards the values).

Edits stack: ``edits_on`` gives each new edit the one it finds on its layer
(``previous``), and ``DiffusionEdit``'s hooks pass through to it, so a subclass overrides
only what it adds and calls ``super()`` for the previous edit's result (its ``inputs``
and ``scores`` first, its ``output`` before this one's). On exit what was there comes
back, also after an exception.

A new intervention is one module: a ``DiffusionEdit`` subclass and, for use by name,
``register_edit``:

    @register_edit("sharpen")
    class Sharpen(DiffusionEdit):
        def __init__(self, layer, previous=None, *, t: float = 0.5):
            super().__init__(previous)
            self.t = t
        def scores(self, layout, query, key):
            return super().scores(layout, query, key) + [attnkit.temperature(self.t)]

    with attnkit.diffusion.edit(unet, "sharpen", kind="self", t=0.5):
        unet(latents, t, encoder_hidden_states=text)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch

from .layers import AttentionLayer, CallLayout

Tensor = torch.Tensor

#: module -> the edit on it (the top of its stack; see the module docstring)
EDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: name -> ``make(layer, previous, **params) -> DiffusionEdit`` (see ``register_edit``)
EDIT_TYPES: dict[str, Callable] = {}


class DiffusionEdit:
    """Base of every edit: goes on top of the one it finds on its layer (``previous``, or
    None) and keeps it working; every hook passes through to it by default."""

    def __init__(self, previous=None):
        self.previous = previous

    def inputs(self, layout: CallLayout, query: Tensor, key: Tensor, value: Tensor):
        swap = getattr(self.previous, "inputs", None)  # an edit that swaps what attends keeps doing so
        return (query, key, value) if swap is None else swap(layout, query, key, value)

    def scores(self, layout: CallLayout, query: Tensor, key: Tensor) -> list:
        return list(self.previous.scores(layout, query, key)) if self.previous is not None else []

    def output(self, layout: CallLayout, out: Tensor) -> Tensor:
        return self.previous.output(layout, out) if self.previous is not None else out


#: the earlier name of ``DiffusionEdit``
StackedEdit = DiffusionEdit


@contextmanager
def edits_on(layers: list[AttentionLayer], make: Callable):
    """Put ``make(layer, previous_edit)`` in ``EDITS`` for each layer for the block, and
    put back what was there on exit (also after an exception), so that interventions
    stack: an inner one wraps the edit it finds."""
    saved = [(layer.module, EDITS.get(layer.module)) for layer in layers]
    try:
        for layer, (_, previous) in zip(layers, saved):
            EDITS[layer.module] = make(layer, previous)
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                EDITS.pop(module, None)
            else:
                EDITS[module] = previous


def register_edit(name: str, make: Callable | None = None):
    """Register ``make(layer, previous, **params) -> DiffusionEdit`` (a subclass itself
    fits) as ``name`` for ``attnkit.diffusion.edit``; usable as a class decorator. A
    second registration of a name replaces the first."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")

    def add(factory):
        if not callable(factory):
            raise ValueError(f"make: expected a callable (layer, previous, **params) -> DiffusionEdit, got {factory!r}")
        EDIT_TYPES[name] = factory
        return factory

    return add if make is None else add(make)


def edit_type(name: str) -> Callable:
    if name not in EDIT_TYPES:
        raise ValueError(f"name: unknown diffusion edit {name!r}; registered: {', '.join(sorted(EDIT_TYPES)) or 'none'}")
    return EDIT_TYPES[name]


__all__ = ["EDITS", "EDIT_TYPES", "DiffusionEdit", "StackedEdit", "edit_type", "edits_on", "register_edit"]
