"""attnkit: attention mechanisms from the literature behind one exact, fast API."""

from .api import attention, explain
from .mods import (
    Mask,
    ScoreMod,
    alibi,
    bias,
    causal,
    dilated,
    document,
    log_length_scale,
    neighborhood_1d,
    neighborhood_2d,
    neighborhood_3d,
    padding,
    prefix_lm,
    relative_bias,
    softcap,
    temperature,
    window,
)

__version__ = "0.1.0"

__all__ = [
    "attention", "explain", "Mask", "ScoreMod",
    "causal", "window", "prefix_lm", "document", "dilated", "neighborhood_1d", "neighborhood_2d",
    "neighborhood_3d", "padding", "alibi", "softcap", "temperature", "log_length_scale",
    "relative_bias", "bias",
]
