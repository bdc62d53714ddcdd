"""``attnkit inspect --image``: a vision-language model answers a prompt about an image,
with a ``VisualAttention`` meter on every decoder layer while it generates.

The meter watches the query rows that predict generated tokens (from the last prompt
token on), so the profile says what the answer looked at: per head, the visual share
and its concentration, the mass each image token received (the report's patch-grid
overlay) and the share at every generated token (the report's curves).
"""

from __future__ import annotations

import os
import time

import torch

from ..extras import require
from .profile import AttentionProfile


def load_vlm(path: str):
    """(model, processor) from a local vision-language model directory (or an organism
    by name), offline, float32, eval mode."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"model: expected a directory path, got {path!r}")
    from ..organisms.store import resolve_model_path

    path = resolve_model_path(path, "model")
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: {path} is not a transformers model directory (no config.json)")
    require("transformers", "attnkit inspect --image")
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model: could not load a vision-language model from {path}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model: {path} has no usable processor ({e}); save one with processor.save_pretrained(path)") from e
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"model: {path}'s processor has no image processor; --image needs a vision-language model's processor")
    return model.eval(), processor


def read_image(path: str):
    """An RGB ``PIL.Image`` from a PNG/JPEG file."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # Pillow comes with matplotlib, the [report] extra
        raise ImportError("attnkit inspect --image reads images with Pillow: pip install 'attnkit[report]'") from None

    if not os.path.isfile(path):
        raise ValueError(f"image: no such file: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"image: {path} is not an image Pillow can read ({e})") from e


def with_placeholder(processor, prompt: str) -> str:
    """``prompt`` with the processor's image placeholder in front unless it has one."""
    token = getattr(processor, "image_token", None) or getattr(getattr(processor, "tokenizer", None), "image_token", None)
    if not isinstance(token, str) or not token:
        raise ValueError("model: its processor names no image token (processor.image_token)")
    count = prompt.count(token)
    if count > 1:
        raise ValueError(f"inputs: the prompt holds {count} image placeholders {token!r} for one --image")
    return prompt if count == 1 else f"{token} {prompt}"


def inspect_image(
    model, processor, image, prompt: str, *, max_new_tokens: int = 16, layers=None, heads=None, top_k: int = 4, progress=None
) -> AttentionProfile:
    """Generate an answer to ``prompt`` about ``image`` with a ``VisualAttention`` meter
    on (see the module docstring); returns the profile the report is drawn from."""
    from .. import hf, vision

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    text = with_placeholder(processor, prompt)
    inputs = dict(processor(images=[image], text=[text], return_tensors="pt"))
    spans = vision.image_spans(model, inputs)
    meter = spans.meter(top_k=top_k, layers=layers, heads=heads, queries=(spans.first_step, None))
    start = time.perf_counter()
    with torch.no_grad(), hf.use(model, observers=[meter]):
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(1)
    ids = out[0].tolist()
    tokenizer = processor.tokenizer
    tokens = [tokenizer.decode([i]) for i in ids]
    n0 = spans.length
    arrays = meter.arrays()
    config = model.config.get_text_config()
    meta = {
        "model_type": model.config.model_type,
        "tokens": len(ids),
        "prompt_tokens": n0,
        "seconds": seconds,
        "mechanism": "softmax",
        "meters": {"visual": meter.meta()},
        "vision": {
            "family": spans.family,
            "prompt": prompt,
            "images": [
                {"row": im.row, "start": im.start, "end": im.end, "grid": list(im.grid) if im.grid else None}
                for im in spans.images
            ],
            "generated": tokenizer.decode(ids[n0:], skip_special_tokens=True),
            "steps": len(ids) - n0,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
        },
    }
    return AttentionProfile(
        meter.rows(),
        tokens,
        meta,
        {
            "visual_share": arrays["visual_share"],
            "visual_received": {key: {"values": v} for key, v in arrays["visual_received"].items()},
        },
    )
