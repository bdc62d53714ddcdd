"""Which heads an intervention touches: ``(layer, head)`` pairs, a ``{layer: [heads]}``
dict, or a head set written by ``attnkit probe heads`` (``probes.heads.save_head_set``:
a JSON file, or its dict, with ``"format": "attnkit.head-set"``).

Heads are query heads (with GQA several query heads share one key/value head; each is
steered alone). Everything is checked against the model's config before anything runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ..validate import index

HEAD_SET_FORMAT = "attnkit.head-set"


def model_shape(model) -> tuple[int, int]:
    """(number of layers, query heads per layer) from the model's (text) config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise ValueError(
            f"model: its config ({type(config).__name__}) declares no num_hidden_layers / num_attention_heads, "
            "so heads cannot be checked"
        )
    return layers, heads


def resolve_heads(spec, num_layers: int, num_heads: int, name: str = "heads") -> dict[int, tuple[int, ...]]:
    """``{layer: (heads, ...)}`` sorted, from any accepted form; ``"all"`` names every head.

    Raises ValueError naming ``name`` for an unknown layer or head, an empty selection or
    an unreadable head set."""
    if isinstance(spec, str) and spec == "all":
        return {layer: tuple(range(num_heads)) for layer in range(num_layers)}
    if isinstance(spec, (str, os.PathLike)):
        spec = _read_head_set(spec, name)
    if isinstance(spec, Mapping) and spec.get("format") == HEAD_SET_FORMAT:
        spec = spec.get("heads")
    pairs: list[tuple[int, int]] = []
    if isinstance(spec, Mapping):
        for layer, heads in spec.items():
            layer = index(layer, name, "a layer index", num_layers)
            if isinstance(heads, int) and not isinstance(heads, bool):
                heads = [heads]
            if not isinstance(heads, (list, tuple, range)):
                raise ValueError(f"{name}: layer {layer} maps to {heads!r}; expected a list of head indices")
            pairs += [(layer, index(h, name, "a head index", num_heads, f" (layer {layer})")) for h in heads]
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"{name}: expected (layer, head) pairs, got {item!r}")
            layer = index(item[0], name, "a layer index", num_layers)
            pairs.append((layer, index(item[1], name, "a head index", num_heads, f" (layer {layer})")))
    else:
        raise ValueError(
            f"{name}: expected (layer, head) pairs, a {{layer: [heads]}} dict, 'all' or a head set saved by "
            f"`attnkit probe heads`, got {type(spec).__name__}"
        )
    if not pairs:
        raise ValueError(f"{name}: the selection names no head")
    out: dict[int, set[int]] = {}
    for layer, head in pairs:
        out.setdefault(layer, set()).add(head)
    return {layer: tuple(sorted(out[layer])) for layer in sorted(out)}


def _read_head_set(path, name: str):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{name}: cannot read a head set from {os.fspath(path)!r}: {err}") from None
    if not isinstance(data, Mapping) or data.get("format") != HEAD_SET_FORMAT:
        raise ValueError(
            f'{name}: {os.fspath(path)!r} is not a head set saved by `attnkit probe heads` (no "format": "{HEAD_SET_FORMAT}")'
        )
    return data
