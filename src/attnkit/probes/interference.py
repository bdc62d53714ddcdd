"""Proactive interference (PI-LLM: Wang et al. 2025, "Unable to Forget: Proactive
Interference Reveals Working Memory Limits in LLMs Beyond Context Length", arXiv
2506.08184): a stream of updates to a few keys, each key updated ``n`` times with a new
value, then the question "what is the last value of key X?". Only the last update is
true; the earlier ones interfere, and in the paper accuracy falls roughly log-linearly
as ``n`` grows, with the wrong answers drifting to earlier values.

The probe's rules: ``keys`` keys (one is asked, the others interleave with it), each
updated ``n`` times with values distinct over the stream; the updates of all keys come in a
random order; the asked key is drawn per sample. From the same greedy run, a
``RowSpanMass`` meter measures how much attention the answer's query rows put on the
asked key's last value and on its stale (earlier) values, per layer and head.

On an arena export trained on a key-value task (needle, mqar) the stream is the task's
own tokens: ``key value`` pairs, then the asked key (after ``Q`` for the needle task);
these tasks never repeat a key in training, so updates are new to the model.

Rows: ``accuracy`` per n (the last value found, string_match_all); ``stale_answer``
per n (fraction of answers that name a stale value of the key instead: interference
itself); ``last_mass`` and ``stale_mass`` per (n, layer, head), with ``_max`` (the best
head) and ``_uniform`` (an even spread) per n.
"""

from __future__ import annotations

import random
import time

from ..validate import integer
from .haystack import encode
from .result import ProbeResult
from .retrieval import (
    Item,
    add_accuracy_rows,
    add_mass_rows,
    arena_symbols,
    check_ints,
    check_kv,
    check_max_positions,
    check_run,
    examples,
    kv_params,
    run_items,
    score,
)

DEFAULT_UPDATES = (1, 2, 4, 8)
INTRO = "Below is a stream of updates, one per line: each sets a key to a new value. Only the latest value of a key counts."

#: keys of the natural-language stream
_KEYS = (
    "red",
    "blue",
    "green",
    "amber",
    "violet",
    "silver",
    "tiger",
    "otter",
    "falcon",
    "badger",
    "heron",
    "lynx",
    "maple",
    "cedar",
)


def interference(
    model=None,
    tokenizer=None,
    *,
    updates=DEFAULT_UPDATES,
    keys: int = 4,
    samples: int = 4,
    seed: int = 0,
    progress=None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    kv=None,
) -> ProbeResult:
    """Accuracy of recalling a key's last value against the number of updates ``n``.

    Args:
        updates: the values of n, how many times every key is set (1 = no interference)
        keys: keys in the stream (one of them is asked)
        samples: prompts per n
        seed: the same seed gives the same prompts
        batch_size: prompts per forward pass
        max_new_tokens: default the answer's tokens + 4 (1 on an arena export)
        kv: a KV-cache policy to answer through (``attnkit.kv.protocol.KVSetting`` or its text,
            ``h2o:budget=0.25``): the question is asked after the stream is compressed; no
            attention masses are measured then"""
    start = time.perf_counter()
    pm, samples, seed, batch_size, say, max_new_tokens = check_run(
        model, tokenizer, "interference", samples, seed, batch_size, progress, max_new_tokens
    )
    updates = check_ints(updates, "updates", 1)
    keys = integer(keys, "keys", 1)
    kv = check_kv(kv)
    params = {
        "updates": updates,
        "keys": keys,
        "samples": samples,
        "seed": seed,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "kv": None if kv is None else kv_params(kv),
    }
    if pm.task is not None:
        sym = arena_symbols(pm, "interference")
        if keys > len(sym["keys"]):
            raise ValueError(f"keys: the task has {len(sym['keys'])} key symbols, got {keys}")
        if max(updates) > len(sym["values"]):
            raise ValueError(f"updates: a key's values are distinct and the task has {len(sym['values'])}, got {max(updates)}")
        items = arena_items(sym, updates, keys, samples, seed)
        new_tokens = max_new_tokens or 1
    else:
        if keys > len(_KEYS):
            raise ValueError(f"keys: at most {len(_KEYS)} keys, got {keys}")
        items = text_items(pm, updates, keys, samples, seed)
        new_tokens = max_new_tokens or max(len(encode(pm.tokenizer, " " + it.answer)) for it in items) + 4
    for length in sorted({len(it.ids) for it in items}):
        check_max_positions(pm, length, new_tokens, "updates")

    outcomes, layers = run_items(pm, items, new_tokens, batch_size, say, "interference", kv=kv)
    result = ProbeResult("interference")
    add_accuracy_rows(result, outcomes, ("n",))
    for n in updates:
        group = [o for o in outcomes if o.item.params["n"] == n]
        stale = [float(o.score < 1 and any(score(o.output, v, o.item.words) for v in o.item.extra["stale"])) for o in group]
        result.add("stale_answer", sum(stale) / len(stale), n=n)
    stale_outcomes = [o for o in outcomes if o.item.params["n"] > 1]
    if kv is None:  # under a KV policy no masses are measured
        add_mass_rows(result, outcomes, layers, ("n",), "last", "last_mass")
        if stale_outcomes:
            add_mass_rows(result, stale_outcomes, layers, ("n",), "stale", "stale_mass")
    result.meta = {
        "model": pm.name,
        "params": params,
        "seconds": time.perf_counter() - start,
        "max_new_tokens": new_tokens,
        "examples": examples(outcomes),
        "figures": [
            {
                "kind": "curve",
                "x": "n",
                "metric": ["accuracy", "stale_answer"],
                "series": None,
                "title": "Recall of a key's last value against the number of updates (proactive interference)",
            },
            {
                "kind": "curve",
                "x": "n",
                "metric": ["last_mass_max", "stale_mass_max"],
                "series": None,
                "title": "Attention mass on the last value and on stale values (best head)",
            },
        ][: 1 if kv is not None else None],
    }
    return result


