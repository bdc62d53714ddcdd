"""Variable tracking, multi-hop (Hsieh et al. 2024, "RULER", arXiv 2404.06654, task "vt").

RULER hides chains of assignments in filler text, ``VAR X1 = 12345 ... VAR X2 = X1 ...
VAR X3 = X2``, and asks for every variable that holds the value; the answer lists the
chain in order. Tracing it hop by hop is a sequence of associative recalls, each keyed
by the previous answer. The rules, as tokens:

- a chain is ``hops + 1`` distinct variables: ``X1 = value``, then ``X(j+1) = Xj``; each
  statement is three tokens ``name ASSIGN value-or-name``;
- ``num_chains`` chains (the first is asked about, the others are distractors with
  their own variables and values); all variables and values are distinct;
- statements keep their chain's order, chains are interleaved at random, and the
  statements sit at random positions of the filler (token FILL), never overlapping;
- the prompt ends ``QUERY value X1 X2 ... X(hops)``: the output at ``value`` must be
  ``X1``, the output at ``Xj`` must be ``X(j+1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE, Batch, Task, check_count, check_int, distinct

FILL, ASSIGN, QUERY = 0, 1, 2
SPECIAL = 3
STATEMENT = 3  # tokens per statement


@dataclass(frozen=True)
class VariableTracking(Task):
    seq_len: int = 64
    num_chains: int = 1
    hops: int = 4
    num_variables: int = 32
    num_values: int = 32

    name = "variable_tracking"
    paper = "arXiv:2404.06654"
    train_defaults = {"steps": 3000, "batch_size": 64, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.num_chains, "num_chains")
        check_int(self.hops, "hops")
        check_int(self.num_variables, "num_variables", self.num_chains * (self.hops + 1))
        check_int(self.num_values, "num_values", self.num_chains)
        check_int(self.seq_len, "seq_len", 2 + self.hops + STATEMENT * self.num_chains * (self.hops + 1))

    def context_len(self) -> int:
        """Tokens before the query (``QUERY value`` and ``hops`` answer tokens follow)."""
        return self.seq_len - (2 + self.hops)

    @property
    def vocab_size(self) -> int:
        return SPECIAL + self.num_variables + self.num_values

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        C, H = self.num_chains, self.hops
        names = distinct(n, C * (H + 1), self.num_variables, generator, SPECIAL).view(n, C, H + 1)
        values = distinct(n, C, self.num_values, generator, SPECIAL + self.num_variables)
        # Statement j of chain c: (name_cj, ASSIGN, value_c if j == 0 else name_c(j-1)).
        rhs = torch.cat([values[:, :, None], names[:, :, :-1]], dim=2)
        statements = torch.stack([names, torch.full_like(names, ASSIGN), rhs], dim=-1)  # (n, C, H+1, 3)

        count = C * (H + 1)
        context = self.context_len()
        filler = context - STATEMENT * count
        inputs = torch.full((n, self.seq_len), FILL, dtype=torch.long)
        # Interleave chains: a random order of the multiset {c repeated H+1 times}, each
        # chain's statements taken in order.
        order = torch.arange(C).repeat_interleave(H + 1).expand(n, count)
        order = order.gather(1, torch.rand(n, count, generator=generator).argsort(dim=1))
        # Placement: choose which of the filler + count slots are statements (stars and
        # bars); a statement slot at rank r among slots s expands to 3 tokens.
        slots = distinct(n, count, filler + count, generator).sort(dim=1).values
        starts = slots + (STATEMENT - 1) * torch.arange(count)
        hop = torch.zeros(n, C, dtype=torch.long)
        rows = torch.arange(n)
        for s in range(count):
            chain = order[:, s]
            tokens = statements[rows, chain, hop[rows, chain]]  # (n, 3)
            for t in range(STATEMENT):
                inputs[rows, starts[:, s] + t] = tokens[:, t]
            hop[rows, chain] += 1

        targets = torch.full((n, self.seq_len), IGNORE, dtype=torch.long)
        inputs[:, context] = QUERY
        inputs[:, context + 1] = values[:, 0]
        inputs[:, context + 2 :] = names[:, 0, :H]
        targets[:, context + 1 :] = names[:, 0]
        return Batch(inputs, targets, targets != IGNORE)
