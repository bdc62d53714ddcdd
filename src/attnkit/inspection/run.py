"""``attnkit.inspect``: run a model once with meters on every attention call.

The model runs under ``attnkit.hf.use``: its attention goes through attnkit's exact
kernels, and the meters see each layer's weights tile by tile in a second pass with
the final log-normaliser, so nothing N x N is ever held (the eager alternative,
``output_attentions=True``, keeps L x H x N^2 floats).
"""

from __future__ import annotations

import inspect as _pyinspect
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..observe import METERS, TOKEN_VIEW_LIMIT, Meter, Observer, Selection
from .profile import AttentionProfile

DEFAULT_METERS = ("sink", "entropy", "distance", "logits", "topkeys")


class _LayerProgress(Observer):
    """Calls ``progress("layer i")`` after each attention call; asks for no tile."""

    def __init__(self, progress):
        self.progress = progress

    def wants(self, call):
        return Selection(heads=())

    def end(self, call):
        self.progress(f"layer {call.layer}")


def model_shape(model) -> tuple[int, int, int | None]:
    """(layers, query heads, max positions or None) from a transformers config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise ValueError(f"model: its config ({type(config).__name__}) gives no layer or head count")
    return layers, heads, positions if isinstance(positions, int) else None


def encode(inputs, tokenizer, max_tokens: int | None, max_positions: int | None) -> tuple[dict, int | None]:
    """Model inputs as a dict of (B, N) tensors, and the length before truncation (or None)."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    if isinstance(inputs, str):
        if tokenizer is None:
            raise ValueError("tokenizer: needed to read text inputs (pass the model's tokenizer, or token ids)")
        if not inputs.strip():
            raise ValueError("inputs: the text is empty")
        n = len(tokenizer(inputs)["input_ids"])
        if max_tokens is not None and n > max_tokens:
            enc = tokenizer(inputs, return_tensors="pt", truncation=True, max_length=max_tokens)
        else:
            enc = tokenizer(inputs, return_tensors="pt")
        enc = dict(enc)
    elif isinstance(inputs, torch.Tensor):
        if inputs.dim() not in (1, 2) or inputs.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"inputs: expected token ids of shape (N,) or (B, N), integer dtype; got {inputs.dtype} {tuple(inputs.shape)}"
            )
        enc = {"input_ids": inputs.view(1, -1) if inputs.dim() == 1 else inputs}
        n = enc["input_ids"].shape[1]
    elif isinstance(inputs, Mapping) or hasattr(inputs, "keys"):
        enc = dict(inputs)
        ids = enc.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(
                "inputs: a mapping must hold 'input_ids' of shape (B, N), as a tokenizer returns with return_tensors='pt'"
            )
        n = ids.shape[1]
    else:
        raise ValueError(f"inputs: expected text, token ids or a tokenizer's output, got {type(inputs).__name__}")
    if n == 0 or enc["input_ids"].shape[1] == 0:
        raise ValueError("inputs: no tokens to inspect")
    truncated_from = None
    if max_tokens is not None and n > max_tokens:
        warnings.warn(f"inputs: {n} tokens truncated to the first {max_tokens} (max_tokens)", stacklevel=3)
        enc = {
            k: (v[:, :max_tokens] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == n else v)
            for k, v in enc.items()
        }
        truncated_from = n
    length = enc["input_ids"].shape[1]
    if max_positions is not None and length > max_positions:
        raise ValueError(
            f"inputs: {length} tokens, but the model reads at most {max_positions} positions; "
            f"pass max_tokens={max_positions} (--max-tokens {max_positions}) to truncate"
        )
    return enc, truncated_from


