"""RULER's variable tracking, ``vt`` (Hsieh et al. 2024, arXiv 2404.06654, §3.2): multi-hop
tracing, a minimal form of coreference chains.

One chain of ``hops`` + 1 variables (five random capital letters each) is hidden in the
noise haystack in reading order, at different depths of RULER's grid: ``VAR X1 = 12345.``,
then ``VAR X2 = VAR X1.`` and so on for ``hops`` assignments (the value is a random 5-digit
number). The question asks which variables hold that value; the answer is all of them.
"""

from __future__ import annotations

import random
import string

from ..haystack import build_context, encode
from .common import Sample, needle_depths, noise_haystack

#: RULER's setting: one chain, four hops (five variables)
HOPS = 4

HEAD = "Keep track of the variable assignments hidden in the text below; a question about them follows the text.\n"
TAIL = (
    "\nQuestion: Which variables in the text above are assigned the value {value}, directly or through other "
    "variables? Answer: The {n} variables assigned the value {value} in the text above are:"
)


def variable_names(n: int, rng: random.Random) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def make_vt(name: str, tokenizer, budget: int, rng: random.Random, hops: int = HOPS) -> Sample:
    """One variable-tracking prompt of exactly ``budget`` tokens."""
    names = variable_names(hops + 1, rng)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    # sorted depths keep the chain in reading order (build_context keeps the given
    # order among needles that land on the same sentence start)
    depths = sorted(needle_depths(len(statements), rng))
    head = encode(tokenizer, HEAD, bos=True)
    tail = encode(tokenizer, TAIL.format(value=value, n=len(names)))
    context = build_context(
        tokenizer,
        noise_haystack(),
        length=budget,
        head=head,
        tail=tail,
        rng=rng,
        needles=[(encode(tokenizer, " " + s), d) for s, d in zip(statements, depths)],
    )
    return Sample(
        name, context.ids, names, context.spans, {"value": value, "statements": statements, "depths": depths, "haystack": "noise"}
    )
