"""RULER's common words extraction, ``cwe`` (Hsieh et al. 2024, arXiv 2404.06654, §3.3):
aggregation over the whole context.

A numbered list of words ("1. apple 2. river ...") in random order: ten common words
appear ``freq_common`` (30) times each, every other word ``freq_uncommon`` (3) times; as
many uncommon words as fit the length. The answer is the ten common words.

Short contexts cannot hold 10 x 30 entries: then the common frequency is the largest one
(down to ``freq_uncommon + 1``) that leaves room for at least ten uncommon words. Long
contexts can need more uncommon words than the bundled list has (about 1100): the list
then goes on with ``adjective-noun`` compounds, like RULER's needle keys.
"""

from __future__ import annotations

import random

from ..haystack import encode
from .common import Sample, vocabulary, word_list

COMMON_WORDS = 10
FREQ_COMMON = 30
FREQ_UNCOMMON = 3
#: the least number of uncommon words a list must hold for the task to mean anything
MIN_UNCOMMON = 10

HEAD = "Below is a numbered list of words. Some of the words appear more often than the others; remember which.\n"
TAIL = (
    "\nQuestion: What are the {n} most common words in the list above? "
    "Answer: The {n} words that appear most often in the list above are:"
)


class _Pieces:
    """Token ids of list numbers and words, each encoded once (the list is built by
    concatenating them, so its token length is a sum)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.numbers, self.words = tokenizer, [], {}

    def number(self, i: int) -> list[int]:  # i >= 1
        while len(self.numbers) < i:
            self.numbers.append(encode(self.tokenizer, f" {len(self.numbers) + 1}."))
        return self.numbers[i - 1]

    def numbers_length(self, n: int) -> int:
        return sum(len(self.number(i)) for i in range(1, n + 1)) if n else 0

    def word(self, w: str) -> list[int]:
        ids = self.words.get(w)
        if ids is None:
            ids = self.words[w] = encode(self.tokenizer, " " + w)
        return ids


def _word_stream(rng: random.Random):
    """The bundled words in random order, then endless distinct adjective-noun compounds."""
    words = list(vocabulary())
    rng.shuffle(words)
    yield from words
    seen = set(words)
    adjectives, nouns = word_list("adjectives"), word_list("nouns")
    while True:
        w = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if w not in seen:
            seen.add(w)
            yield w


def make_cwe(
    name: str,
    tokenizer,
    budget: int,
    rng: random.Random,
    *,
    n_common: int = COMMON_WORDS,
    freq_common: int = FREQ_COMMON,
    freq_uncommon: int = FREQ_UNCOMMON,
) -> Sample:
    """One common-words prompt of at most ``budget`` tokens (within one uncommon word's
    entries of it)."""
    pieces = _Pieces(tokenizer)
    head = encode(tokenizer, HEAD, bos=True)
    tail = encode(tokenizer, TAIL.format(n=n_common))
    stream = _word_stream(rng)
    common = [next(stream) for _ in range(n_common)]
    uncommon: list[str] = []
    fixed = len(head) + len(tail)

    def size(freq: int, extra: int) -> int:
        """Tokens of the prompt with common words at ``freq`` and ``extra`` uncommon words."""
        while len(uncommon) < extra:
            uncommon.append(next(stream))
        entries = n_common * freq + freq_uncommon * extra
        words = freq * sum(len(pieces.word(w)) for w in common)
        words += freq_uncommon * sum(len(pieces.word(w)) for w in uncommon[:extra])
        return fixed + pieces.numbers_length(entries) + words

    freq = next((f for f in range(freq_common, freq_uncommon, -1) if size(f, MIN_UNCOMMON) <= budget), None)
    if freq is None:
        raise ValueError(
            f"lengths: {budget} prompt tokens cannot hold the cwe task's list ({n_common} common words "
            f"at least {freq_uncommon + 1} times each and {MIN_UNCOMMON} others {freq_uncommon} times)"
        )
    extra = MIN_UNCOMMON
    # the size grows by whole uncommon words; grow by doubling, then bisect
    step = 1
    while size(freq, extra + step) <= budget:
        extra += step
        step *= 2
    while step > 1:
        step //= 2
        if size(freq, extra + step) <= budget:
            extra += step
    entries = common * freq + uncommon[:extra] * freq_uncommon
    rng.shuffle(entries)
    ids = list(head)
    for i, w in enumerate(entries, start=1):
        ids += pieces.number(i) + pieces.word(w)
    ids += tail
    return Sample(
        name,
        ids,
        list(common),
        [],
        {
            "common": list(common),
            "uncommon": list(uncommon[:extra]),
            "freq_common": freq,
            "freq_uncommon": freq_uncommon,
            "words": entries,
        },
    )
