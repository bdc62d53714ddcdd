"""Multi-query associative recall, MQAR (Arora et al. 2023, "Zoology", arXiv 2312.04927).

The sequence opens with ``D`` key-value pairs ``k1 v1 k2 v2 ... kD vD``; every key then
comes back once, later, as a query, and the output at the query must be its value. The
rules of the paper's generator:

- keys are drawn without replacement from the first half of the vocabulary (token 0
  excluded), values without replacement from the second half;
- the query region after the ``2D`` context tokens has ``space = (N - 2D) // 2`` slots
  two tokens apart; the slots of the ``D`` queries are drawn without replacement with
  probability ``p(gap) ∝ a · gap^(a - 1)``, gap = 1..space (a power law: most queries
  come soon after the context, as repeated bigrams do in text; ``a = 1`` is uniform);
- the query for key ``i`` sits at ``2D + 2·slot_i``; its value is the target there
  and is never shown after it;
- every other position holds token 0, replaced by a uniformly random token of the
  whole vocabulary when ``random_non_queries`` (the paper's default).

``num_kv_pairs`` is an int or an inclusive (low, high) range drawn per example; the
example's pair count is its ``group``, so results report accuracy per count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, check_count, check_int, distinct, int_range


@dataclass(frozen=True)
class MQAR(Task):
    vocab_size: int = 128
    seq_len: int = 64
    num_kv_pairs: int | tuple[int, int] = (4, 8)
    power_a: float = 0.01
    random_non_queries: bool = True

    name = "mqar"
    paper = "arXiv:2312.04927"
    train_defaults = {"steps": 2000, "batch_size": 128, "lr": 1e-2, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.vocab_size, "vocab_size", 4)
        check_int(self.seq_len, "seq_len", 4)
        low, high = int_range(self.num_kv_pairs, "num_kv_pairs")
        object.__setattr__(self, "num_kv_pairs", low if low == high else (low, high))
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)) or not 0 < self.power_a <= 1:
            raise ValueError(f"power_a: expected 0 < a <= 1, got {self.power_a!r}")
        if self.vocab_size // 2 - 1 < high:
            raise ValueError(
                f"vocab_size: {high} keys need vocab_size >= {2 * high + 2} (keys from [1, V/2)), got {self.vocab_size}"
            )
        if 4 * high > self.seq_len:
            raise ValueError(
                f"seq_len: {high} pairs need seq_len >= {4 * high} (context and as many query slots), got {self.seq_len}"
            )

    @property
    def pair_range(self) -> tuple[int, int]:
        return int_range(self.num_kv_pairs, "num_kv_pairs")

    @property
    def group_names(self) -> tuple[str, ...]:
        low, high = self.pair_range
        return tuple(f"pairs={d}" for d in range(low, high + 1))

    def _gap_weights(self, pairs: int) -> torch.Tensor:
        """Unnormalised power-law weights of the ``space`` query slots for ``pairs`` pairs."""
        space = (self.seq_len - 2 * pairs) // 2
        gap = torch.arange(1, space + 1, dtype=torch.float64)
        return self.power_a * gap ** (self.power_a - 1)

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        V, N = self.vocab_size, self.seq_len
        low, high = self.pair_range
        pairs = torch.randint(low, high + 1, (n,), generator=generator)
        half = V // 2
        keys = distinct(n, high, half - 1, generator, 1)
        values = distinct(n, high, V - half, generator, half)
        # Slot probabilities per example: the power law over that example's space, zero beyond.
        weights = torch.zeros(n, (N - 2 * low) // 2, dtype=torch.float64)
        for d in range(low, high + 1):
            w = self._gap_weights(d)
            weights[pairs == d, : w.numel()] = w
        slots = torch.multinomial(weights, high, replacement=False, generator=generator)

        if self.random_non_queries:
            inputs = torch.randint(0, V, (n, N), generator=generator)
        else:
            inputs = torch.zeros(n, N, dtype=torch.long)
        targets = torch.full((n, N), IGNORE, dtype=torch.long)
        rows = torch.arange(n)
        for i in range(high):
            active = rows[pairs > i]  # examples that have an i-th pair
            inputs[active, 2 * i] = keys[active, i]
            inputs[active, 2 * i + 1] = values[active, i]
            query = 2 * pairs[active] + 2 * slots[active, i]
            inputs[active, query] = keys[active, i]
            targets[active, query] = values[active, i]
        return Batch(inputs, targets, targets != IGNORE, pairs - low)
