"""Inputs for ``attnkit inspect``: a local transformers model directory, the bundled text."""

from __future__ import annotations

import os
from importlib import resources

from ..extras import require


def sample_text() -> str:
    """The bundled sample text (a few paragraphs, under 300 tokens for MiniLM)."""
    return resources.files(__package__).joinpath("data/sample.txt").read_text(encoding="utf-8")


def load_local_model(path: str):
    """(model, tokenizer) from a local transformers model directory (or a model organism
    by name, see ``attnkit.organisms``), offline, float32.

    The bare model class (``AutoModel``) is loaded: attention is what is measured, and a
    language-model head would only add an (N x vocab) logits tensor."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"model: expected a directory path, got {path!r}")
    from ..organisms.store import resolve_model_path

    path = resolve_model_path(path, "model")  # an organism's name -> its shipped, verified export
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: no such directory: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"model: {path} is a file; expected a transformers model directory (config.json and weights)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: {path} is not a transformers model directory (it has no config.json)")
    import torch

    require("transformers", "attnkit.inspect's model loading")  # offline: local_files_only below
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the bare class leaves a saved LM head unused: expected, not news
    try:
        model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model: could not load a transformers model from {path}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: {path} has no usable tokenizer ({e}); save one with tokenizer.save_pretrained(path)") from e
    return model.eval(), tokenizer
