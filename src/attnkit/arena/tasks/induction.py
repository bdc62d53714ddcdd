"""Induction: copying a repeated random segment (Olsson et al. 2022, "In-context Learning
and Induction Heads", arXiv 2209.11895; the repeated-random-tokens probe).

A segment of ``seq_len / repeats`` random tokens is written ``repeats`` times in a row.
Inside every repetition after the first, the next token is predictable only by finding
the previous occurrence of the current token and copying what followed it — the
two-layer circuit an induction head implements. The rules:

- the segment's tokens are distinct (drawn without replacement), so each lookup has one
  answer (needs ``vocab_size >= seq_len / repeats``);
- the target at position ``p`` is the token at ``p + 1``, for every ``p`` from the start
  of the second copy to the second-to-last position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, check_count, check_int, distinct


@dataclass(frozen=True)
class Induction(Task):
    vocab_size: int = 64
    seq_len: int = 64
    repeats: int = 2

    name = "induction"
    paper = "arXiv:2209.11895"
    train_defaults = {"steps": 3000, "batch_size": 32, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.repeats, "repeats", 2)
        check_int(self.seq_len, "seq_len", 2 * self.repeats)
        if self.seq_len % self.repeats:
            raise ValueError(f"seq_len: must be a multiple of repeats={self.repeats}, got {self.seq_len}")
        if self.vocab_size < self.segment:
            raise ValueError(f"vocab_size: a segment of {self.segment} distinct tokens needs vocab_size >= {self.segment}, got {self.vocab_size}")

    @property
    def segment(self) -> int:
        return self.seq_len // self.repeats

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        segment = distinct(n, self.segment, self.vocab_size, generator)
        inputs = segment.repeat(1, self.repeats)
        targets = torch.full_like(inputs, IGNORE)
        start = self.segment
        targets[:, start:-1] = inputs[:, start + 1:]
        return Batch(inputs, targets, targets != IGNORE)
