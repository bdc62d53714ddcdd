"""The model a probe tests: a local transformers directory (or the bundled
all-MiniLM-L6-v2), what kind it is, how long it reads, and, for an arena export, the
task it was trained on.

A probe that generates needs a causal language model; a probe of embeddings needs an
encoder. ``ProbeModel`` says which it holds so each probe can refuse the wrong one with
an error that names its ``model`` argument.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..extras import require

#: name of the file an arena export writes beside config.json
TASK_FILE = "task.json"


@dataclass
class ProbeModel:
    """``model`` (eval mode, float32), its ``tokenizer`` (for a vision-language model, its
    processor), ``kind`` ("causal", "encoder" or "vision"), ``max_positions`` (None when
    the config has no limit), ``task`` (the task.json of an arena export or a visual
    organism, or None for a natural-language model) and ``name``."""

    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer, or a processor (kind "vision")
    kind: str
    max_positions: int | None
    task: dict | None = None
    name: str = ""

    @property
    def layers(self) -> int:
        return _config_int(self.model, ("num_hidden_layers", "n_layer"), "layer count")

    @property
    def heads(self) -> int:
        return _config_int(self.model, ("num_attention_heads", "n_head"), "head count")

    def require(self, kind: str, probe: str) -> None:
        """An error naming ``model`` when this model is not of ``kind``."""
        if self.kind != kind:
            what = {"causal": "a causal language model that can generate", "vision": "a vision-language model (LLaVA ...)"}.get(
                kind, "an encoder (embedding model)"
            )
            kind_text = {"causal": "a causal language model", "vision": "a vision-language model"}.get(self.kind, "an encoder")
            raise ValueError(f"model: the {probe} probe needs {what}; {self.name or 'the model'} is {kind_text}")

    def check_length(self, n_tokens: int, name: str = "lengths") -> None:
        """An error naming the argument ``name`` when a prompt of ``n_tokens`` exceeds the model's positions."""
        if self.max_positions is not None and n_tokens > self.max_positions:
            raise ValueError(
                f"{name}: a prompt of {n_tokens} tokens is longer than the {self.max_positions} positions "
                f"{self.name or 'the model'} reads"
            )


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_int(model, names, what) -> int:
    config = _text_config(model)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"model: its config ({type(config).__name__}) gives no {what}")


def max_positions(model) -> int | None:
    config = _text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_causal_lm(model) -> bool:
    """A model that predicts next tokens: it has an output embedding and a decoder config."""
    config = _text_config(model)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return (
        model.get_output_embeddings() is not None
        and not getattr(config, "is_encoder_decoder", False)
        and any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures + [type(model).__name__])
    )


def read_task(path: str) -> dict | None:
    """The arena task an exported model was trained on (its task.json), or None."""
    file = os.path.join(path, TASK_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {file} is not a readable task description: {e}") from e
    if not isinstance(task, dict) or not isinstance(task.get("task"), str):
        raise ValueError(f"model: {file} must be a JSON object naming its 'task' (as attnkit arena --export writes)")
    return task


def load_probe_model(path: str | os.PathLike | None = None, *, kind: str | None = None) -> ProbeModel:
    """Load a local transformers model directory (or a model organism by name, see
    ``attnkit.organisms``) offline (float32, eval mode), as a causal LM when it is one,
    else as the bare encoder; a vision-language model (a config with vision_config and
    text_config) for image-text-to-text, its processor as the tokenizer (kind "vision");
    ``path=None`` loads the bundled all-MiniLM-L6-v2. ``kind`` ("causal" or "encoder") forces the class.
    Errors about ``path`` name ``model``, the probes' argument it comes from."""
    if kind not in (None, "causal", "encoder"):
        raise ValueError(f"kind: expected None, 'causal' or 'encoder', got {kind!r}")
    if path is None:
        from ..hf import load_default_model

        model, tokenizer = load_default_model()
        return ProbeModel(model, tokenizer, "encoder", max_positions(model), None, "all-MiniLM-L6-v2")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"model: expected a model directory, got {path!r}")
    require("transformers", "attnkit.probes' model loading")  # offline: local_files_only below
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from ..hf.loading import load_pretrained, load_tokenizer, model_directory

    path = model_directory(path, "model")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model: could not read {path}/config.json: {e}") from e
    if kind is None and getattr(config, "vision_config", None) is not None and hasattr(config, "text_config"):
        return _load_vision_model(path)
    architectures = getattr(config, "architectures", None) or []
    causal = kind == "causal" or (kind is None and any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures))
    model = load_pretrained(AutoModelForCausalLM if causal else AutoModel, path, "model")
    tokenizer = load_tokenizer(path, "model")
    model.eval()
    return ProbeModel(
        model,
        tokenizer,
        "causal" if causal else "encoder",
        max_positions(model),
        read_task(path),
        os.path.basename(os.path.normpath(path)),
    )


def _load_vision_model(path: str) -> ProbeModel:
    """A vision-language model directory (a config with vision_config and text_config:
    LLaVA, Qwen2-VL, ...): the model for image-text-to-text and its processor as the
    ProbeModel's ``tokenizer``, kind "vision"."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: could not load a vision-language model and its processor from {path}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    return ProbeModel(model, processor, "vision", max_positions(model), read_task(path), os.path.basename(os.path.normpath(path)))


def as_probe_model(model, tokenizer=None) -> ProbeModel:
    """A ProbeModel from what a probe function was given: a ProbeModel, a path, or a
    loaded (model, tokenizer) pair."""
    if isinstance(model, ProbeModel):
        return model
    if model is None or isinstance(model, (str, os.PathLike)):
        return load_probe_model(model)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model: expected a transformers model, a directory or a ProbeModel, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("tokenizer: a probe needs the model's tokenizer to build its prompts")
    path = getattr(model.config, "_name_or_path", "") or ""
    task = read_task(path) if path and os.path.isdir(path) else None
    kind = (
        "vision" if getattr(model.config, "vision_config", None) is not None else "causal" if is_causal_lm(model) else "encoder"
    )
    return ProbeModel(
        model.eval(),
        tokenizer,
        kind,
        max_positions(model),
        task,
        os.path.basename(os.path.normpath(path)) if path else type(model).__name__,
    )
