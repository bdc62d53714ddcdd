"""Associative retrieval, the capacity probe for fast-weight memories (Schlag, Irie &
Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight Programmers",
arXiv 2102.11174, section 6.1).

An example is a sequence of ``L = seq_len - 1`` (key, value) pairs and one query key;
the answer is the value paired with the query. The rules of the paper's generator:

- keys come from ``num_keys`` symbols and values from ``num_values`` symbols;
- without ``repeated_keys`` (setting 1, capacity) keys and values are drawn without
  replacement, so every key appears once (needs ``num_keys >= L``);
- with ``repeated_keys`` (setting 2, updates) both are drawn with replacement, so a key
  can come back with a new value, and the answer is the value of its **last**
  occurrence: the memory must be overwritten, which the delta rule does and the sum
  rule cannot (the paper's sequences hold twice as many pairs as keys);
- the query is the key at a uniformly drawn position (so a key that occurs twice is
  asked twice as often).

Inputs are (B, L + 1, 2): rows ``(key, value)`` for the pairs and ``(query, QUERY)`` last,
``QUERY = num_values`` marking "no value". The model is a single attention layer whose
query reads the memory written by all pairs (``attnkit.arena.models.RetrievalLayer``),
so targets are (B, 1): the answer to the one query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Batch, Task, check_count, check_int, distinct


@dataclass(frozen=True)
class AssociativeRetrieval(Task):
    seq_len: int = 61
    num_keys: int = 30
    num_values: int = 30
    repeated_keys: bool = True

    name = "associative"
    paper = "arXiv:2102.11174"
    model_kind = "retrieval"
    fixed_layers = 1
    default_heads = 1
    train_defaults = {"steps": 1000, "batch_size": 64, "lr": 3e-3, "target_accuracy": 0.99}

    def __post_init__(self):
        check_int(self.seq_len, "seq_len", 2)
        check_int(self.num_keys, "num_keys")
        check_int(self.num_values, "num_values", 2)
        pairs = self.seq_len - 1
        if not self.repeated_keys and self.num_keys < pairs:
            raise ValueError(f"num_keys: without repeated keys {pairs} pairs need num_keys >= {pairs}, got {self.num_keys}")
        if not self.repeated_keys and self.num_values < pairs:
            raise ValueError(f"num_values: without repeated keys {pairs} pairs need num_values >= {pairs}, got {self.num_values}")

    @property
    def vocab_size(self) -> int:
        """Output classes: the values."""
        return self.num_values

    @property
    def query_marker(self) -> int:
        return self.num_values

    def sample(self, n: int, generator: torch.Generator) -> Batch:
        check_count(n)
        L = self.seq_len - 1
        if self.repeated_keys:
            keys = torch.randint(0, self.num_keys, (n, L), generator=generator)
            values = torch.randint(0, self.num_values, (n, L), generator=generator)
        else:
            keys = distinct(n, L, self.num_keys, generator)
            values = distinct(n, L, self.num_values, generator)
        # A uniformly chosen key among those present: a random position, then its key.
        picked = torch.randint(0, L, (n,), generator=generator)
        rows = torch.arange(n)
        query = keys[rows, picked]
        # Last value wins: the answer sits at the query key's last occurrence.
        where = torch.arange(L).expand(n, L)
        last = torch.where(keys == query[:, None], where, -1).amax(dim=1)
        answer = values[rows, last]

        inputs = torch.empty(n, L + 1, 2, dtype=torch.long)
        inputs[:, :L, 0], inputs[:, :L, 1] = keys, values
        inputs[:, L, 0], inputs[:, L, 1] = query, self.query_marker
        # The model has one output, the query's.
        return Batch(inputs, answer[:, None], torch.ones(n, 1, dtype=torch.bool))
