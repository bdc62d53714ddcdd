"""Named attention mechanisms from the literature, one file per family."""

import importlib

from .base import Mechanism, available, get_mechanism, register

# Modules that register mechanisms; imported on first use so `import attnkit` stays fast.
_MODULES = ("softmax",)


def _load_all() -> None:
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")


__all__ = ["Mechanism", "available", "get_mechanism", "register"]
