"""Needle retrieval at a controlled depth, trained at one length and tested at longer
ones (Kamradt 2023, "needle in a haystack"; the multi-key variant of RULER, Hsieh et al.
2024, arXiv 2404.06654, "niah_multikey"), as a test of length generalisation.

A haystack of random filler tokens hides the needle, a (key, value) pair, and
``distractors`` other pairs with different keys; the prompt ends ``QUERY key`` and the
output there must be the needle's value. Distractors make the key matter: with one pair
the only value in the context would be the answer. The rules:

- the context (all but the last two tokens) is cut into two-token cells; the needle
  takes the cell at ``round(depth · (cells - 1))``, distractors distinct random other
  cells, filler (uniform over ``num_filler`` tokens) the rest;
- keys are distinct within an example, values too;
- training draws depth uniformly in [0, 1]; held-out examples cycle through
  ``num_depths`` evenly spaced depths (their ``group``), so results report accuracy per
  depth as well as per length;
- a model trained at ``seq_len`` is evaluated at ``seq_len · f`` for each ``f`` in
  ``test_factors`` (default 1, 2, 4);
- ``value_len`` > 1: every value is that many tokens (each uniform over the
  ``num_values`` symbols, drawn independently), cells are ``1 + value_len`` tokens, and
  the prompt ends ``QUERY key v1 .. v(L-1)`` (cells that do not fill the context
  leave filler before the first cell): the output at ``key`` must be ``v1``, at
  each ``vi`` the next (teacher-forced, as decoding would feed them). An example counts
  as right only when every answer token is (exact match, scored at its last answer
  position), so eviction between answer tokens shows. ``value_len`` 1 is the task above,
  example for example.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, check_count, check_int, distinct


@dataclass(frozen=True)
class Needle(Task):
    seq_len: int = 64
    num_filler: int = 16
    num_keys: int = 16
    num_values: int = 16
    distractors: int = 3
    num_depths: int = 5
    test_factors: tuple[int, ...] = (1, 2, 4)
    value_len: int = 1

    name = "needle"
    paper = "arXiv:2404.06654"
    train_defaults = {"steps": 3000, "batch_size": 64, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.num_filler, "num_filler")
        check_int(self.distractors, "distractors", 0)
        check_int(self.num_keys, "num_keys", self.distractors + 1)
        check_int(self.value_len, "value_len")
        # one-token values are distinct within an example; longer ones are drawn token by token
        check_int(self.num_values, "num_values", self.distractors + 1 if self.value_len == 1 else 2)
        check_int(self.num_depths, "num_depths", 2)
        cell = 1 + self.value_len
        check_int(self.seq_len, "seq_len", cell * (self.distractors + 2))
        if self.value_len == 1 and self.seq_len % cell:
            raise ValueError(
                f"seq_len: the context is cut into {cell}-token cells (key and value_len={self.value_len} "
                f"values), so it must be {'even' if cell == 2 else f'a multiple of {cell}'}, got {self.seq_len}"
            )
        factors = tuple(self.test_factors)
        if not factors or any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in factors):
            raise ValueError(f"test_factors: expected positive ints, got {self.test_factors!r}")
        object.__setattr__(self, "test_factors", factors)

    @property
    def query_token(self) -> int:
        return self.num_filler

    @property
    def vocab_size(self) -> int:
        return self.num_filler + 1 + self.num_keys + self.num_values

    def eval_lengths(self) -> tuple[int, ...]:
        return tuple(self.seq_len * f for f in self.test_factors)

    @property
    def depths(self) -> torch.Tensor:
        return torch.linspace(0, 1, self.num_depths, dtype=torch.float64)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(f"depth={d:.2f}" for d in self.depths.tolist())

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        return self._build(torch.rand(n, generator=generator, dtype=torch.float64), generator, None)

    def held_out(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        group = torch.arange(n) % self.num_depths
        return self._build(self.depths[group], generator, group)

    def scored(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One count per example, right when every answer token is (value_len 1: the usual)."""
        correct, counted = super().scored(outputs, batch)
        if self.value_len == 1:
            return correct, counted
        whole = (correct | ~counted).all(dim=1)
        last = torch.zeros_like(counted)
        last[:, -1] = counted[:, -1]
        return last & whole[:, None], last

    def _build(self, depth: torch.Tensor, generator: torch.Generator, group) -> Batch:
        if self.value_len > 1:
            return self._build_long(depth, generator, group)
        n, N, P = depth.shape[0], self.seq_len, self.distractors + 1
        cells = (N - 2) // 2
        needle = torch.round(depth * (cells - 1)).long()
        # Distractor cells: distinct among the cells other than the needle's (drawn from
        # cells - 1 and shifted past the needle).
        others = distinct(n, self.distractors, cells - 1, generator)
        others = others + (others >= needle[:, None]).long()
        where = torch.cat([needle[:, None], others], dim=1)  # (n, P): the needle first
        keys = distinct(n, P, self.num_keys, generator, self.num_filler + 1)
        values = distinct(n, P, self.num_values, generator, self.num_filler + 1 + self.num_keys)

        inputs = torch.randint(0, self.num_filler, (n, N), generator=generator)
        inputs.scatter_(1, 2 * where, keys)
        inputs.scatter_(1, 2 * where + 1, values)
        inputs[:, -2] = self.query_token
        inputs[:, -1] = keys[:, 0]
        targets = torch.full((n, N), IGNORE, dtype=torch.long)
        targets[:, -1] = values[:, 0]
        return Batch(inputs, targets, targets != IGNORE, group)

    def _build_long(self, depth: torch.Tensor, generator: torch.Generator, group) -> Batch:
        n, N, P, L = depth.shape[0], self.seq_len, self.distractors + 1, self.value_len
        cell = 1 + L
        cells = (N - cell) // cell  # the tail (QUERY key v1 .. v(L-1)) is one cell long
        lead = N - cell - cells * cell  # filler before the first cell when cells do not fill the context
        needle = torch.round(depth * (cells - 1)).long()
        others = distinct(n, self.distractors, cells - 1, generator)
        others = others + (others >= needle[:, None]).long()
        where = torch.cat([needle[:, None], others], dim=1)  # (n, P): the needle first
        keys = distinct(n, P, self.num_keys, generator, self.num_filler + 1)
        values = torch.randint(0, self.num_values, (n, P, L), generator=generator) + self.num_filler + 1 + self.num_keys

        inputs = torch.randint(0, self.num_filler, (n, N), generator=generator)
        inputs.scatter_(1, lead + cell * where, keys)
        for j in range(L):
            inputs.scatter_(1, lead + cell * where + 1 + j, values[:, :, j])
        tail = N - cell
        inputs[:, tail] = self.query_token
        inputs[:, tail + 1] = keys[:, 0]
        inputs[:, tail + 2 :] = values[:, 0, : L - 1]
        targets = torch.full((n, N), IGNORE, dtype=torch.long)
        targets[:, tail + 1 :] = values[:, 0]
        return Batch(inputs, targets, targets != IGNORE, group)
