"""Named attention mechanisms from the literature, one file per family."""

import importlib

from .base import Mechanism, available, get_mechanism, mechanism_class, register

# Modules that register mechanisms; imported on first use so `import attnkit` stays fast.
_MODULES = ("softmax", "neighborhood", "hyper_attention", "native_sparse", "block_sparse", "linear", "sigmoid", "signed", "stick_breaking", "selective", "topk", "forgetting", "adaptive_span", "differential", "talking_heads", "multi_token")


def _load_all() -> None:
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")


__all__ = ["Mechanism", "available", "get_mechanism", "mechanism_class", "register"]
