"""Natural-language haystacks: filler text of an exact token length with needles
inserted at chosen depths, and a question kept clear at the end.

The rules follow Kamradt's needle-in-a-haystack test (2023) as RULER (Hsieh et al.
2024, arXiv 2404.06654) and later work repeat them:

- the haystack is cut to the prompt's token budget *minus* everything else the prompt
  holds (the head, the needles, the question and answer prefix: the buffer), so the
  whole prompt has exactly the requested length;
- a needle at depth ``d`` (a fraction 0..1 of the haystack) goes to token ``round(d * n)``,
  then walks back to the nearest sentence start at or before it, so it never splits a
  sentence; depth 1 puts it at the very end of the haystack;
- the default haystack is a stream of short, neutral, repetitive sentences, RULER's
  "noise" haystack, in which nothing but the needle carries information; ``Haystack.
  from_file`` reads any text (an essay collection like Kamradt's) instead.

Work is done on token ids, one sentence at a time (each encoded once with a leading
space, the way it reads inside running text), so the sentence boundaries are known
exactly whatever the tokenizer and the length is exact.

Typical use::

    hay = Haystack.default()
    ctx = build_context(tokenizer, hay, length=1024, needles=[(needle_ids, 0.5)],
                        head=encode(tokenizer, "Read the text.", bos=True),
                        tail=encode(tokenizer, " Question: ... Answer:"), rng=random.Random(0))
    ctx.ids, ctx.spans[0]          # the prompt (1024 ids) and the needle's (start, end)
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..validate import integer

#: The default haystack: short sentences that say nothing (RULER's noise haystack idea;
#: these sentences are attnkit's own). Drawn at random, one after another.
FILLER = (
    "The river runs past the old mill.",
    "A light wind moves the tall grass.",
    "The road bends to the left after the bridge.",
    "Clouds drift slowly over the hills.",
    "The lamp in the window stays on all night.",
    "Birds rest on the wire above the field.",
    "The morning is cool and quiet.",
    "A boat is tied to the wooden pier.",
    "The path through the wood is covered in leaves.",
    "Rain falls softly on the roof.",
    "The clock in the hall ticks on.",
    "A dog sleeps in the shade of the barn.",
    "The stones of the wall are grey and smooth.",
    "Smoke rises from a chimney in the valley.",
    "The garden gate is painted green.",
    "Waves roll in and out on the sand.",
)

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


def split_sentences(text: str) -> list[str]:
    """Text -> sentences (split after ``.``, ``!`` or ``?`` and any closing quote or
    bracket, then whitespace); runs of whitespace inside a sentence become one space."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a string, got {type(text).__name__}")
    flat = " ".join(text.split())
    sentences, last = [], 0
    for end in _SENTENCE_END.finditer(flat):
        sentences.append(flat[last : end.end()].strip())
        last = end.end()
    sentences.append(flat[last:].strip())
    return [s for s in sentences if s]


@dataclass(frozen=True)
class Haystack:
    """Sentences to fill a context with. ``ordered`` haystacks (a file's text) are read
    in order from a random starting sentence and wrap around; unordered ones (the
    filler) draw every sentence at random. ``name`` says where the text came from."""

    sentences: tuple[str, ...]
    ordered: bool = False
    name: str = "filler"

    def __post_init__(self):
        if not self.sentences or not all(isinstance(s, str) and s.strip() for s in self.sentences):
            raise ValueError(f"haystack: expected non-empty sentences, got {len(self.sentences)} usable")

    @classmethod
    def default(cls) -> Haystack:
        return cls(FILLER, ordered=False, name="filler")

    @classmethod
    def from_text(cls, text: str, name: str = "text", keyword: str = "haystack") -> Haystack:
        sentences = split_sentences(text)
        if not sentences:
            raise ValueError(f"{keyword}: the haystack text has no sentences")
        return cls(tuple(sentences), ordered=True, name=name)

    @classmethod
    def from_file(cls, path, keyword: str = "haystack") -> Haystack:
        """Read a UTF-8 text file as an ordered haystack; errors name ``keyword``."""
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"{keyword}: expected the path of a text file, got {path!r}")
        if not os.path.isfile(path):
            raise ValueError(f"{keyword}: no such file: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{keyword}: could not read {path} as UTF-8 text: {e}") from e
        return cls.from_text(text, os.path.basename(str(path)), keyword)

    @classmethod
    def resolve(cls, haystack, keyword: str = "haystack") -> Haystack:
        """What a probe's ``haystack=`` argument may be: None (the filler), a Haystack,
        or the path of a text file."""
        if haystack is None:
            return cls.default()
        if isinstance(haystack, Haystack):
            return haystack
        if isinstance(haystack, (str, os.PathLike)):
            return cls.from_file(haystack, keyword)
        raise ValueError(f"{keyword}: expected None, a Haystack or a text file path, got {type(haystack).__name__}")


