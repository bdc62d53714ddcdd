"""Needle in a haystack: can the model find one fact in a long context, at every
context length and every depth, and which heads look at it while it answers?

The grid is Kamradt's (2023): context lengths x needle depths, the needle inserted at
a depth walked back to a sentence boundary, room kept for the question (see
``haystack.py``); the default haystack is filler sentences, RULER's noise haystack
(Hsieh et al. 2024, arXiv 2404.06654), whose needle is "a special code" (a key with a
random 7-digit value). The answer is generated greedily through attnkit's kernels and
scored by RULER's ``string_match_all``. From the same run, a ``RowSpanMass`` meter
(O(N) memory) measures the attention mass that the answer's query rows (the last
prompt row and every generated row) put on the needle's tokens, per layer and head:
retrieval heads (Wu et al. 2024, arXiv 2404.15574) show up as the few heads whose mass
is far above the uniform share.

On an arena export trained on the needle task the prompt is the task's own format:
two-token (key, value) cells among random filler, the task's distractor pairs in other
cells, ``Q key`` at the end, and the answer is the needle's value symbol.

Rows: ``accuracy`` per (length, depth) (mean over samples); ``needle_mass`` per
(length, depth, layer, head) (mean over samples); ``needle_mass_max`` per (length,
depth), the best head's needle mass (the heatmap in ``meta["figures"]``: where the
model still has a head that finds the needle); ``needle_mass_uniform`` per (length,
depth), the mass a head spreading evenly over the visible keys would put on the needle.
"""

from __future__ import annotations

import random
import time

from .haystack import Haystack, build_context, encode
from .result import ProbeResult
from .retrieval import (
    Item,
    add_accuracy_rows,
    add_mass_rows,
    arena_symbols,
    check_fractions,
    check_ints,
    check_kv,
    check_max_positions,
    check_run,
    check_text,
    examples,
    kv_params,
    run_items,
)

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

NEEDLE = "The special code of the {key} is {value}."
QUESTION = "What is the special code of the {key}?"
#: the start of the answer, written into the prompt so the value comes first (with the default needle only)
ANSWER_PREFIX = "The special code of the {key} is"
INTRO = "Some special codes are hidden in the text below. Remember them: a question about one follows the text."

#: keys of the default needle: an adjective and an animal, drawn per sample
_ADJECTIVES = ("red", "blue", "green", "amber", "violet", "silver", "quiet", "rapid", "gentle", "brave")
_ANIMALS = ("tiger", "otter", "falcon", "badger", "heron", "lynx", "beaver", "raven", "salmon", "gecko")


