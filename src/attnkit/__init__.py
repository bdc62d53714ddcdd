"""attnkit: attention mechanisms from the literature behind one exact, fast API."""

from .api import attention, explain
from .approx import ApproxError, approx_error
from .inspection import AttentionProfile, inspect
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

# Subpackages loaded on first attribute access (some import transformers) so that
# `import attnkit` stays fast: `attnkit.hf.use(...)` and `attnkit.mechanisms.available()`
# work after a plain `import attnkit`.
_LAZY_SUBPACKAGES = ("mechanisms", "hf", "nn", "report", "arena", "probes", "bench", "kv", "diffusion")


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "attention",
    "explain",
    "approx_error",
    "ApproxError",
    "inspect",
    "AttentionProfile",
    "Mask",
    "ScoreMod",
    "causal",
    "window",
    "prefix_lm",
    "document",
    "dilated",
    "neighborhood_1d",
    "neighborhood_2d",
    "neighborhood_3d",
    "padding",
    "alibi",
    "softcap",
    "temperature",
    "log_length_scale",
    "relative_bias",
    "bias",
]
