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

from ..validate import integer
from .haystack import encode
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
    examples,
    kv_params,
    run_items,
)

DEFAULT_PAIRS = (10,)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
INTRO = "Below is a JSON object of keys and values. Find the value stored under the key that is asked for."


def kv_retrieval(
    model=None,
    tokenizer=None,
    *,
    pairs: list[int] | None = None,
    depths=DEFAULT_DEPTHS,
    samples: int = 1,
    seed: int = 0,
    progress=None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    length: int | None = None,
    kv=None,
) -> ProbeResult:
    """Lost-in-the-middle key-value retrieval (see the module docstring).

    Args:
        pairs: numbers of key-value pairs per prompt (default 10; on an arena export, min(8, the task's keys))
        depths: where the gold pair sits, fractions 0..1 mapped to pair index
            round(depth * (pairs - 1))
        samples: prompts per (pairs, position), each its own keys and values (shared by the positions of a sample)
        seed: the same seed gives the same prompts
        batch_size: prompts per forward pass
        max_new_tokens: tokens to generate (default the answer's tokens + 4; 1 on an arena export)
        length: on an arena export with filler (the needle task), a prompt of this many tokens with the
            pairs spread evenly through it, filler between (the setting of a long-context organism such
            as kv-retrieval-1k); default: the pairs side by side
        kv: a KV-cache policy to answer through (``attnkit.kv.protocol.KVSetting`` or its text,
            ``snapkv:budget=0.25``); no attention masses are measured then"""
    start = time.perf_counter()
    pm, samples, seed, batch_size, say, max_new_tokens = check_run(
        model, tokenizer, "kv-retrieval", samples, seed, batch_size, progress, max_new_tokens
    )
    depths = check_fractions(depths, "depths")
    kv = check_kv(kv)
    params = {
        "pairs": pairs,
        "depths": depths,
        "samples": samples,
        "seed": seed,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "length": length,
        "kv": None if kv is None else kv_params(kv),
    }
    if pm.task is not None:
        sym = arena_symbols(pm, "kv-retrieval")
        most = min(len(sym["keys"]), len(sym["values"]))
        pairs = check_ints([min(8, most)] if pairs is None else pairs, "pairs", 1)
        if max(pairs) > most:
            raise ValueError(
                f"pairs: the task has {len(sym['keys'])} keys and {len(sym['values'])} values, "
                f"so at most {most} distinct pairs; got {max(pairs)}"
            )
        items = arena_items(sym, pairs, depths, samples, seed, length)
        new_tokens = max_new_tokens or 1
    else:
        if length is not None:
            raise ValueError(
                "length: spreads an arena export's pairs through filler; a natural-language model's "
                "prompt length follows from --pairs"
            )
        pairs = check_ints(list(DEFAULT_PAIRS) if pairs is None else pairs, "pairs", 1)
        items = text_items(pm, pairs, depths, samples, seed)
        new_tokens = max_new_tokens or max(len(encode(pm.tokenizer, " " + it.answer)) for it in items) + 4
    params["pairs"] = pairs
    for length in sorted({len(it.ids) for it in items}):
        check_max_positions(pm, length, new_tokens, "pairs")

    outcomes, layers = run_items(pm, items, new_tokens, batch_size, say, "kv-retrieval", kv=kv)
    result = ProbeResult("kv-retrieval")
    add_accuracy_rows(result, outcomes, ("pairs", "position"))
    if kv is None:
        add_mass_rows(result, outcomes, layers, ("pairs", "position"), "gold", "gold_mass")
    result.meta = {
        "model": pm.name,
        "params": params,
        "seconds": time.perf_counter() - start,
        "max_new_tokens": new_tokens,
        "examples": examples(outcomes),
        "figures": [
            {
                "kind": "curve",
                "x": "position",
                "metric": "accuracy",
                "series": "pairs",
                "title": "Key-value retrieval accuracy against the gold pair's position (lost in the middle)",
            },
            {
                "kind": "curve",
                "x": "position",
                "metric": ["gold_mass_max", "gold_mass_uniform"],
                "series": "pairs",
                "title": "Attention mass on the gold pair (best head, and an even spread) against its position",
            },
        ][: 1 if kv is not None else None],  # under a KV policy no masses are measured
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
                ids = list(head) + encode(tok, "{")
                span: tuple[int, int] | None = None
                for j, (k, v) in enumerate(order):
                    piece = encode(tok, (", " if j else "") + f"{json.dumps(k)}: {json.dumps(v)}")
                    if j == index:
                        span = (len(ids), len(ids) + len(piece))
                    ids += piece
                assert span is not None  # order[index] is the gold pair
                question = encode(tok, "}\n" + f"Key: {json.dumps(gold[0])}\nValue:")
                ids += question
                items.append(
                    Item(
                        ids,
                        gold[1],
                        {"gold": [span]},
                        {"pairs": n, "position": index, "depth": depth, "sample": sample},
                        extra={"key": gold[0]},
                        question=len(question),
                        answer_ids=encode(tok, " " + gold[1]),
                    )
                )
    return items


def arena_items(sym, pairs, depths, samples, seed, length: int | None = None, keyword: str = "length") -> list[Item]:
    """Pairs of the task's key and value symbols, then the asked key: side by side, or
    (``length``) spread evenly through a prompt of that many tokens, filler between;
    ``keyword`` is the argument that gave ``length``, named by its errors."""
    ids = sym["ids"]
    if length is not None:
        length = integer(length, keyword, 4)
        if not sym["filler"] or int(sym["params"].get("value_len", 1)) != 1:
            raise ValueError(
                f"{keyword}: spreads pairs through filler, which a {sym['name']!r} task with these "
                "parameters has no room for (one-token values and filler symbols needed)"
            )
        cells = (length - 1 - len(sym["query"])) // 2
        if cells < max(pairs):
            raise ValueError(f"{keyword}: {length} tokens hold {cells} two-token cells, fewer than {max(pairs)} pairs")
    items = []
    for n in pairs:
        for sample in range(samples):
            rng = random.Random(f"kv-retrieval-arena:{seed}:{n}:{sample}")
            keys, values = rng.sample(sym["keys"], n), rng.sample(sym["values"], n)
            gold, rest = (keys[0], values[0]), list(zip(keys[1:], values[1:]))
            if length is not None:
                tokens = [rng.choice(sym["filler"]) for _ in range(length - 1 - len(sym["query"]))]
                where = [round(j * (cells - 1) / max(n - 1, 1)) for j in range(n)]
            for depth, index in _positions(n, depths):
                order = rest[:index] + [gold] + rest[index:]
                if length is None:
                    context, start = [t for pair in order for t in pair], 2 * index
                else:
                    context = list(tokens)
                    for c, pair in zip(where, order):
                        context[2 * c : 2 * c + 2] = pair
                    start = 2 * where[index]
                prompt = context + sym["query"] + [gold[0]]
                items.append(
                    Item(
                        [ids[t] for t in prompt],
                        gold[1],
                        {"gold": [(start, start + 2)]},
                        {"pairs": n, "position": index, "depth": depth, "sample": sample},
                        words=True,
                        extra={"key": gold[0]},
                        question=1 + len(sym["query"]),
                        answer_ids=[ids[gold[1]]],
                    )
                )
    return items