def needle(
    model=None,
    tokenizer=None,
    *,
    lengths: list[int] | None = None,
    depths=DEFAULT_DEPTHS,
    samples: int = 1,
    seed: int = 0,
    progress=None,
    batch_size: int = 8,
    needle: str | None = None,
    question: str | None = None,
    answer: str | None = None,
    haystack: str | None = None,
    max_new_tokens: int | None = None,
    kv=None,
) -> ProbeResult:
    """The needle-in-a-haystack grid (see the module docstring).

    Args:
        lengths: prompt lengths in tokens (default 1024, 2048, 4096 where they fit with the answer's
            rows, the longest shortened to fit; on an arena export, the task's evaluation lengths)
        depths: where the needle goes, fractions 0..1 of the haystack
        samples: prompts per cell (each its own key, value and haystack, shared by the depths of a sample)
        seed: the same seed gives the same prompts
        batch_size: prompts per forward pass (prompts of near-equal length share one)
        needle: the needle sentence, a template with {key} and {value}
        question: the question, a template with {key} (and {value})
        answer: the expected answer, a template (default {value}; needed when the needle has no {value})
        haystack: a UTF-8 text file to use as the haystack (read in order); default: filler sentences
        max_new_tokens: tokens to generate (default the answer's tokens + 4; on an arena export, the value's tokens)
        kv: a KV-cache policy to answer through (``attnkit.kv.protocol.KVSetting`` or its text,
            ``snapkv:budget=0.25:protocol=aware``): the question is asked after the context is
            compressed; no attention masses are measured then

    A custom ``needle`` gets no answer prefix ("Answer:" ends the prompt); the default
    one's prompt ends "Answer: The special code of the KEY is"."""
    start = time.perf_counter()
    pm, samples, seed, batch_size, say, max_new_tokens = check_run(
        model, tokenizer, "needle", samples, seed, batch_size, progress, max_new_tokens
    )
    depths = check_fractions(depths, "depths")
    kv = check_kv(kv)
    params = {
        "lengths": lengths,
        "depths": depths,
        "samples": samples,
        "seed": seed,
        "batch_size": batch_size,
        "needle": needle,
        "question": question,
        "answer": answer,
        "haystack": None if haystack is None else str(haystack),
        "max_new_tokens": max_new_tokens,
        "kv": None if kv is None else kv_params(kv),
    }
    if pm.task is not None:
        given = (("needle", needle), ("question", question), ("answer", answer), ("haystack", haystack))
        for name, value in given:
            if value is not None:
                raise ValueError(
                    f"{name}: an arena export is probed in its task's own tokens; --{name} applies to "
                    "natural-language models only"
                )
        lengths = check_ints(pm.task.get("eval_lengths") if lengths is None else lengths, "lengths", 4)
        items = arena_items(pm, lengths, depths, samples, seed)
        new_tokens = max_new_tokens or len(items[0].answer_ids or ())  # arena items carry their answer's ids
    else:
        default = lengths is None
        lengths = check_ints(_default_lengths(pm) if default else lengths, "lengths")
        items, needed = text_items(pm, lengths, depths, samples, seed, needle, question, answer, haystack)
        new_tokens = max_new_tokens or needed + 4
        for _ in range(3):
            if not (default and pm.max_positions is not None and max(lengths) + new_tokens - 1 > pm.max_positions):
                break
            # The default grid leaves room for the answer's rows inside the model's positions
            # (GPT-2's 1024 positions give a 1024 - answer rows prompt, not an error); the
            # rebuilt prompts have other values, so their answer may need another token.
            room = pm.max_positions - (new_tokens - 1)
            lengths = sorted({min(n, room) for n in lengths})
            items, needed = text_items(pm, lengths, depths, samples, seed, needle, question, answer, haystack)
            new_tokens = max_new_tokens or needed + 4
    params["lengths"] = lengths
    for length in lengths:
        check_max_positions(pm, length, new_tokens)

    outcomes, layers = run_items(pm, items, new_tokens, batch_size, say, "needle", kv=kv)
    result = ProbeResult("needle")
    add_accuracy_rows(result, outcomes, ("length", "depth"))
    if kv is None:
        add_mass_rows(result, outcomes, layers, ("length", "depth"), "needle", "needle_mass")
    result.meta = {
        "model": pm.name,
        "params": params,
        "seconds": time.perf_counter() - start,
        "max_new_tokens": new_tokens,
        "examples": examples(outcomes),
        "figures": [
            {
                "kind": "heatmap",
                "rows": "depth",
                "cols": "length",
                "metric": "accuracy",
                "title": "Needle retrieval accuracy (string_match_all) by depth and context length",
            },
            {
                "kind": "heatmap",
                "rows": "depth",
                "cols": "length",
                "metric": "needle_mass_max",
                "title": "Attention mass on the needle, best head, by depth and context length",
            },
            {
                "kind": "heatmap",
                "rows": "layer",
                "cols": "head",
                "metric": "needle_mass",
                "title": "Attention mass on the needle by layer and head (mean over the grid)",
            },
        ][: 1 if kv is not None else None],  # under a KV policy no masses are measured
    }
    return result


