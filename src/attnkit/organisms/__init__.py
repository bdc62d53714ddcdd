"""Model organisms: small models grown with the arena, shipped with what they measurably do.

attnkit's probes, KV-cache policies and steering need subjects that behave: models that
retrieve at the lengths those tools exist for. An organism is a named recipe over the
arena (warm-started stages, a length curriculum; see ``registry.py``), built once into a
transformers export with a card of its measured accuracy per length × depth on held-out
prompts and what it does not do, and shipped inside the package (a d_model 64 model is
a few hundred kB), its files' hashes checked at load.

    from attnkit import organisms
    organisms.names()                       # every recipe
    directory = organisms.path("needle-1k") # the shipped export, verified
    organisms.card("needle-1k")["accuracy"]["1024"]

A visual organism (``organisms/visual.py``: ``shapes-vlm``, a tiny LLaVA trained on
coloured shapes) is listed, carded, verified and resolved the same way; its card says
``"kind": "visual"``.

Anywhere attnkit takes a model path (``attnkit probe --model``, ``attnkit inspect
--model``), an organism name works too (``store.resolve_model_path``).
"""

from __future__ import annotations

import os

from . import visual
from .registry import RECIPES, names, recipe
from .store import organism_path, read_card, resolve_model_path, shipped, verify


def path(name: str) -> str:
    """The verified export directory of organism ``name`` (shipped weights)."""
    if name not in visual.VISUAL:
        known(name)  # an unknown name lists the known ones
    return organism_path(name)


def known(name: str):
    """The recipe of organism ``name`` (a ``Recipe``, or a ``visual.VisualOrganism``); an
    unknown name lists every known one, text and visual."""
    if name in visual.VISUAL:
        return visual.VISUAL[name]
    if name not in RECIPES:
        raise ValueError(f"name: no organism {name!r}; known: {', '.join(names() + visual.names())}")
    return recipe(name)


def card(name: str) -> dict:
    """The card of shipped organism ``name`` (its files' hashes checked)."""
    return verify(path(name))


def load(name: str):
    """(model, task) of shipped organism ``name``: ``model(ids) -> logits`` runs the
    transformers export as it was trained (a sigmoid or linear organism through
    ``attnkit.hf.use``), ``task`` the arena task it was trained on. ``model.model`` is the
    ``LlamaForCausalLM`` itself (for a non-softmax organism, run it inside
    ``attnkit.arena.export.mechanism_switch(model.model)``). For a visual organism
    (``visual.names()``), (model, processor)."""
    if name in visual.VISUAL:  # a visual organism: (LlavaForConditionalGeneration, its processor)
        from ..vision.organism import load_export as load_visual

        return load_visual(path(name))
    from .evaluate import load_export

    return load_export(path(name))


def build(name: str, out_dir: str, **kwargs) -> dict:
    """Train organism ``name`` from its recipe into ``out_dir``; returns the new card
    (see ``builder.build``)."""
    if name in visual.VISUAL:
        return visual.build(name, os.fspath(out_dir), **kwargs)
    from .builder import build as build_recipe

    return build_recipe(recipe(name), os.fspath(out_dir), **kwargs)


__all__ = [
    "RECIPES",
    "build",
    "card",
    "known",
    "load",
    "names",
    "path",
    "read_card",
    "recipe",
    "resolve_model_path",
    "shipped",
    "verify",
    "visual",
]
