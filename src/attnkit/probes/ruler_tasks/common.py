"""What every RULER task generator shares: the sample it returns, the bundled word
lists and essays, random keys and values, and the haystacks.

RULER (Hsieh et al. 2024, arXiv 2404.06654) draws needle keys as random
adjective-noun pairs, values as 7-digit numbers or UUIDs, and fills contexts with one of
three haystacks: "noise" (the same five plain sentences over and over), "essay" (real
prose; the paper uses Paul Graham's essays, attnkit bundles essays of its own in
``data/ruler_essays.txt``) and "needles" (a haystack made only of distractor needles).
The word lists in ``data/`` were written for attnkit; the templates of each task are
attnkit's wording of the paper's tasks.
"""

from __future__ import annotations

import functools
import random
import uuid
from dataclasses import dataclass, field
from importlib import resources

from ..haystack import Haystack

#: RULER's noise haystack: these five sentences, repeated (the paper's own filler).
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

#: every needle of the NIAH tasks reads like this (RULER's needle template)
NEEDLE = "One of the special magic {kind} for {key} is: {value}."

#: RULER's insertion depths: 40 evenly spaced fractions from 0 to 1, rounded to percents
DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))


@dataclass
class Sample:
    """One prompt of a task: ``ids`` (the prompt's token ids, at most the budget it was
    built for), ``answers`` (the references: every one must appear in the output, RULER's
    string_match_all), ``spans`` (token ranges (start, end) in ``ids`` of the needles the
    answer has to read; empty for cwe and fwe) and ``info`` (what the generator drew:
    keys, values, depths, word counts; for tests and reports)."""

    task: str
    ids: list[int]
    answers: list[str]
    spans: list[tuple[int, int]] = field(default_factory=list)
    info: dict = field(default_factory=dict)


def _data_text(name: str) -> str:
    return resources.files("attnkit.probes").joinpath(f"data/{name}").read_text(encoding="utf-8")


@functools.cache
def word_list(name: str) -> tuple[str, ...]:
    """A bundled word list ("adjectives", "nouns", "verbs"): one word a line, ``#`` lines
    are comments."""
    lines = (line.strip() for line in _data_text(f"ruler_{name}.txt").splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Every distinct bundled word, sorted (the cwe task's pool)."""
    return tuple(sorted(set(word_list("adjectives")) | set(word_list("nouns")) | set(word_list("verbs"))))


@functools.cache
def noise_haystack() -> Haystack:
    """RULER's noise: the five sentences in their order, wrapping around."""
    return Haystack(NOISE, ordered=True, name="noise")


@functools.cache
def essay_haystack() -> Haystack:
    """The bundled essays, read in order from a random sentence and wrapping around (they
    hold about two thousand tokens, so longer contexts repeat them)."""
    return Haystack.from_text(_data_text("ruler_essays.txt"), name="essays")


def needle_depths(n: int, rng: random.Random) -> list[float]:
    """``n`` different depths drawn from RULER's grid, in the order drawn."""
    return rng.sample(DEPTHS, n)


def word_key(rng: random.Random) -> str:
    """A RULER word key: ``adjective-noun``."""
    return f"{rng.choice(word_list('adjectives'))}-{rng.choice(word_list('nouns'))}"


def number_value(rng: random.Random) -> str:
    """A 7-digit number (no leading zero), RULER's numeric needle value."""
    return str(rng.randint(1_000_000, 9_999_999))


def uuid_value(rng: random.Random) -> str:
    """A random version-4 UUID drawn from ``rng`` (so the seed fixes it)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


DRAW = {"words": word_key, "numbers": number_value, "uuids": uuid_value}


def distinct(kind: str, n: int, rng: random.Random, exclude=()) -> list[str]:
    """``n`` different draws of ``kind`` ("words", "numbers", "uuids"), none in ``exclude``."""
    seen = set(exclude)
    out: list[str] = []
    while len(out) < n:
        value = DRAW[kind](rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def listing(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b, and c``: several queried keys in one question."""
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]