def encode(tokenizer, text: str, *, bos: bool = False) -> list[int]:
    """Token ids of ``text`` with nothing added, or with the tokenizer's
    beginning-of-sequence token first when ``bos`` (and the tokenizer has one)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False)) if text else []
    if bos:
        start = getattr(tokenizer, "bos_token_id", None)
        if isinstance(start, int):
            ids = [start] + ids
    return ids


@dataclass
class Filler:
    """Haystack tokens: ``ids`` and ``starts``, the index of every sentence start in
    ``ids`` (0 first), where a needle may go. The last sentence may be cut short."""

    ids: list[int]
    starts: list[int]

    def insertion_point(self, depth: float) -> int:
        """Token index for a needle at ``depth``: ``round(depth * len)`` walked back to the
        nearest sentence start at or before it (``len`` itself, the end, at depth 1)."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth: expected a fraction in [0, 1], got {depth!r}")
        target = round(depth * len(self.ids))
        if target >= len(self.ids):
            return len(self.ids)
        return max(s for s in self.starts if s <= target)


class _SentenceCache:
    """Each distinct sentence is tokenized once per tokenizer (filler repeats a lot)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, sentence: str) -> list[int]:
        ids = self.cache.get(sentence)
        if ids is None:
            ids = self.cache[sentence] = encode(self.tokenizer, " " + sentence)
        return ids


def fill(tokenizer, haystack: Haystack, n_tokens: int, rng: random.Random) -> Filler:
    """Exactly ``n_tokens`` haystack tokens, whole sentences (the last one cut), drawn
    with ``rng`` (the same rng state gives the same tokens)."""
    n_tokens = integer(n_tokens, "n_tokens", 0)
    tokens = _SentenceCache(tokenizer)
    ids: list[int] = []
    starts: list[int] = []
    position = rng.randrange(len(haystack.sentences))
    while len(ids) < n_tokens:
        sentence = (
            haystack.sentences[position % len(haystack.sentences)]
            if haystack.ordered
            else haystack.sentences[rng.randrange(len(haystack.sentences))]
        )
        position += 1
        piece = tokens(sentence)
        if not piece:
            continue
        starts.append(len(ids))
        ids.extend(piece)
    return Filler(ids[:n_tokens], starts or [0])


@dataclass
class Context:
    """A prompt built by ``build_context``: ``ids`` (exactly the requested length),
    ``spans`` ((start, end) token range of each needle, in the order given) and
    ``haystack`` (the (start, end) range the haystack and needles occupy)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    haystack: tuple[int, int]
    depths: list[float] = field(default_factory=list)


def build_context(
    tokenizer,
    haystack: Haystack,
    *,
    length: int,
    needles: list[tuple[list[int], float]],
    head: Sequence[int] = (),
    tail: Sequence[int] = (),
    rng: random.Random,
    keyword: str = "lengths",
) -> Context:
    """``head + haystack-with-needles + tail`` of exactly ``length`` tokens.

    ``needles`` is a list of (token ids, depth): each goes to its depth of the haystack
    walked back to a sentence start (``Filler.insertion_point``); needles at the same
    point keep their given order. The haystack gets what is left of ``length`` after the
    head, the needles and the tail (the question's buffer); too little is a ValueError
    naming ``keyword`` (the probe's argument that set the length)."""
    length = integer(length, keyword, 1, "a token count")
    head, tail = list(head), list(tail)
    taken = len(head) + len(tail) + sum(len(ids) for ids, _ in needles)
    room = length - taken
    if room < 1:
        raise ValueError(
            f"{keyword}: {length} tokens leave no room for a haystack after the {taken} tokens of the "
            f"prompt's head, needles and question"
        )
    filler = fill(tokenizer, haystack, room, rng)
    points = [filler.insertion_point(float(depth)) for _, depth in needles]
    order = sorted(range(len(needles)), key=lambda i: (points[i], i))
    ids, last = list(head), 0
    spans: list[tuple[int, int]] = [(0, 0)] * len(needles)  # every entry set below: ``order`` covers all needles
    for i in order:
        ids += filler.ids[last : points[i]]
        last = points[i]
        spans[i] = (len(ids), len(ids) + len(needles[i][0]))
        ids += needles[i][0]
    ids += filler.ids[last:]
    end = len(ids)
    ids += tail
    return Context(ids, spans, (len(head), end), [float(d) for _, d in needles])


__all__ = ["FILLER", "Context", "Filler", "Haystack", "build_context", "encode", "fill", "split_sentences"]
