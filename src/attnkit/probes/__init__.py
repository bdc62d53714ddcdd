"""Probes: tests of a model's behaviour and its attention side by side, on any local
transformers model, through attnkit's kernels (no eager attention, O(N) memory).

A probe is a function ``(model, tokenizer, **params) -> ProbeResult``; ``model`` may also
be a directory (an arena export, any transformers model) or None for the bundled
all-MiniLM-L6-v2 where the probe fits an encoder.

    from attnkit import probes
    result = probes.run("heads", "path/to/model")
    print(result.table("layer", "head", "induction"))
"""

from __future__ import annotations

import importlib

from .model import ProbeModel, as_probe_model, load_probe_model
from .result import ProbeResult, Table
from .scoring import string_match_all, string_match_part

#: probe name -> "module:function" inside attnkit.probes (imported on first use), or the
#: probe function itself (``register_probe``)
PROBES = {
    "needle": "needle:needle",
    "kv-retrieval": "kv_retrieval:kv_retrieval",
    "ruler": "ruler:ruler",
    "heads": "heads:heads",
    "position-bias": "position_bias:position_bias",
    "interference": "interference:interference",
    "visual": "visual:visual",
    "kv-curves": "kv_curves:kv_curves",
    "head-ablation": "ablation:head_ablation",
}


def available() -> list[str]:
    return list(PROBES)


def register_probe(name: str, function) -> None:
    """Register ``function(model, tokenizer, **params) -> ProbeResult`` as probe ``name``
    (its keywords become ``attnkit probe NAME``'s options); a probe outside attnkit is one
    file with this call in it."""
    if not isinstance(name, str) or not name or not callable(function):
        raise ValueError(f"register_probe: expected a name and a probe function, got {name!r}, {function!r}")
    PROBES[name] = function


def get_probe(name: str):
    """The probe function registered as ``name``."""
    if name not in PROBES:
        raise ValueError(f"probe: unknown probe {name!r}; expected one of {', '.join(PROBES)}")
    if callable(PROBES[name]):
        return PROBES[name]
    module, function = PROBES[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)


def run(name: str, model=None, tokenizer=None, **params) -> ProbeResult:
    """Run probe ``name`` on ``model`` (a model, a directory, or None for the default)."""
    return get_probe(name)(model, tokenizer, **params)


__all__ = [
    "PROBES",
    "ProbeModel",
    "ProbeResult",
    "Table",
    "as_probe_model",
    "available",
    "get_probe",
    "load_probe_model",
    "register_probe",
    "run",
    "string_match_all",
    "string_match_part",
]
