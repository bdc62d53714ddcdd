"""Inputs for ``attnkit inspect``: a local transformers model directory, the bundled text."""

from __future__ import annotations

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
    require("transformers", "attnkit.inspection's model loading")  # offline: local_files_only below
    from transformers import AutoModel

    from ..hf.loading import load_pretrained, load_tokenizer, model_directory

    path = model_directory(path, "model")
    model = load_pretrained(AutoModel, path, "model")
    tokenizer = load_tokenizer(path, "model", "; save one with tokenizer.save_pretrained(path)")
    return model.eval(), tokenizer
