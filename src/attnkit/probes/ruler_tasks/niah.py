"""RULER's eight needle-in-a-haystack tasks (Hsieh et al. 2024, arXiv 2404.06654, §3.1).

Needles read "One of the special magic {numbers|uuids} for {key} is: {value}." and go to
different depths drawn from RULER's grid of 40 (0%, 3%, ..., 100% of the haystack), at
sentence starts. The tasks differ in the
haystack, the kinds of keys and values, and how many needles there are:

=================  =========  ======  =======  ====  ======  =======
task               haystack   keys    values   keys  values  queried
=================  =========  ======  =======  ====  ======  =======
niah_single_1      noise      words   numbers  1     1       1
niah_single_2      essay      words   numbers  1     1       1
niah_single_3      essay      words   uuids    1     1       1
niah_multikey_1    essay      words   numbers  4     1       1
niah_multikey_2    needles    words   numbers  1     1       1
niah_multikey_3    needles    uuids   uuids    1     1       1
niah_multivalue    essay      words   numbers  1     4       1
niah_multiquery    essay      words   numbers  4     1       4
=================  =========  ======  =======  ====  ======  =======

multikey_1 hides three distractor needles with other keys; multikey_2/3 fill the whole
haystack with distractor needles (other keys, other values) until the length is
reached; multivalue gives one key four values (all four are the answer); multiquery
asks for four keys at once (all four values are the answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..haystack import Haystack, build_context, encode
from .common import NEEDLE, Sample, distinct, essay_haystack, listing, needle_depths, noise_haystack

HEAD = (
    "Some special magic {kind} are hidden in the text below. Remember them, because there will be a question "
    "about them after the text.\n"
)
TAIL = (
    "\nQuestion: What are all the special magic {kind} for {query} that the text above mentions? "
    "Answer: The special magic {kind} for {query} mentioned in the text above are:"
)


@dataclass(frozen=True)
class NiahTask:
    haystack: str  # "noise", "essay" or "needles"
    keys: str  # "words" or "uuids"
    values: str  # "numbers" or "uuids"
    n_keys: int = 1  # needles with different keys (the queried ones and the distractors)
    n_values: int = 1  # needles per queried key, each with its own value
    n_queries: int = 1  # keys asked for at once


NIAH = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": NiahTask("needles", "words", "numbers"),
    "niah_multikey_3": NiahTask("needles", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", n_values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", n_keys=4, n_queries=4),
}

#: a needle is longer than this many tokens with any subword tokenizer, so a needle
#: haystack of ``budget // _MIN_NEEDLE_TOKENS`` distractors always fills the budget
_MIN_NEEDLE_TOKENS = 8


def make_niah(name: str, tokenizer, budget: int, rng: random.Random) -> Sample:
    """One prompt of NIAH task ``name`` with exactly ``budget`` tokens."""
    task = NIAH[name]
    keys = distinct(task.keys, task.n_keys, rng)
    queried = keys[: task.n_queries]
    values = distinct(task.values, task.n_keys * task.n_values, rng)
    # needle i: key keys[i // n_values]; the queried needles come first
    needles = [NEEDLE.format(kind=task.values, key=keys[i // task.n_values], value=values[i]) for i in range(len(values))]
    answers = values[: task.n_queries * task.n_values]
    depths = needle_depths(len(needles), rng)
    if task.haystack == "needles":
        haystack = _needle_haystack(task, budget, rng, exclude_keys=keys, exclude_values=values)
    else:
        haystack = noise_haystack() if task.haystack == "noise" else essay_haystack()
    head = encode(tokenizer, HEAD.format(kind=task.values), bos=True)
    tail = encode(tokenizer, TAIL.format(kind=task.values, query=listing(queried)))
    context = build_context(
        tokenizer,
        haystack,
        length=budget,
        needles=[(encode(tokenizer, " " + n), d) for n, d in zip(needles, depths)],
        head=head,
        tail=tail,
        rng=rng,
    )
    return Sample(
        name,
        context.ids,
        answers,
        context.spans[: len(answers)],
        {"keys": keys, "queried": queried, "values": values, "needles": needles, "depths": depths, "haystack": haystack.name},
    )


def _needle_haystack(task: NiahTask, budget: int, rng: random.Random, exclude_keys, exclude_values) -> Haystack:
    """A haystack of distractor needles: fresh keys and values, none equal to the real ones,
    enough of them to fill ``budget`` tokens without repeating one."""
    count = budget // _MIN_NEEDLE_TOKENS + 2
    keys = distinct(task.keys, count, rng, exclude=exclude_keys)
    values = distinct(task.values, count, rng, exclude=exclude_values)
    return Haystack(
        tuple(NEEDLE.format(kind=task.values, key=k, value=v) for k, v in zip(keys, values)), ordered=True, name="needles"
    )
