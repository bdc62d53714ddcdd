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

Anywhere attnkit takes a model path (``attnkit probe --model``, ``attnkit inspect
--model``), an organism name works too (``store.resolve_model_path``).
"""

from __future__ import annotations

import os

from .registry import RECIPES, names, recipe
from .store import organism_path, read_card, resolve_model_path, shipped, verify


def path(name: str) -> str:
    """The verified export directory of organism ``name`` (shipped weights)."""
    recipe(name)  # an unknown name lists the known ones
    return organism_path(name)


def card(name: str) -> dict:
    """The card of shipped organism ``name`` (its files' hashes checked)."""
    return verify(path(name))


def load(name: str):
    """(model, task) of shipped organism ``name``: ``model(ids) -> logits`` runs the
    transformers export as it was trained (a sigmoid or linear organism through
    ``attnkit.hf.use``), ``task`` the arena task it was trained on. ``model.model`` is the
    ``LlamaForCausalLM`` itself (for a non-softmax organism, run it inside
    ``attnkit.arena.export.mechanism_switch(model.model)``)."""
    from .evaluate import load_export

    return load_export(path(name))


def build(name: str, out_dir: str, **kwargs) -> dict:
    """Train organism ``name`` from its recipe into ``out_dir``; returns the new card
    (see ``builder.build``)."""
    from .builder import build as build_recipe

    return build_recipe(recipe(name), os.fspath(out_dir), **kwargs)


__all__ = ["RECIPES", "build", "card", "load", "names", "path", "read_card", "recipe", "resolve_model_path", "shipped", "verify"]
