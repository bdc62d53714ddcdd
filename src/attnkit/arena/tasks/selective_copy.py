"""Selective copying (Gu & Dao 2023, "Mamba", arXiv 2312.00752, section 3.1; the
generator of the S4 repository's copying task with variable positions).

``M`` data tokens are scattered at random positions among ``L`` noise tokens; ``M``
marker tokens follow, and the output at the j-th marker must be the j-th data token.
Content-aware selection is needed: the positions change from example to example, so a
fixed (time-invariant) filter cannot find the tokens. The rules:

- data tokens are uniform over ``1 .. vocab_size - 2``; token 0 is the noise, token
  ``vocab_size - 1`` the marker;
- the ``M`` data positions are a uniformly random subset of the first ``L + M`` positions
  (kept in order), so ``seq_len = L + 2M``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, check_count, check_int, distinct

NOISE = 0


@dataclass(frozen=True)
class SelectiveCopy(Task):
    vocab_size: int = 16
    seq_len: int = 64
    num_tokens: int = 8

    name = "selective_copy"
    paper = "arXiv:2312.00752"
    train_defaults = {"steps": 3000, "batch_size": 64, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.vocab_size, "vocab_size", 3)
        check_int(self.num_tokens, "num_tokens")
        check_int(self.seq_len, "seq_len", 2 * self.num_tokens + 1)

    @property
    def marker(self) -> int:
        return self.vocab_size - 1

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        M, N = self.num_tokens, self.seq_len
        region = N - M  # L noise + M data positions
        tokens = torch.randint(1, self.vocab_size - 1, (n, M), generator=generator)
        where = distinct(n, M, region, generator).sort(dim=1).values
        inputs = torch.full((n, N), NOISE, dtype=torch.long)
        inputs.scatter_(1, where, tokens)
        inputs[:, region:] = self.marker
        targets = torch.full((n, N), IGNORE, dtype=torch.long)
        targets[:, region:] = tokens
        return Batch(inputs, targets, targets != IGNORE)
