"""Argument checks shared by probes and steering interventions. Each raises ValueError
whose message starts with the Python keyword checked (``"top: expected ..."``); the
command line maps a keyword to its option (``cli.options.options_named``), so a probe or an
intervention writes its checks once for both."""

from __future__ import annotations

import math
import numbers


def integer(value, name: str, low: int | None, what: str | None = None) -> int:
    """``value`` as an int >= ``low`` (any int for ``low=None``, e.g. a seed; bools
    refused); ``what`` says what it counts."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (low is not None and value < low):
        kind = "an int" if low is None else f"an int >= {low}"
        expected = f"{what} ({kind})" if what else kind
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def index(value, name: str, noun: str, limit: int, where: str = "") -> int:
    """``value`` as an index in [0, limit) (digits in a string, as JSON object keys are,
    accepted); ``noun`` (e.g. "a layer index") and ``where`` say what it indexes."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value >= limit:
        raise ValueError(f"{name}: expected {noun} below {limit}{where}, got {value!r}")
    if value < 0:  # indices count from 0 here, never from the end
        raise ValueError(f"{name}: expected {noun} >= 0 and below {limit}{where}, got {value!r}")
    return value


def number(value, name: str, low: float | None = None, high: float | None = None, open_low: bool = False) -> float:
    """``value`` as a finite float in [low, high] (``open_low``: above ``low``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value <= low if open_low else value < low):
        raise ValueError(f"{name}: expected a number {'>' if open_low else '>='} {low:g}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name}: expected a number <= {high:g}, got {value!r}")
    return value
