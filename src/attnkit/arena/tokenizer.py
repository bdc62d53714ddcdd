"""Readable names for the arena's token ids, and a word-level tokenizer over them.

Each token task gets a symbol table: one whitespace-free string per token id
(``"f3"`` a filler, ``"k7"`` a key, ``"v2"`` a value, ``"Q"`` the query marker, …) and
the roles those strings play. Text is the symbols joined by single spaces, so
``"k7 v2 f3 Q k7"`` is five tokens and decodes back to the same string. The roles are
what a probe needs to write prompts in the task's own format (a needle at a chosen
depth among the task's own distractors, a random segment of the task's symbols).

Special tokens: the tasks have no beginning- or end-of-sequence token (the models were
trained without one), so nothing is added when text is encoded and ``eos`` is unset
(generation runs for ``max_new_tokens``). Batched generation needs a pad token: it is
one of the task's own symbols (``pad`` in the table: the filler or noise symbol where
the task has one), so every id the tokenizer makes is a row of the trained embedding;
padded positions are hidden by the attention mask, so which symbol pads does not
matter. A word outside the table is an error, not an ``unk``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..extras import require
from .tasks import Task


@dataclass(frozen=True)
class Symbols:
    """``tokens[i]`` is the string of token id ``i``; ``roles`` maps a role name to the
    string (one symbol) or list of strings (a family) that plays it; ``pad`` pads batches."""

    tokens: tuple[str, ...]
    roles: dict = field(default_factory=dict)
    pad: str = ""

    def __post_init__(self):
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("tokens: symbol names must be distinct")
        if any(not t or any(ch.isspace() for ch in t) for t in self.tokens):
            raise ValueError("tokens: symbol names must be non-empty and contain no whitespace")
        if self.pad not in self.tokens:
            raise ValueError(f"pad: expected one of the task's symbols, got {self.pad!r}")

    @property
    def ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def encode(self, text: str) -> list[int]:
        """Whitespace-separated symbols -> token ids (an unknown word is a ValueError)."""
        ids = self.ids
        words = text.split()
        unknown = sorted({w for w in words if w not in ids})
        if unknown:
            raise ValueError(f"text: {', '.join(map(repr, unknown[:5]))} are not symbols of this task")
        return [ids[w] for w in words]

    def decode(self, ids) -> str:
        return " ".join(self.tokens[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "roles": self.roles, "pad": self.pad}

    @classmethod
    def from_dict(cls, data: dict) -> Symbols:
        return cls(tuple(data["tokens"]), dict(data["roles"]), data["pad"])


def _family(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def task_symbols(task: Task) -> Symbols:
    """The symbol table of a token task (``model_kind == "lm"``); other tasks are refused."""
    if task.model_kind != "lm":
        raise ValueError(
            f"task: {task.name} feeds its model {task.model_kind} inputs, not token ids, so it has no "
            "word-level vocabulary (only token tasks export)"
        )
    builder = _BUILDERS.get(task.name)
    if builder is None:
        raise ValueError(f"task: no symbol table for {task.name!r}; known: {', '.join(_BUILDERS)}")
    symbols = builder(task)
    if len(symbols.tokens) != task.vocab_size:  # a table out of step with its task
        raise ValueError(f"task: {task.name} has {task.vocab_size} token ids but its table names {len(symbols.tokens)}")
    return symbols


def _induction(task) -> Symbols:
    # Every token is alike: the segment is drawn from all of them.
    tokens = _family("t", task.vocab_size)
    return Symbols(tuple(tokens), {"segment": tokens}, tokens[0])


def _needle(task) -> Symbols:
    filler, keys, values = _family("f", task.num_filler), _family("k", task.num_keys), _family("v", task.num_values)
    tokens = [*filler, "Q", *keys, *values]  # ids as in Needle: filler, query, keys, values
    return Symbols(tuple(tokens), {"filler": filler, "query": "Q", "keys": keys, "values": values}, filler[0])


def _mqar(task) -> Symbols:
    # Token 0 is the blank of non-query positions; keys are [1, V/2), values [V/2, V).
    half = task.vocab_size // 2
    keys, values = _family("k", half - 1), _family("v", task.vocab_size - half)
    tokens = ["_", *keys, *values]
    return Symbols(tuple(tokens), {"blank": "_", "keys": keys, "values": values}, "_")


def _selective_copy(task) -> Symbols:
    data = _family("d", task.vocab_size - 2)
    tokens = ["n", *data, "M"]  # noise 0, data 1..V-2, marker V-1
    return Symbols(tuple(tokens), {"noise": "n", "data": data, "marker": "M"}, "n")


def _variable_tracking(task) -> Symbols:
    variables, values = _family("x", task.num_variables), _family("v", task.num_values)
    tokens = ["f", "=", "Q", *variables, *values]  # FILL, ASSIGN, QUERY, then names and values
    return Symbols(tuple(tokens), {"filler": "f", "assign": "=", "query": "Q", "variables": variables, "values": values}, "f")


_BUILDERS = {
    "induction": _induction,
    "needle": _needle,
    "mqar": _mqar,
    "selective_copy": _selective_copy,
    "variable_tracking": _variable_tracking,
}


def build_tokenizer(symbols: Symbols):
    """A ``transformers.PreTrainedTokenizerFast`` over the symbols: WordLevel model,
    whitespace split, no normaliser, no post-processor (nothing is added to the ids),
    decoding joined by single spaces; ``pad_token`` is ``symbols.pad``."""
    require("transformers", "attnkit.arena's tokenizer (for --export)")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # No unk token in the vocabulary: a word that is not a symbol fails to encode.
    core = Tokenizer(models.WordLevel(symbols.ids, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=symbols.pad,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    return tokenizer
