"""``attnkit inspect`` on a diffusers pipeline: load it from a local directory, sample once
and measure per-token cross-attention maps, over all steps and per step range.

The maps come from ``attnkit.diffusion.maps`` (O(N_image x N_text) state, no N x N map):
one ``TokenMaps`` for the whole run and one per step range, all fed in the same pass.
"""

from __future__ import annotations

import inspect as pyinspect
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor
DEFAULT_PROMPT = "a photo of a cat sitting on a mat"


def is_pipeline_dir(path) -> bool:
    """Whether ``path`` is a diffusers pipeline directory (it holds ``model_index.json``)."""
    return isinstance(path, str) and os.path.isdir(path) and os.path.isfile(os.path.join(path, "model_index.json"))


def load_local_pipeline(path: str):
    """A diffusers pipeline from a local directory, offline, weights from safetensors only
    (no pickled ``.bin`` is ever unpickled), float32, progress bars off."""
    if not is_pipeline_dir(path):
        raise ValueError(f"model: {path} is not a diffusers pipeline directory (it has no model_index.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..extras import require

    diffusers = require("diffusers", "attnkit inspect on a diffusers pipeline")
    from diffusers.utils import logging as d_logging

    verbosity = d_logging.get_verbosity()
    d_logging.set_verbosity_error()  # "accelerate not found" and similar: not the user's concern here
    d_logging.disable_progress_bar()
    try:  # the text encoder loads through transformers, with a progress bar of its own
        from transformers.utils import logging as t_logging

        t_logging.disable_progress_bar()
    except ImportError:  # a pipeline without transformers components
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch_dtype's rename in newer diffusers
            pipe = diffusers.DiffusionPipeline.from_pretrained(
                path, local_files_only=True, use_safetensors=True, torch_dtype=torch.float32
            )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: could not load a diffusers pipeline from {path} (local safetensors files only): {e}") from e
    finally:
        d_logging.set_verbosity(verbosity)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe


@dataclass
class PipelineMaps:
    """What ``inspect_pipeline`` measured, for the prompt's batch row (the conditional
    row under classifier-free guidance). ``tokens``: the names of the text tokens shown
    (the prompt's, without padding); ``overall``: (T, h, w) maps over every step;
    ``ranges``: [(label, (first, last) step, (T, h, w) maps)]; ``image``: the decoded
    image (H, W, 3) in [0, 1] when the pipeline returned one; ``meta``: the run's
    settings (model, prompt, steps, guidance, seed, layers, state bytes, seconds)."""

    tokens: list[str]
    overall: Tensor
    ranges: list[tuple[str, tuple[int, int], Tensor]]
    image: object = None
    meta: dict = field(default_factory=dict)


def step_ranges(steps: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges of denoising steps 0..steps-1, as (first, last)."""
    if parts < 1 or parts > steps:
        raise ValueError(f"ranges: expected between 1 and the {steps} steps, got {parts}")
    bounds = [round(i * steps / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def inspect_pipeline(
    pipeline,
    prompt: str | None = None,
    *,
    prompt_embeds: dict | None = None,
    steps: int = 10,
    guidance: float | None = None,
    size: tuple[int, int] | None = None,
    seed: int = 0,
    ranges: int = 2,
    layers=None,
    heads=None,
    progress=None,
) -> PipelineMaps:
    """Sample once with ``pipeline`` and measure its per-token attention maps.

    Args:
        prompt: the text (the pipeline's own tokenizer and text encoder embed it).
        prompt_embeds: instead of a prompt, {"prompt_embeds": (1, T, D), and
            "negative_prompt_embeds" under guidance} for a pipeline without a text
            encoder; tokens are then named by position.
        steps, guidance, size (height, width in pixels), seed: the sampling call.
        ranges: how many contiguous step ranges get maps of their own (2: early, late).
        layers, heads: what ``attnkit.diffusion.maps`` aggregates (module paths; heads).
        progress: called once per denoising step (when the pipeline has step callbacks).
    """
    from ..diffusion.maps import maps
    from ..diffusion.tokenmaps import TokenMaps

    if (prompt is None) == (prompt_embeds is None):
        raise ValueError("prompt: pass either a prompt or prompt_embeds")
    if prompt is not None and (getattr(pipeline, "tokenizer", None) is None or getattr(pipeline, "text_encoder", None) is None):
        raise ValueError(
            "prompt: the pipeline has no tokenizer and text encoder to embed a prompt; pass prompt_embeds "
            "(a safetensors file with 'prompt_embeds' and 'negative_prompt_embeds')"
        )
    if prompt_embeds is not None and "negative_prompt_embeds" not in prompt_embeds and (guidance is None or guidance > 1):
        raise ValueError(
            "prompt_embeds: classifier-free guidance needs 'negative_prompt_embeds' too; add them or set guidance to 1"
        )
    spans = step_ranges(steps, ranges)
    per_range = [TokenMaps(heads=heads, steps=range(lo, hi + 1)) for lo, hi in spans]
    call: dict[str, Any] = dict(num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np")
    if guidance is not None:
        call["guidance_scale"] = guidance
    if size is not None:
        call["height"], call["width"] = size
    if prompt_embeds is not None:
        call.update(prompt_embeds)
    accepted = _call_parameters(pipeline)
    if progress is not None and "callback_on_step_end" in accepted:

        def on_step(pipe, i, t, kwargs):
            progress(f"step {i + 1}")
            return {}

        call["callback_on_step_end"] = on_step
    started = time.perf_counter()
    result = maps(pipeline, prompt, layers=layers, heads=heads, meters=per_range, **call)
    seconds = time.perf_counter() - started
    first = result.maps.shape[0] - result.conditional.shape[0]  # the prompt's row (after the unconditional)
    height, width = result.maps.shape[-2:]
    grid = (height, width)
    count = result.maps.shape[1]
    names, shown = _token_names(pipeline, prompt, result.tokens, count)
    overall = result.maps[first, :shown].float()
    by_range = []
    for (lo, hi), meter in zip(spans, per_range):
        label = f"steps {lo}–{hi}" if hi > lo else f"step {lo}"
        by_range.append((label, (lo, hi), meter.maps(grid)[first, :shown].float()))
    image = _image(result.output)
    meta = {
        "prompt": prompt,
        "steps": steps,
        "guidance": guidance,
        "size": list(size) if size else None,
        "seed": seed,
        "layers": list(result.names.values()),
        "grid": list(grid),
        "text_tokens": count,
        "tokens_shown": shown,
        "state_bytes": result.state_bytes,
        "seconds": seconds,
    }
    return PipelineMaps(names, overall, by_range, image, meta)


def _call_parameters(pipeline) -> set[str]:
    try:
        return set(pyinspect.signature(pipeline.__call__).parameters)
    except (TypeError, ValueError):
        return set()


def _token_names(pipeline, prompt, tokens, count: int) -> tuple[list[str], int]:
    """The names of the tokens to show and how many: the prompt's tokens up to its end
    (padding left out) when the tokenizer names them, else every position."""
    if tokens is None or len(tokens) != count:
        return [f"token {i}" for i in range(count)], count
    shown = count
    try:
        ids = pipeline.tokenizer(prompt, truncation=True, max_length=count).input_ids
        shown = max(1, min(len(ids), count))
    except Exception:  # a tokenizer without these options: show every position
        pass
    return [str(t) for t in tokens[:shown]], shown


def _image(output):
    images = getattr(output, "images", None)
    if images is None and isinstance(output, tuple) and output:
        images = output[0]
    try:
        import numpy as np

        arr = np.asarray(images[0], dtype=np.float32)
    except (TypeError, IndexError, ValueError):
        return None
    return arr if arr.ndim == 3 and arr.shape[-1] in (1, 3) else None


def load_prompt_embeds(path: str) -> dict:
    """{"prompt_embeds", "negative_prompt_embeds"?} from a safetensors file (no pickle)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt_embeds: no such file: {path}")
    from ..extras import require

    st = require("safetensors.torch", "--prompt-embeds", extra="diffusion")
    try:
        tensors = st.load_file(path)
    except Exception as e:  # a file that is not safetensors: say so, never fall back to pickle
        raise ValueError(f"prompt_embeds: {path} is not a safetensors file: {e}") from e
    unknown = set(tensors) - {"prompt_embeds", "negative_prompt_embeds"}
    if "prompt_embeds" not in tensors or unknown:
        raise ValueError(
            f"prompt_embeds: {path} must hold 'prompt_embeds' (and optionally 'negative_prompt_embeds'), got {sorted(tensors)}"
        )
    for name, t in tensors.items():
        if t.dim() != 3 or t.shape[0] != 1:
            raise ValueError(f"prompt_embeds: {name} in {path} must be (1, tokens, dim), got {tuple(t.shape)}")
    return {name: t.float() for name, t in tensors.items()}


__all__ = [
    "DEFAULT_PROMPT",
    "PipelineMaps",
    "inspect_pipeline",
    "is_pipeline_dir",
    "load_local_pipeline",
    "load_prompt_embeds",
    "step_ranges",
]