def _stream(rng: random.Random, names: list, values: list, keys: int, n: int):
    """(asked key, updates as (key, value) in stream order): every key set n times, in a
    random order. Values are distinct over the whole stream where there are enough (so
    an answer naming another key's value never scores), else distinct per key (the few
    value symbols of an arena task)."""
    chosen = rng.sample(names, keys)
    if len(values) >= keys * n:
        drawn = rng.sample(values, keys * n)
        per_key = {k: drawn[i * n : (i + 1) * n] for i, k in enumerate(chosen)}
    else:
        per_key = {k: rng.sample(values, n) for k in chosen}
    order = [k for k in chosen for _ in range(n)]
    rng.shuffle(order)
    used = {k: 0 for k in chosen}
    stream = []
    for k in order:
        stream.append((k, per_key[k][used[k]]))
        used[k] += 1
    return rng.choice(chosen), stream


def text_items(pm, updates, keys, samples, seed) -> list[Item]:
    tok = pm.tokenizer
    head = encode(tok, INTRO, bos=True)
    numbers = [str(v) for v in range(100, 1000)]
    items = []
    for n in updates:
        for sample in range(samples):
            rng = random.Random(f"interference:{seed}:{n}:{sample}")
            asked, stream = _stream(rng, list(_KEYS), numbers, keys, n)
            ids = list(head)
            last: tuple[int, int] | None = None
            stale: list[tuple[int, int]] = []
            for k, v in stream:
                ids += encode(tok, f"\n{k}:")
                value = encode(tok, f" {v}")
                if k == asked:
                    stale += [last] if last is not None else []
                    last = (len(ids), len(ids) + len(value))
                ids += value
            question = encode(tok, f"\nQuestion: What is the last value of {asked}? Answer: The last value of {asked} is")
            ids += question
            history = [v for k, v in stream if k == asked]
            items.append(
                _item(
                    ids,
                    history,
                    last,
                    stale,
                    n,
                    sample,
                    asked,
                    words=False,
                    question=len(question),
                    answer_ids=encode(tok, f" {history[-1]}"),
                )
            )
    return items


def arena_items(sym, updates, keys, samples, seed) -> list[Item]:
    ids_of = sym["ids"]
    items = []
    for n in updates:
        for sample in range(samples):
            rng = random.Random(f"interference-arena:{seed}:{n}:{sample}")
            asked, stream = _stream(rng, sym["keys"], sym["values"], keys, n)
            tokens: list[str] = []
            last: tuple[int, int] | None = None
            stale: list[tuple[int, int]] = []
            for k, v in stream:
                if k == asked:
                    stale += [last] if last is not None else []
                    last = (len(tokens) + 1, len(tokens) + 2)
                tokens += [k, v]
            tokens += sym["query"] + [asked]
            history = [v for k, v in stream if k == asked]
            items.append(
                _item(
                    [ids_of[t] for t in tokens],
                    history,
                    last,
                    stale,
                    n,
                    sample,
                    asked,
                    words=True,
                    question=len(sym["query"]) + 1,
                    answer_ids=[ids_of[history[-1]]],
                )
            )
    return items


def _item(ids, history, last, stale, n, sample, asked, words, question, answer_ids) -> Item:
    spans = {"last": [last]}
    if stale:
        spans["stale"] = stale
    return Item(
        ids,
        history[-1],
        spans,
        {"n": n, "sample": sample},
        words=words,
        extra={"key": asked, "stale": history[:-1]},
        question=question,
        answer_ids=answer_ids,
    )
