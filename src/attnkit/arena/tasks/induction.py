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

At one segment length the copy always sits exactly ``segment`` positions back, and a
model with relative positions (RoPE) can learn that distance instead of the content
match (it then fails on every other length). ``min_segment`` takes the distance away:

- each example's segment length is drawn uniformly from ``[min_segment, max_segment]``
  (``max_segment`` defaults to ``segment = seq_len / repeats``; a smaller one keeps
  longer segments out of training, to test on lengths never seen),
  the copies start at a uniform random offset, and the positions before and after
  them hold filler: tokens drawn with replacement from the vocabulary less the
  segment's own tokens (so the lookup still has one answer);
- only positions inside the later copies are scored (from the start of the second copy
  to the second-to-last token of the last copy), as above.

``min_segment=None`` (the default) is the fixed-length task. ``segment`` stays
``seq_len / repeats`` either way (the longest segment a prompt of ``seq_len`` holds).

``spread=True`` (with ``min_segment``) puts filler between the copies: a gap drawn
uniformly from 0 to what the prompt leaves (``seq_len - repeats * length``, split evenly
between the ``repeats - 1`` gaps), so at 1024 tokens a copy can sit a thousand tokens
after the one it repeats, as the long-context copying of retrieval heads needs (Wu et al.
2024, arXiv 2404.15574). Scored positions are inside the later copies, up to the
second-to-last token of each (the token after a copy is filler). Examples are grouped by
the gap over its largest possible value: ``near`` (< 1/3), ``mid``, ``far`` (>= 2/3).
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
    min_segment: int | None = None
    max_segment: int | None = None
    spread: bool = False

    name = "induction"
    paper = "arXiv:2209.11895"
    train_defaults = {"steps": 3000, "batch_size": 32, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.repeats, "repeats", 2)
        check_int(self.seq_len, "seq_len", 2 * self.repeats)
        if self.seq_len % self.repeats:
            raise ValueError(f"seq_len: must be a multiple of repeats={self.repeats}, got {self.seq_len}")
        if self.max_segment is not None:
            if self.min_segment is None:
                raise ValueError("max_segment: only with min_segment (segment lengths drawn from [min_segment, max_segment])")
            check_int(self.max_segment, "max_segment", 2)
            if self.max_segment > self.segment:
                raise ValueError(f"max_segment: expected at most seq_len / repeats = {self.segment}, got {self.max_segment}")
        # the longest segment drawn (max_segment when given) must fit the vocabulary, and the
        # varied tasks also need at least one token left for the filler
        need = self.longest + (self.min_segment is not None)
        if self.vocab_size < need:
            raise ValueError(
                f"vocab_size: a segment of {self.longest} distinct tokens"
                f"{' and a filler token' if self.min_segment is not None else ''} needs vocab_size >= {need}, "
                f"got {self.vocab_size}"
            )
        if not isinstance(self.spread, bool):
            raise ValueError(f"spread: expected True or False, got {self.spread!r}")
        if self.spread and self.min_segment is None:
            raise ValueError("spread: only with min_segment (copies at random offsets among filler)")
        if self.min_segment is not None:
            # Two tokens at least: the second copy must ask something.
            check_int(self.min_segment, "min_segment", 2)
            if self.min_segment > self.longest:
                raise ValueError(
                    f"min_segment: expected at most max_segment (default seq_len / repeats) = {self.longest}, "
                    f"got {self.min_segment}"
                )

    @property
    def segment(self) -> int:
        """The segment's length (with ``min_segment``: the longest a prompt of ``seq_len`` holds)."""
        return self.seq_len // self.repeats

    @property
    def longest(self) -> int:
        """The longest segment training draws (``max_segment``, else ``segment``)."""
        return self.segment if self.max_segment is None else self.max_segment

    @property
    def group_names(self) -> tuple[str, ...]:
        return ("near", "mid", "far") if self.spread else ()

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        if self.spread:
            return self._sample_spread(n, generator)
        if self.min_segment is not None:
            return self._sample_varied(n, generator)
        segment = distinct(n, self.segment, self.vocab_size, generator)
        inputs = segment.repeat(1, self.repeats)
        targets = torch.full_like(inputs, IGNORE)
        start = self.segment
        targets[:, start:-1] = inputs[:, start + 1 :]
        return Batch(inputs, targets, targets != IGNORE)

    def _sample_varied(self, n: int, generator: torch.Generator) -> Batch:
        """Segments of ``[min_segment, max_segment]`` tokens at random offsets among filler."""
        assert self.min_segment is not None  # only sampled with min_segment
        N, R, V = self.seq_len, self.repeats, self.vocab_size
        length = torch.randint(self.min_segment, self.longest + 1, (n, 1), generator=generator)
        span = R * length
        offset = (torch.rand(n, 1, generator=generator, dtype=torch.float64) * (N - span + 1)).long()
        # Per example a random order of the vocabulary: its first ``length`` tokens are the
        # segment, the rest the filler's pool (never a segment token).
        order = torch.rand(n, V, generator=generator).argsort(dim=1)
        filler = length + (torch.rand(n, N, generator=generator, dtype=torch.float64) * (V - length)).long()
        rel = torch.arange(N) - offset  # position relative to the first copy's start
        inside = (rel >= 0) & (rel < span)
        index = torch.where(inside, rel.clamp_min(0) % length, filler.clamp_max(V - 1))
        inputs = order.gather(1, index)
        targets = torch.full_like(inputs, IGNORE)
        asked = (rel >= length) & (rel <= span - 2)  # inside a later copy, its next token inside too
        targets[:, :-1] = torch.where(asked[:, :-1], inputs[:, 1:], IGNORE)
        return Batch(inputs, targets, targets != IGNORE)

    def _sample_spread(self, n: int, generator: torch.Generator) -> Batch:
        """As ``_sample_varied``, with a random gap of filler between consecutive copies."""
        assert self.min_segment is not None  # spread needs min_segment (__post_init__)
        N, R, V = self.seq_len, self.repeats, self.vocab_size
        length = torch.randint(self.min_segment, self.longest + 1, (n, 1), generator=generator)
        room = (N - R * length) // (R - 1)  # the largest gap the prompt leaves
        gap = (torch.rand(n, 1, generator=generator, dtype=torch.float64) * (room + 1)).long()
        span = R * length + (R - 1) * gap
        offset = (torch.rand(n, 1, generator=generator, dtype=torch.float64) * (N - span + 1)).long()
        order = torch.rand(n, V, generator=generator).argsort(dim=1)
        filler = length + (torch.rand(n, N, generator=generator, dtype=torch.float64) * (V - length)).long()
        rel = torch.arange(N) - offset
        period = length + gap
        copy, within = rel.div(period, rounding_mode="floor"), rel.remainder(period)
        inside = (rel >= 0) & (copy < R) & (within < length)
        index = torch.where(inside, within, filler.clamp_max(V - 1))
        inputs = order.gather(1, index)
        targets = torch.full_like(inputs, IGNORE)
        asked = inside & (copy >= 1) & (within <= length - 2)
        targets[:, :-1] = torch.where(asked[:, :-1], inputs[:, 1:], IGNORE)
        fraction = gap.squeeze(1).double() / room.squeeze(1).clamp_min(1).double()
        group = (fraction >= 1 / 3).long() + (fraction >= 2 / 3).long()
        return Batch(inputs, targets, targets != IGNORE, group)
