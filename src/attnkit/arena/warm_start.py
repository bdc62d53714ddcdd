"""Warm starts: a run that begins from another model's weights (``--init``).

A retrieval circuit that does not form from scratch at a long length forms in a few
steps from a model that already has it at a short one (an induction model becomes a
needle model, a 32-token needle model a 1024-token one), so model organisms are grown
by chains of runs, each starting where the last ended. The weights come from

- an arena export (a directory with config.json and model.safetensors, Llama names,
  see export.py), or
- an arena checkpoint (``.safetensors`` written by the trainer, or its ``.best``).

Every weight must match the new model by name and shape, except the token embedding
(and an untied LM head): the tasks number their symbols from 0, so the rows both
vocabularies have are copied and the rest keep their fresh initialisation (a larger
vocabulary grows, a smaller one takes the first rows). Anything else that differs is an
error naming the first tensor that does. RoPE has no weights, so the maximum length may
grow freely.

Nothing is unpickled: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..extras import require
from .checkpoint import load_weights

#: weights whose first dimension is the vocabulary (copied row by row)
VOCABULARY_ROWS = ("embed.weight", "lm_head.weight")


def read_init_weights(path: str) -> dict[str, torch.Tensor]:
    """The weights at ``path`` under TransformerLM's names (see the module docstring)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"init: expected an arena export directory or checkpoint file, got {path!r}")
    path = str(path)
    if os.path.isdir(path):
        return _export_weights(path)
    if os.path.isfile(path):
        return load_weights(path).copy()
    raise FileNotFoundError(f"init: no such export directory or checkpoint: {path}")


def _export_weights(directory: str) -> dict[str, torch.Tensor]:
    require("safetensors", "attnkit.arena's warm starts")
    from safetensors.torch import load_file

    from .export import llama_names

    config_file, weights_file = os.path.join(directory, "config.json"), os.path.join(directory, "model.safetensors")
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ValueError(f"init: {directory} has no {os.path.basename(file)} (expected an arena export or a checkpoint)")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    layers, tied = config.get("num_hidden_layers"), bool(config.get("tie_word_embeddings", False))
    if not isinstance(layers, int):
        raise ValueError(f"init: {config_file} gives no num_hidden_layers (not a Llama export)")
    theirs_to_ours = {theirs: ours for ours, theirs in llama_names(layers, tied).items()}
    weights = {}
    for name, tensor in load_file(weights_file).items():
        if name not in theirs_to_ours:
            raise ValueError(f"init: {weights_file} has a tensor {name} that no arena model has (not an arena export)")
        weights[theirs_to_ours[name]] = tensor
    return weights


def start_from(model: nn.Module, weights: dict[str, torch.Tensor], source: str = "the weights") -> dict:
    """Copy ``weights`` into ``model`` (see the module docstring); returns what was done:
    ``{"copied": n, "rows": {name: {"source": rows, "model": rows}}}`` for the vocabulary
    weights whose row counts differ (the first ``min`` rows copied). A ValueError names the first tensor that does not fit."""
    state_keys = set(model.state_dict())
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    own.update({k: b for k, b in model.named_buffers() if k in state_keys})
    rows = {}
    plan: list[tuple[torch.Tensor, torch.Tensor, int | None]] = []
    for key, target in own.items():
        if key not in weights:
            raise ValueError(f"init: the model's {key} (shape {tuple(target.shape)}) is not in {source}")
        tensor = weights[key]
        if key in VOCABULARY_ROWS and tensor.dim() == target.dim() == 2 and tensor.shape[1:] == target.shape[1:]:
            n = min(tensor.shape[0], target.shape[0])
            if tensor.shape[0] != target.shape[0]:
                rows[key] = {"source": tensor.shape[0], "model": target.shape[0]}
            plan.append((target, tensor[:n], n))
            continue
        if tensor.shape != target.shape:
            raise ValueError(f"init: {key} has shape {tuple(tensor.shape)} in {source}, the model's is {tuple(target.shape)}")
        plan.append((target, tensor, None))
    extra = [k for k in weights if k not in own and k not in state_keys]
    if extra:
        raise ValueError(f"init: {extra[0]} in {source} has no place in the model (another depth or architecture?)")
    with torch.no_grad():
        for target, tensor, first in plan:
            (target if first is None else target[:first]).copy_(tensor.to(target.dtype))
    return {"copied": len(plan), "rows": rows}


def warm_start(model: nn.Module, path: str) -> dict:
    """``start_from(model, read_init_weights(path))``; the record names ``path``."""
    return {"init": str(path), **start_from(model, read_init_weights(path), str(path))}


__all__ = ["read_init_weights", "start_from", "warm_start"]