def build_meters(meters, n_tokens: int, layers, heads, queries, spans, top_k: int) -> list[Meter]:
    """Meter instances from names (restricted by layers/heads/queries) or instances."""
    names = list(DEFAULT_METERS if n_tokens <= TOKEN_VIEW_LIMIT else DEFAULT_METERS[:-1]) if meters is None else list(meters)
    if meters is None and spans:
        names.append("spans")
    if not names:
        raise ValueError("meters: expected at least one meter")
    restrict = {"layers": layers, "heads": heads, "queries": queries}
    built = []
    for m in names:
        if isinstance(m, Meter):
            built.append(m)
            continue
        if m not in METERS:
            raise ValueError(f"meters: unknown meter {m!r}; expected some of {', '.join(METERS)} or Meter instances")
        if m == "spans":
            if not spans:
                raise ValueError("meters: 'spans' needs spans={name: (start, end)} of token positions")
            built.append(METERS[m](spans, **restrict))
        elif m == "topkeys":
            built.append(METERS[m](k=top_k, **restrict))
        elif m == "entropy":
            built.append(METERS[m](per_query=n_tokens <= TOKEN_VIEW_LIMIT, **restrict))
        elif m == "sink":  # also the last key: encoders park attention on [SEP] (Clark et al. 2019, arXiv 1906.04341)
            built.append(METERS[m](positions=(-1,), **restrict))
        else:
            built.append(METERS[m](**restrict))
    kinds = [type(m) for m in built]
    if len(set(kinds)) != len(kinds):
        raise ValueError("meters: each meter kind at most once (their metric names would collide)")
    return built


def inspect(
    model,
    inputs,
    *,
    tokenizer=None,
    meters=None,
    layers=None,
    heads=None,
    queries=None,
    spans: dict | None = None,
    mechanism="softmax",
    max_tokens: int | None = None,
    top_k: int = 8,
    progress=None,
) -> AttentionProfile:
    """Measure attention inside ``model`` on ``inputs`` with O(N) memory.

    Args:
        model: a transformers (>= 5) model whose attention goes through AttentionInterface.
        inputs: text (with ``tokenizer``), token ids (N,) or (B, N), or a tokenizer's output.
        meters: names from ``attnkit.observe.METERS`` ("sink", "entropy", "distance",
            "logits", "topkeys", "spans") or Meter instances; default: all but "spans"
            ("topkeys" only up to 512 tokens), plus "spans" when ``spans`` is given.
        layers, heads, queries: restrict the meters built from names (see ``Meter``).
        spans: {name: (start, end)} token positions for the "spans" meter.
        mechanism: run the model with another attention mechanism (name or instance).
        max_tokens: truncate longer inputs to this many tokens (with a warning); without
            it, an input longer than the model's positions is an error.
        top_k: keys kept per query by "topkeys".
        progress: called with "layer i" after each layer's attention.
    """
    from .. import hf

    n_layers, n_heads, max_positions = model_shape(model)
    for name, values, limit in (("layers", layers, n_layers), ("heads", heads, n_heads)):
        if values is not None:
            bad = [v for v in ([values] if isinstance(values, int) else values) if not isinstance(v, int) or not 0 <= v < limit]
            if bad:
                raise ValueError(f"{name}: {bad} out of range; the model has {limit} {name} (0..{limit - 1})")
    enc, truncated_from = encode(inputs, tokenizer, max_tokens, max_positions)
    batch, n = enc["input_ids"].shape
    built = build_meters(meters, n, layers, heads, queries, spans, top_k)
    observers = built + ([_LayerProgress(progress)] if progress is not None else [])
    # The bare transformer: a language-model head would add an (N x vocab) logits tensor.
    body = getattr(model, "base_model", model)
    kwargs = dict(enc)
    if "use_cache" in _pyinspect.signature(body.forward).parameters:
        kwargs["use_cache"] = False  # a KV cache is not needed for one pass
    start = time.perf_counter()
    with torch.no_grad(), hf.use(model, mechanism=mechanism, observers=observers):
        body(**kwargs)
    seconds = time.perf_counter() - start

    rows, meta_meters = [], {}
    arrays: dict[str, dict[tuple[int, int], Any]] = {}
    for m in built:
        rows += m.rows()
        for name, per_head in m.arrays().items():
            arrays.setdefault(name, {}).update(per_head)
        meta_meters[m.name] = m.meta()
    if not rows:
        raise ValueError("meters: measured nothing; do the layers/heads/queries restrictions match any attention call?")
    tokens = None
    if tokenizer is not None and batch == 1:
        tokens = [str(t) for t in tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())]
    meta = {
        "model": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
        "model_type": getattr(model.config, "model_type", type(model).__name__),
        "layers": n_layers,
        "heads": n_heads,
        "tokens": n,
        "batch": batch,
        "truncated_from": truncated_from,
        "mechanism": mechanism if isinstance(mechanism, str) else getattr(mechanism, "name", type(mechanism).__name__),
        "meters": meta_meters,
        "seconds": seconds,
    }
    return AttentionProfile(rows, tokens, meta, arrays)
