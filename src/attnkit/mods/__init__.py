"""Masks and score modifications shared by every backend (the FlexAttention convention)."""

from .grid import EMPTY, FULL, PARTIAL, TileGrid
from .masks import (
    Mask,
    as_mask,
    band_of,
    causal,
    dilated,
    document,
    index_tensors,
    neighborhood_1d,
    neighborhood_2d,
    neighborhood_3d,
    padding,
    prefix_lm,
    window,
)
from .scores import (
    AffineForm,
    ScoreMod,
    affine_form,
    alibi,
    alibi_slopes,
    as_score,
    bias,
    log_length_scale,
    relative_bias,
    softcap,
    temperature,
)

__all__ = [
    "EMPTY", "FULL", "PARTIAL", "TileGrid", "Mask", "ScoreMod", "AffineForm",
    "as_mask", "as_score", "affine_form", "band_of", "index_tensors", "alibi_slopes",
    "causal", "window", "prefix_lm", "document", "dilated", "neighborhood_1d",
    "neighborhood_2d", "neighborhood_3d", "padding",
    "alibi", "softcap", "temperature", "log_length_scale", "relative_bias", "bias",
]
