"""Training checkpoints as one safetensors file: weights, optimizer state, RNG, metadata.

Nothing is pickled, so loading a checkpoint cannot run code: tensors go through
safetensors and everything else (step, history, optimizer hyper-parameters, the
names of tied weights) through the file's JSON metadata.

Keys: ``model/<name>`` for each weight stored once (a tied weight, such as
TransformerLM's LM head, is recorded as an alias of the tensor it shares);
``optim/<param index>/<state name>`` for the optimizer's tensors; ``rng/torch`` for the
CPU generator.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from ..extras import require

FORMAT = "attnkit.arena.checkpoint"


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    require("safetensors", "attnkit.arena's checkpoints")
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[f"model/{name}"] = seen[key]
            continue
        seen[key] = f"model/{name}"
        tensors[f"model/{name}"] = t.detach().contiguous()
    state = optimizer.state_dict()
    scalars: dict[str, dict] = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    tensors["rng/torch"] = torch.get_rng_state()
    header = {"format": FORMAT, "meta": meta, "aliases": aliases, "param_groups": state["param_groups"], "optim_scalars": scalars}
    save_file(tensors, path, metadata={"attnkit": json.dumps(header)})


def read_header(path: str) -> dict:
    """The checkpoint's JSON header; a ValueError naming ``path`` when it is not one."""
    require("safetensors", "attnkit.arena's checkpoints")
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get("attnkit")
    except Exception as e:  # safetensors raises its own error types for a file it cannot parse
        raise ValueError(f"path: {path} is not a readable safetensors file ({e})") from None
    header = json.loads(raw) if raw else {}
    if header.get("format") != FORMAT:
        raise ValueError(f"path: {path} is not an attnkit arena checkpoint")
    return header


def load_checkpoint_meta(path: str) -> dict:
    """The run's metadata (step, history, ...) of the checkpoint at ``path``."""
    return read_header(path)["meta"]


def _weights(tensors: dict, header: dict) -> dict[str, torch.Tensor]:
    weights = {name[len("model/") :]: t for name, t in tensors.items() if name.startswith("model/")}
    for alias, source in header["aliases"].items():
        weights[alias[len("model/") :]] = tensors[source]
    return weights


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """The model's state dict stored in the checkpoint at ``path`` (no optimizer, no RNG)."""
    from safetensors.torch import load_file

    header = read_header(path)
    return _weights(load_file(path), header)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore ``model``, ``optimizer`` and the CPU RNG from ``path``; returns the metadata."""
    from safetensors.torch import load_file

    header = read_header(path)
    tensors = load_file(path)
    model.load_state_dict(_weights(tensors, header), strict=True)

    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = t
    for index, entries in header["optim_scalars"].items():
        state.setdefault(int(index), {}).update(entries)
    groups = header["param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng/torch"])
    return header["meta"]
