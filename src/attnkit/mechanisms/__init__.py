"""Named attention mechanisms from the literature, one file per family."""

import importlib
import pkgutil

from .base import Mechanism, available, get_mechanism, mechanism_class, register
from .build import build_mechanism

_loaded = False


# Modules are found, not listed: a new family file registers without editing this one.
# Imported once per process, with this package (about 0.1 s; `import attnkit` alone does not
# import it), so that a lookup is a dict access that torch.compile traces: a directory scan
# per call cost ~0.4 ms and broke fullgraph.
def family_modules() -> list[str]:
    """Names of the package's modules and subpackages (each may register mechanisms)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for name in family_modules():
        importlib.import_module(f"{__name__}.{name}")
    _loaded = True


_load_all()

__all__ = ["Mechanism", "available", "build_mechanism", "get_mechanism", "mechanism_class", "register"]
