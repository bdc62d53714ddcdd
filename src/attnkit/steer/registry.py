"""Steering interventions by name, as probes are (``attnkit.probes.PROBES``): what
``attnkit probe NAME --steer KIND:key=value:...`` can ask for.

An entry says which keywords the command line may set (besides ``heads``, which every
intervention takes), which of them are required, their defaults, how each text value
becomes a Python value, and an example for the error that asks for a missing one.
``cli/steer_spec.py`` reads this table; adding an intervention to the command line is
one ``register_intervention`` call beside its code:

    register_intervention("scale", scale, params={"factor": number}, required=("factor",),
                          example="scale:heads=all:factor=0.5")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def number(text: str) -> float:
    """A finite float from the command line's text (ValueError otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return value


def text(value: str) -> str:
    return value


@dataclass(frozen=True)
class InterventionEntry:
    """``build(heads, **params)`` -> an ``Intervention``; ``params`` maps each keyword the
    command line may set to its parser (text -> value, ValueError when it does not read)."""

    name: str
    build: Callable
    params: Mapping[str, Callable[[str], object]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    defaults: Mapping[str, str] = field(default_factory=dict)
    example: str = ""

    @property
    def keys(self) -> tuple[str, ...]:
        """Every keyword a spec may set, ``heads`` first."""
        return ("heads", *self.params)


#: name -> entry, in registration order
INTERVENTIONS: dict[str, InterventionEntry] = {}


def register_intervention(
    name: str,
    build: Callable,
    *,
    params: Mapping[str, Callable[[str], object]] | None = None,
    required: tuple[str, ...] = (),
    defaults: Mapping[str, str] | None = None,
    example: str = "",
) -> InterventionEntry:
    """Register ``build(heads, **params)`` as intervention ``name``; a second registration
    of a name replaces the first (the last one imported wins, as for mechanisms)."""
    if not isinstance(name, str) or not name or ":" in name or "=" in name:
        raise ValueError(f"name: expected a name without ':' or '=', got {name!r}")
    params = dict(params or {})
    if "heads" in params:
        raise ValueError("params: every intervention takes heads; list only its other keywords")
    unknown = [k for k in (*required, *(defaults or {})) if k not in params]
    if unknown:
        raise ValueError(f"required/defaults: {unknown} are not among params {list(params)}")
    entry = InterventionEntry(name, build, params, tuple(required), dict(defaults or {}), example)
    INTERVENTIONS[name] = entry
    return entry


def available() -> list[str]:
    return list(INTERVENTIONS)


def get_intervention(name: str) -> InterventionEntry:
    if name not in INTERVENTIONS:
        raise ValueError(f"name: unknown intervention {name!r}; expected one of {', '.join(INTERVENTIONS)}")
    return INTERVENTIONS[name]
