"""A cell: one independent piece of a sweep, a kind and a JSON config, named by its content hash.

The hash covers the kind and the canonical JSON of the config (sorted keys, no
whitespace), so the same cell gets the same hash in any process, on any node and in any
later run: that is what resume and the results store key on. A grid's hash covers its
cells' hashes as a set, so reordering a grid keeps its store and adding a cell does not.

Seeds come from the config: a kind that needs randomness beyond what its config names
takes ``cell_seed(config)`` (a 63-bit number from the config's hash), never the clock or
the process, so a cell gives the same numbers wherever it runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


def canonical(config: dict) -> str:
    """The config as canonical JSON; an error naming the key whose value JSON cannot hold."""
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict of JSON values, got {type(config).__name__}")
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        for key, value in config.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise ValueError(f"config: {key!r} is not a JSON value ({value!r}: {e})") from None
        raise ValueError(f"config: not JSON ({e})") from None


def _digest(text: str, size: int = 8) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def cell_hash(kind: str, config: dict) -> str:
    """16 hex digits naming (kind, config)."""
    return _digest(kind + "\n" + canonical(config))


def cell_seed(config: dict) -> int:
    """A 63-bit seed from the config alone (the same on every node and in every run)."""
    return int(_digest("seed\n" + canonical(config)), 16) & (2**63 - 1)


@dataclass(frozen=True)
class Cell:
    """``kind``: a registered cell kind (see kinds.py); ``config``: its JSON parameters;
    ``label``: how progress lines name it (default: the hash)."""

    kind: str
    config: dict
    label: str = ""
    hash: str = field(init=False)

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind: expected a registered cell kind's name, got {self.kind!r}")
        config = json.loads(canonical(self.config))  # a private copy, exactly what the store keeps
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "hash", cell_hash(self.kind, config))
        if not self.label:
            object.__setattr__(self, "label", f"{self.kind} {self.hash}")


def grid_hash(cells: list[Cell]) -> str:
    """16 hex digits naming the grid: its cells' hashes as a set."""
    return _digest("\n".join(sorted({c.hash for c in cells})))


def check_cells(cells) -> list[Cell]:
    """The cells as a list, each once; an error naming the argument otherwise."""
    cells = list(cells)
    if not cells:
        raise ValueError("cells: expected at least one cell")
    bad = [c for c in cells if not isinstance(c, Cell)]
    if bad:
        raise ValueError(f"cells: expected Cell objects, got {type(bad[0]).__name__}")
    seen: dict[str, Cell] = {}
    for c in cells:
        if c.hash in seen:
            raise ValueError(f"cells: {c.label!r} appears twice (same kind and config, hash {c.hash})")
        seen[c.hash] = c
    return cells