def _default_lengths(pm) -> list[int]:
    if pm.max_positions is None:
        return list(DEFAULT_LENGTHS)
    fits = [n for n in DEFAULT_LENGTHS if n <= pm.max_positions]
    return fits or [pm.max_positions // 2, pm.max_positions]


def _sample_rng(probe: str, seed: int, length: int, sample: int) -> random.Random:
    """One generator per (length, sample): every depth of a sample gets the same key,
    value and haystack, and adding a length to the grid changes no other prompt."""
    return random.Random(f"{probe}:{seed}:{length}:{sample}")


def text_items(pm, lengths, depths, samples, seed, needle=None, question=None, answer=None, haystack=None):
    """The natural-language prompts: ``(items, tokens the longest answer needs)``."""
    custom = needle is not None
    needle = check_text(NEEDLE if needle is None else needle, "needle", () if answer is not None else ("value",))
    question = check_text(QUESTION if question is None else question, "question")
    answer = check_text("{value}" if answer is None else answer, "answer")
    hay = Haystack.resolve(haystack)
    tok = pm.tokenizer
    items, needed = [], 1
    for length in lengths:
        for sample in range(samples):
            for depth in depths:
                rng = _sample_rng("needle", seed, length, sample)
                key = f"{rng.choice(_ADJECTIVES)} {rng.choice(_ANIMALS)}"
                value = str(rng.randrange(1_000_000, 10_000_000))
                fields = {"key": key, "value": value}
                reply = "" if custom else " " + ANSWER_PREFIX.format(**fields)
                tail = encode(tok, f" Question: {question.format(**fields)} Answer:{reply}")
                needle_ids = encode(tok, " " + needle.format(**fields))
                ctx = build_context(
                    tok, hay, length=length, needles=[(needle_ids, depth)], head=encode(tok, INTRO, bos=True), tail=tail, rng=rng
                )
                expected = answer.format(**fields)
                needed = max(needed, len(encode(tok, " " + expected)))
                items.append(
                    Item(
                        ctx.ids,
                        expected,
                        {"needle": [ctx.spans[0]]},
                        {"length": length, "depth": depth, "sample": sample},
                        extra={"key": key},
                        question=len(tail),
                        answer_ids=encode(tok, " " + expected),
                    )
                )
    return items, needed


def arena_items(pm, lengths, depths, samples, seed) -> list[Item]:
    """Prompts in the needle task's tokens: (key, value) cells among filler, the task's
    distractor pairs in other cells, ``Q key`` last (see arena/tasks/needle.py). With
    ``value_len`` L > 1 a cell is a key and L value symbols, the cells start after the
    filler that the cell size leaves over, and the answer is the L symbols."""
    sym = arena_symbols(pm, "needle")
    if sym["name"] != "needle":
        raise ValueError(
            f"model: the needle probe on an arena export needs a model trained on the needle task; "
            f"{pm.name or 'this model'} was trained on {sym['name']!r} (try the kv-retrieval probe)"
        )
    distractors = int(sym["params"].get("distractors", 0))
    value_len = int(sym["params"].get("value_len", 1))
    cell_len = 1 + value_len
    pairs = distractors + 1
    if pairs > len(sym["keys"]) or (value_len == 1 and pairs > len(sym["values"])):
        raise ValueError(f"model: the task has {len(sym['keys'])} keys for {pairs} pairs per prompt")
    ids = sym["ids"]
    items = []
    for length in lengths:
        if value_len == 1 and length % 2:
            raise ValueError(
                f"lengths: the needle task cuts its context into two-token cells, so lengths must be even, got {length}"
            )
        cells = (length - cell_len) // cell_len if value_len > 1 else (length - 2) // 2
        lead = length - 2 - cells * cell_len if value_len > 1 else 0
        if cells < pairs:
            raise ValueError(
                f"lengths: {length} tokens hold {cells} cells, fewer than the needle and its {distractors} distractors"
            )
        for sample in range(samples):
            for depth in depths:
                rng = _sample_rng("needle-arena", seed, length, sample)
                keys = rng.sample(sym["keys"], pairs)
                if value_len == 1:
                    values = [[v] for v in rng.sample(sym["values"], pairs)]
                else:
                    values = [[rng.choice(sym["values"]) for _ in range(value_len)] for _ in range(pairs)]
                tokens = [rng.choice(sym["filler"]) for _ in range(length)]
                cell = round(depth * (cells - 1))
                others = rng.sample([c for c in range(cells) if c != cell], distractors)
                for c, k, v in zip([cell, *others], keys, values):
                    start = lead + cell_len * c
                    tokens[start : start + cell_len] = [k, *v]
                tokens[-2], tokens[-1] = sym["query"][0], keys[0]
                start = lead + cell_len * cell
                items.append(
                    Item(
                        [ids[t] for t in tokens[:length]],
                        " ".join(values[0]),
                        {"needle": [(start, start + cell_len)]},
                        {"length": length, "depth": depth, "sample": sample},
                        words=True,
                        extra={"key": keys[0]},
                        question=2,
                        answer_ids=[ids[t] for t in values[0]],
                    )
                )
    return items
