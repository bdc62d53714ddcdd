"""The arena's synthetic tasks, one file per family, each citing its source.

task = make_task("mqar", seq_len=64, num_kv_pairs=(4, 8))
batch = task.sample(32, torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from dataclasses import fields

from .associative import AssociativeRetrieval
from .base import IGNORE, Batch, Task
from .induction import Induction
from .mqar import MQAR
from .needle import Needle
from .regression import LinearRegression
from .selective_copy import SelectiveCopy
from .variable_tracking import VariableTracking

TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (MQAR, AssociativeRetrieval, SelectiveCopy, Induction, LinearRegression, VariableTracking, Needle)
}


def make_task(name: str, **params) -> Task:
    """The task registered as ``name`` with ``params`` overriding its defaults."""
    if name not in TASKS:
        raise ValueError(f"task: unknown name {name!r}; available: {', '.join(TASKS)}")
    cls = TASKS[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"task parameters: {name} has no {', '.join(unknown)}; it takes {', '.join(sorted(known))}")
    return cls(**params)


__all__ = [
    "IGNORE",
    "TASKS",
    "AssociativeRetrieval",
    "Batch",
    "Induction",
    "LinearRegression",
    "MQAR",
    "Needle",
    "SelectiveCopy",
    "Task",
    "VariableTracking",
    "make_task",
]
