"""What a synthetic task is: a seeded generator of batches, and how its outputs are scored.

A task is a frozen dataclass of its parameters (so ``dataclasses.replace`` makes the same
task at another length) with:

- ``sample(n, generator)``: ``n`` examples drawn with ``generator`` only, so a seed fixes
  the data exactly;
- ``loss(outputs, batch)`` and ``scored(outputs, batch)``: the training loss and, per
  target position, whether the model got it right;
- ``model_kind``: which model reads its inputs (``"lm"`` token ids, ``"retrieval"``
  key/value pairs and one query read by a single attention layer, ``"vectors"``
  real-valued inputs; see ``attnkit.arena.models``).

Targets sit at the position whose output must predict them (the LM convention of
``TransformerLM(idx, targets)``): ``targets[b, i]`` is what the output at position ``i``
should be, ``IGNORE`` where nothing is asked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import Field, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: target of a position that is not scored (the ``ignore_index`` of cross-entropy)
IGNORE = -100


@dataclass(frozen=True)
class Batch:
    """``inputs`` (B, N) token ids, (B, N, 2) key/value ids or (B, N, D) vectors;
    ``targets`` (B, M) class ids (``IGNORE`` where unscored) or real values, one per
    output position of the model (M = N, or 1 for the single-query retrieval probe);
    ``mask`` (B, M) bool, the positions that carry a target; ``group`` (B,) an optional
    example label (e.g. the number of key-value pairs), indexing ``Task.group_names``."""

    inputs: Tensor
    targets: Tensor
    mask: Tensor
    group: Tensor | None = None

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(
            self.inputs[start:stop],
            self.targets[start:stop],
            self.mask[start:stop],
            None if self.group is None else self.group[start:stop],
        )


class Task(ABC):
    """Base of every arena task (subclasses are frozen dataclasses with a ``seq_len``)."""

    name: str = "task"
    #: where the task comes from (arXiv id)
    paper: str = ""
    #: "lm", "retrieval" or "vectors": the model family that reads the inputs
    model_kind: str = "lm"
    #: layers the task is meant for (None: any; 1 for single-layer probes)
    fixed_layers: int | None = None
    #: heads used when the caller does not say
    default_heads: int = 4
    #: training settings that suit the task on CPU (overridable by the caller)
    train_defaults: dict = {}
    seq_len: int
    if TYPE_CHECKING:
        # every task is a dataclass (``fields``, ``replace``)
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

        # a field of some tasks, a property of others
        @property
        def vocab_size(self) -> int: ...
    else:
        vocab_size: int

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> Batch:
        """``n`` examples drawn from ``generator`` alone."""

    def held_out(self, n: int, generator: torch.Generator) -> Batch:
        """Evaluation examples (by default drawn like training ones, from another stream)."""
        return self.sample(n, generator)

    def eval_lengths(self) -> tuple[int, ...]:
        """Sequence lengths a trained model is evaluated at."""
        return (self.seq_len,)

    @property
    def group_names(self) -> tuple[str, ...]:
        """Labels of ``Batch.group`` values (empty when the task has no groups)."""
        return ()

    def loss(self, outputs: Tensor, batch: Batch) -> Tensor:
        """Mean cross-entropy over the target positions (outputs: logits (B, N, C))."""
        return F.cross_entropy(outputs[batch.mask].float(), batch.targets[batch.mask])

    def scored(self, outputs: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """(correct, counted): bool (B, N) tensors; accuracy is correct.sum() / counted.sum()."""
        correct = (outputs.argmax(dim=-1) == batch.targets) & batch.mask
        return correct, batch.mask

    def params(self) -> dict:
        """The task's parameters, for result tables and checkpoints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


# ---------------------------------------------------------------- validation and sampling


def check_int(value, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def check_count(n: int) -> None:
    check_int(n, "n")


def int_range(value, name: str) -> tuple[int, int]:
    """An int or an inclusive (low, high) pair, as (low, high)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or a (low, high) pair, got {value!r}")
        low, high = value
    else:
        low = high = value
    check_int(low, name)
    check_int(high, name)
    if high < low:
        raise ValueError(f"{name}: expected low <= high, got {value!r}")
    return low, high


def distinct(n: int, k: int, count: int, generator: torch.Generator, offset: int = 0) -> Tensor:
    """(n, k) rows of k distinct integers from [offset, offset + count), each row uniform
    over the ordered k-subsets (the first k of a random permutation)."""
    return torch.rand(n, count, generator=generator).argsort(dim=1)[:, :k] + offset
