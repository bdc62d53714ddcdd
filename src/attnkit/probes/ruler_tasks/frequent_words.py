"""RULER's frequent words extraction, ``fwe`` (Hsieh et al. 2024, arXiv 2404.06654, §3.3):
aggregation over the whole context.

A "coded text" of made-up words (random lowercase strings) drawn one after another from
a Zipf distribution with exponent ``alpha`` = 2 over a vocabulary ranked at random: word
of rank k has probability proportional to k^-alpha. The answer is the three most
frequent words of the text as written (counted, not assumed from the ranks). A text
whose third and fourth most frequent words tie is cut back until they do not (or drawn
again when that would cut much of it), so the answer is never ambiguous.
"""

from __future__ import annotations

import itertools
import random
import string
from collections import Counter

from ..haystack import encode
from .common import Sample

ALPHA = 2.0
TOP = 3
VOCABULARY = 1000
#: a text cut back by more than 1 - _KEEP to break a tie is drawn again, up to _ATTEMPTS times
_KEEP = 0.95
_ATTEMPTS = 20

HEAD = "Read the coded text below and keep count of how often each coded word appears in it.\n"
TAIL = (
    "\nQuestion: Which {n} coded words appear most often in the coded text above? "
    "Answer: The {n} most frequent coded words in the coded text above are:"
)


def coded_words(n: int, rng: random.Random) -> list[str]:
    """``n`` different made-up words of 3 to 6 lowercase letters."""
    words: list[str] = []
    seen = set()
    while len(words) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _unambiguous(counts: Counter, top: int) -> bool:
    ranked = sorted(counts.values(), reverse=True)
    return len(ranked) > top and ranked[top - 1] > ranked[top]


def _draw_text(tokenizer, words, weights, room: int, piece: dict, rng: random.Random) -> list[str]:
    """Zipf draws until the next word would not fit in ``room`` tokens."""
    text: list[str] = []
    used = 0
    while True:
        w = rng.choices(words, cum_weights=weights)[0]
        ids = piece.get(w)
        if ids is None:
            ids = piece[w] = encode(tokenizer, " " + w)
        if used + len(ids) > room:
            return text
        text.append(w)
        used += len(ids)


def make_fwe(
    name: str, tokenizer, budget: int, rng: random.Random, *, alpha: float = ALPHA, top: int = TOP, vocabulary: int = VOCABULARY
) -> Sample:
    """One frequent-words prompt of at most ``budget`` tokens (within one word of it)."""
    words = coded_words(vocabulary, rng)
    weights = list(itertools.accumulate((k + 1) ** -alpha for k in range(vocabulary)))
    head = encode(tokenizer, HEAD, bos=True)
    tail = encode(tokenizer, TAIL.format(n=top))
    piece: dict[str, list[int]] = {}
    best: list[str] = []
    for _ in range(_ATTEMPTS):
        text = _draw_text(tokenizer, words, weights, budget - len(head) - len(tail), piece, rng)
        drawn = len(text)
        counts = Counter(text)
        while text and not _unambiguous(counts, top):
            counts[text.pop()] -= 1
            counts += Counter()  # drop words whose count fell to zero
        if len(text) > len(best):
            best = text
        if len(text) >= _KEEP * drawn:
            break
    if not best:
        raise ValueError(f"lengths: {budget} prompt tokens are too few for an fwe text with a clear top {top}")
    text, counts = best, Counter(best)
    answers = [w for w, _ in counts.most_common(top)]
    ids = list(head)
    for w in text:
        ids += piece[w]
    ids += tail
    return Sample(name, ids, answers, [], {"words": text, "alpha": alpha, "ranked": words})
