"""Length curricula: a run trained as a sequence of stages, each at its own lengths.

A model trained at one length rarely reads much longer prompts (RoPE positions it never
saw), and a retrieval circuit rarely forms from scratch at a long length: the curriculum
grows the length in stages (as in the length warm-up of Li et al., arXiv 2108.06084).
Training on the longest length alone makes shorter ones worse, so a stage may mix
lengths: its steps cycle through them, one length per step (a batch is one length, no
padding), keeping the tokens per step constant.

Written ``LENGTHS:STEPS[xBATCH]`` per stage, stages separated by commas:

    32:200,128:150x32,512:100x16,512+1024+2048:300x16

``LENGTHS`` is one length or several joined by ``+``; ``xBATCH`` is the batch at the
shortest length of the stage (default: the run's batch size), a longer length ``n`` of a
mixed stage gets ``max(1, BATCH · shortest // n)`` examples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

FORM = "LENGTHS:STEPS[xBATCH],... e.g. 32:200,128:150x32,512+1024:100x16 (LENGTHS one length or several joined by +)"

_STAGE = re.compile(r"^\s*(\d+(?:\+\d+)*)\s*:\s*(\d+)\s*(?:x\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Stage:
    """``steps`` optimisation steps cycling through ``lengths``; ``batch_size`` at the
    shortest of them (None: the run's)."""

    lengths: tuple[int, ...]
    steps: int
    batch_size: int | None = None

    def __post_init__(self):
        lengths = tuple(self.lengths)
        if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(f"schedule: a stage's lengths must be positive ints, got {self.lengths!r}; expected {FORM}")
        if len(set(lengths)) != len(lengths):
            raise ValueError(f"schedule: a stage names each length once, got {'+'.join(map(str, lengths))}")
        for name, value in (("steps", self.steps), ("batch_size", self.batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"schedule: a stage's {name} must be a positive int, got {value!r}; expected {FORM}")
        object.__setattr__(self, "lengths", lengths)

    def length_at(self, offset: int) -> int:
        """The length of the stage's step ``offset`` (0-based)."""
        return self.lengths[offset % len(self.lengths)]

    def batch_at(self, length: int, default: int) -> int:
        """Examples per step at ``length``: tokens per step kept at the shortest length's."""
        batch = self.batch_size or default
        return max(1, batch * min(self.lengths) // length)

    def text(self) -> str:
        return "+".join(map(str, self.lengths)) + f":{self.steps}" + (f"x{self.batch_size}" if self.batch_size else "")


def parse_schedule(text: str) -> tuple[Stage, ...]:
    """``"32:200,128:150x32"`` -> stages; a ValueError naming ``schedule`` and the form."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"schedule: expected {FORM}, got {text!r}")
    stages = []
    for part in text.split(","):
        match = _STAGE.match(part)
        if match is None:
            raise ValueError(f"schedule: {part.strip()!r} is not a stage; expected {FORM}")
        lengths, steps, batch = match.groups()
        stages.append(Stage(tuple(int(n) for n in lengths.split("+")), int(steps), int(batch) if batch else None))
    return tuple(stages)


def as_stages(value) -> tuple[Stage, ...] | None:
    """A schedule given as text, stages, or dicts (as JSON gives them back) -> stages."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_schedule(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"schedule: expected {FORM} or a list of stages, got {value!r}")
    stages = []
    for item in value:
        if isinstance(item, Stage):
            stages.append(item)
        elif isinstance(item, dict) and set(item) <= {"lengths", "steps", "batch_size"}:
            steps = cast(int, item.get("steps"))  # a JSON value, as given
            stages.append(Stage(tuple(item.get("lengths", ())), steps, item.get("batch_size")))
        else:
            raise ValueError(f"schedule: expected stages (lengths, steps, batch_size), got {item!r}")
    return tuple(stages)


def schedule_text(stages) -> str:
    return ",".join(s.text() for s in stages)


def all_lengths(stages) -> tuple[int, ...]:
    """Every length the schedule trains at, ascending."""
    return tuple(sorted({n for s in stages for n in s.lengths}))


__all__ = ["FORM", "Stage", "all_lengths", "as_stages", "parse_schedule", "schedule_text"]
