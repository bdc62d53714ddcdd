"""Named attention mechanisms from the literature, one file per family."""

import importlib
import pkgutil

from .base import Mechanism, available, get_mechanism, mechanism_class, register

# Modules are found, not listed: a new family file registers without editing this one.
# Imported on first use (available(), get_mechanism()) so `import attnkit` stays fast.
def family_modules() -> list[str]:
    """Names of the package's modules and subpackages (each may register mechanisms)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def _load_all() -> None:
    for name in family_modules():
        importlib.import_module(f"{__name__}.{name}")


__all__ = ["Mechanism", "available", "get_mechanism", "mechanism_class", "register"]
