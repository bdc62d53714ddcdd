"""Key-value retrieval, "lost in the middle" (Liu et al. 2023, arXiv 2307.03172): a JSON
object of ``N`` random UUID keys and UUID values, one of the keys asked for; the gold
pair moved through every requested position. Models retrieve best when the pair is at
the start or the end of the context and worst in the middle: the U-curve. Alongside
accuracy the probe measures the attention mass the answer's query rows put on the gold
pair's tokens, per layer and head, from the same greedy run (``RowSpanMass``, O(N)).

On an arena export trained on a key-value task (needle, mqar) the object is the
task's own tokens: ``N`` (key, value) pairs side by side, then the asked key (after
``Q`` for the needle task), and the answer is the gold value symbol.

Rows: ``accuracy`` per (pairs, position) (mean over samples; position counts pairs from
0); ``gold_mass`` per (pairs, position, layer, head); ``gold_mass_max`` (the best
head) and ``gold_mass_uniform`` (the even-spread share) per (pairs, position).
"""

from __future__ import annotations

import json
import random
import time
import uuid

from .haystack import encode
from .result import ProbeResult
from .retrieval import (Item, add_accuracy_rows, add_mass_rows, arena_symbols, check_fractions, check_ints,
                        check_max_positions, check_run, examples, run_items)

DEFAULT_PAIRS = (10,)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
INTRO = "Below is a JSON object of keys and values. Find the value stored under the key that is asked for."


def kv_retrieval(model=None, tokenizer=None, *, pairs: list[int] | None = None, depths=DEFAULT_DEPTHS, samples: int = 1,
                 seed: int = 0, progress=None, batch_size: int = 8, max_new_tokens: int | None = None) -> ProbeResult:
    """Lost-in-the-middle key-value retrieval (see the module docstring).

    Args:
        pairs: numbers of key-value pairs per prompt (default 10; on an arena export, min(8, the task's keys))
        depths: where the gold pair sits, fractions 0..1 mapped to pair index
            round(depth * (pairs - 1))
        samples: prompts per (pairs, position), each its own keys and values (shared by the positions of a sample)
        seed: the same seed gives the same prompts
        batch_size: prompts per forward pass
        max_new_tokens: tokens to generate (default the answer's tokens + 4; 1 on an arena export)"""
    start = time.perf_counter()
    pm, samples, seed, batch_size, say, max_new_tokens = check_run(model, tokenizer, "kv-retrieval", samples, seed, batch_size,
                                                               progress, max_new_tokens)
    depths = check_fractions(depths, "--depths")
    params = {"pairs": pairs, "depths": depths, "samples": samples, "seed": seed, "batch_size": batch_size,
              "max_new_tokens": max_new_tokens}
    if pm.task is not None:
        sym = arena_symbols(pm, "kv-retrieval")
        most = min(len(sym["keys"]), len(sym["values"]))
        pairs = check_ints([min(8, most)] if pairs is None else pairs, "--pairs", 1)
        if max(pairs) > most:
            raise ValueError(f"--pairs: the task has {len(sym['keys'])} keys and {len(sym['values'])} values, "
                             f"so at most {most} distinct pairs; got {max(pairs)}")
        items = arena_items(sym, pairs, depths, samples, seed)
        new_tokens = max_new_tokens or 1
    else:
        pairs = check_ints(list(DEFAULT_PAIRS) if pairs is None else pairs, "--pairs", 1)
        items = text_items(pm, pairs, depths, samples, seed)
        new_tokens = max_new_tokens or max(len(encode(pm.tokenizer, " " + it.answer)) for it in items) + 4
    params["pairs"] = pairs
    for length in sorted({len(it.ids) for it in items}):
        check_max_positions(pm, length, new_tokens, "--pairs")

    outcomes, layers = run_items(pm, items, new_tokens, batch_size, say, "kv-retrieval")
    result = ProbeResult("kv-retrieval")
    add_accuracy_rows(result, outcomes, ("pairs", "position"))
    add_mass_rows(result, outcomes, layers, ("pairs", "position"), "gold", "gold_mass")
    result.meta = {
        "model": pm.name, "params": params, "seconds": time.perf_counter() - start, "max_new_tokens": new_tokens,
        "examples": examples(outcomes),
        "figures": [
            {"kind": "curve", "x": "position", "metric": "accuracy", "series": "pairs",
             "title": "Key-value retrieval accuracy against the gold pair's position (lost in the middle)"},
            {"kind": "curve", "x": "position", "metric": ["gold_mass_max", "gold_mass_uniform"], "series": "pairs",
             "title": "Attention mass on the gold pair (best head, and an even spread) against its position"},
        ],
    }
    return result


def _positions(n: int, depths) -> list[tuple[float, int]]:
    """(depth, pair index) for each depth; depths that land on the same index run once."""
    seen, out = set(), []
    for d in depths:
        i = round(d * (n - 1))
        if i not in seen:
            seen.add(i)
            out.append((d, i))
    return out


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def text_items(pm, pairs, depths, samples, seed) -> list[Item]:
    """The JSON prompts: the gold pair at each position, its token span measured."""
    tok = pm.tokenizer
    head = encode(tok, INTRO + "\n", bos=True)
    items = []
    for n in pairs:
        for sample in range(samples):
            rng = random.Random(f"kv-retrieval:{seed}:{n}:{sample}")
            kv = [(_uuid(rng), _uuid(rng)) for _ in range(n)]
            gold = kv[0]
            rest = kv[1:]
            for depth, index in _positions(n, depths):
                order = rest[:index] + [gold] + rest[index:]
                ids, span = list(head) + encode(tok, "{"), None
                for j, (k, v) in enumerate(order):
                    piece = encode(tok, (", " if j else "") + f"{json.dumps(k)}: {json.dumps(v)}")
                    if j == index:
                        span = (len(ids), len(ids) + len(piece))
                    ids += piece
                ids += encode(tok, "}\n" + f"Key: {json.dumps(gold[0])}\nValue:")
                items.append(Item(ids, gold[1], {"gold": [span]}, {"pairs": n, "position": index, "depth": depth,
                                                                   "sample": sample}, extra={"key": gold[0]}))
    return items


def arena_items(sym, pairs, depths, samples, seed) -> list[Item]:
    """Pairs of the task's key and value symbols side by side, then the asked key."""
    ids = sym["ids"]
    items = []
    for n in pairs:
        for sample in range(samples):
            rng = random.Random(f"kv-retrieval-arena:{seed}:{n}:{sample}")
            keys, values = rng.sample(sym["keys"], n), rng.sample(sym["values"], n)
            gold, rest = (keys[0], values[0]), list(zip(keys[1:], values[1:]))
            for depth, index in _positions(n, depths):
                order = rest[:index] + [gold] + rest[index:]
                tokens = [t for pair in order for t in pair] + sym["query"] + [gold[0]]
                items.append(Item([ids[t] for t in tokens], gold[1], {"gold": [(2 * index, 2 * index + 2)]},
                                  {"pairs": n, "position": index, "depth": depth, "sample": sample}, words=True,
                                  extra={"key": gold[0]}))
    return items
