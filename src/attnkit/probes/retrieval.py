"""What the retrieval probes (needle, kv-retrieval, interference) share: checking their
parameters with errors that name the Python keyword (``attnkit.validate``), and running prompts in batches —
greedy answers scored by RULER's string match (arXiv 2404.06654), and from the same
run the attention mass that the answer's query rows put on named spans of each prompt.

A prompt is an ``Item``: token ids, the expected answer, named spans (each a list of
(start, end) token ranges whose masses add up, e.g. a needle, or every stale value of
a key) and the parameters that locate it in the probe's grid. Items with the same span
layout and lengths within 1/8 of each other share batches (left-padded; a grid of
distinct lengths never pads), and each prompt is prefilled once.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import cast

import torch

from ..validate import integer
from .generation import greedy_generate, left_pad, pad_id
from .meters import RowSpanMass
from .scoring import string_match_all

# -- parameters ---------------------------------------------------------------------------


def check_ints(values, name: str, low: int = 1) -> list[int]:
    """A non-empty list of distinct ints >= ``low`` (a single int is a list of one)."""
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}: expected a list of ints >= {low}, got {values!r}")
    out = [integer(v, name, low) for v in values]
    if not out:
        raise ValueError(f"{name}: expected at least one value")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: values repeat in {out}")
    return out


def check_fractions(values, name: str) -> list[float]:
    """A non-empty list of distinct fractions in [0, 1] (percentages are refused: 50 is
    an error, 0.5 is half way)."""
    if isinstance(values, numbers.Real) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name}: expected a list of fractions in [0, 1], got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"{name}: expected fractions in [0, 1] (0 = start, 1 = end), got {v!r}")
        out.append(float(v))
    if not out:
        raise ValueError(f"{name}: expected at least one value")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: values repeat in {out}")
    return out


def check_text(value, name: str, needs=(), allowed=("key", "value")) -> str:
    """A non-empty template whose ``{placeholders}`` are among ``allowed`` and include ``needs``."""
    import string

    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: expected non-empty text, got {value!r}")
    try:
        names = {field for _, field, _, _ in string.Formatter().parse(value) if field is not None}
    except ValueError as e:
        raise ValueError(f"{name}: not a valid template ({e}); write literal braces as {{{{ and }}}}") from e
    unknown = sorted(n for n in names if n not in allowed)
    if unknown:
        raise ValueError(
            f"{name}: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
            f"allowed: {', '.join('{' + n + '}' for n in allowed)}"
        )
    missing = [n for n in needs if n not in names]
    if missing:
        raise ValueError(f"{name}: the text must contain {', '.join('{' + n + '}' for n in missing)}")
    return value


def check_progress(progress):
    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable taking a line of text, or None, got {type(progress).__name__}")
    return progress or (lambda line: None)


def check_run(model, tokenizer, probe: str, samples, seed, batch_size, progress, max_new_tokens):
    """What every generative probe checks first: (probe model, samples, seed, batch size,
    progress callable, max_new_tokens or None), each bad value an error naming its keyword."""
    from .model import as_probe_model

    pm = as_probe_model(model, tokenizer)
    pm.require("causal", probe)
    samples = integer(samples, "samples", 1)
    seed = integer(seed, "seed", None)
    batch_size = integer(batch_size, "batch_size", 1)
    say = check_progress(progress)
    if max_new_tokens is not None:
        max_new_tokens = integer(max_new_tokens, "max_new_tokens", 1)
    return pm, samples, seed, batch_size, say, max_new_tokens


def check_kv(kv):
    """None, a ``KVSetting``, or its text (``snapkv:budget=0.25:protocol=aware``) -> a KVSetting or None."""
    if kv is None:
        return None
    from ..kv.protocol import KVSetting

    if isinstance(kv, KVSetting):
        return kv
    if isinstance(kv, str):
        try:
            return KVSetting.parse(kv)
        except ValueError as e:
            raise ValueError(f"kv: {e}") from None
    raise ValueError(
        f"kv: expected POLICY[:budget=F][:protocol=agnostic|aware][:NAME=VALUE ...] or a KVSetting, got {type(kv).__name__}"
    )


def kv_params(kv) -> dict:
    """A KV setting as the probe's recorded parameters."""
    return {"policy": kv.policy, "budget": kv.budget, "protocol": kv.protocol, "params": dict(kv.params)}


def check_max_positions(pm, length: int, new_tokens: int, name: str = "lengths") -> None:
    """A prompt longer than the model's positions (with the rows its answer needs) is an error naming ``name``."""
    pm.check_length(length, name)
    if pm.max_positions is not None and length + new_tokens - 1 > pm.max_positions:
        raise ValueError(
            f"{name}: a prompt of {length} tokens and the {new_tokens - 1} more its answer needs exceed "
            f"the {pm.max_positions} positions {pm.name or 'the model'} reads"
        )


# -- arena exports --------------------------------------------------------------------------


def arena_symbols(pm, probe: str) -> dict:
    """The key-value symbols of an arena export's task (needle or mqar): ``ids`` (symbol ->
    id), ``keys``, ``values``, ``filler`` (a list, maybe empty), ``query`` (the symbols
    that come before the asked key: ``["Q"]`` for needle, none for mqar) and ``name``; a
    task without keys and values is an error naming ``model``."""
    task = pm.task or {}
    symbols = task.get("symbols") or {}
    roles, tokens = symbols.get("roles") or {}, symbols.get("tokens") or []
    name = task.get("task")
    if name not in ("needle", "mqar") or not roles.get("keys") or not roles.get("values"):
        raise ValueError(
            f"model: the {probe} probe on an arena export needs a key-value task (needle or mqar); "
            f"{pm.name or 'this model'} was trained on {name!r}"
        )
    query = [roles["query"]] if isinstance(roles.get("query"), str) else []
    filler = list(roles.get("filler") or ([roles["blank"]] if isinstance(roles.get("blank"), str) else []))
    return {
        "ids": {t: i for i, t in enumerate(tokens)},
        "keys": list(roles["keys"]),
        "values": list(roles["values"]),
        "filler": filler,
        "query": query,
        "name": name,
        "params": task.get("params") or {},
    }


# -- running --------------------------------------------------------------------------------


@dataclass
class Item:
    """One prompt: ``ids``, the ``answer`` text, named ``spans`` (name -> list of (start,
    end) ranges, masses summed), the grid ``params`` (length, depth, sample ...), and
    ``words``: score the answer as a whole whitespace-separated word (arena symbols,
    where "v1" must not match inside "v12"). ``question``: how many of the last tokens
    are the question (asked again through a compressed cache under a KV policy, see
    ``attnkit.kv.protocol``); ``answer_ids``: the answer's tokens, for scoring token by
    token (None: the answer text's own tokens)."""

    ids: list[int]
    answer: str
    spans: dict[str, list[tuple[int, int]]]
    params: dict
    words: bool = False
    extra: dict = field(default_factory=dict)
    question: int = 0
    answer_ids: list[int] | None = None


@dataclass
class Outcome:
    """What one prompt gave: the generated ``output`` text, its ``score`` (0..1), and per
    span name the (layers, heads) ``mass`` of the answer's rows and the ``uniform`` mass
    a head spreading evenly over the visible keys would put there."""

    item: Item
    output: str
    score: float
    mass: dict[str, torch.Tensor]
    uniform: dict[str, float]
    #: the generated token ids (up to and including an end-of-sequence token)
    tokens: list[int] = field(default_factory=list)
    #: teacher-forced (``run_items(..., forced=True)``): the answer's mean negative log-likelihood
    nll: float | None = None

    def token_accuracy(self) -> float:
        """The share of the answer's tokens generated right, position by position."""
        want = self.item.answer_ids or []
        return sum(a == b for a, b in zip(self.tokens, want)) / len(want) if want else float(self.score)


def score(output: str, answer: str, words: bool) -> float:
    if words:  # whole symbols: pad with spaces so a match cannot start or end inside a word
        return string_match_all(f" {' '.join(output.split())} ", [f" {answer} "])
    return string_match_all(output, [answer])


def _layout(item: Item, forced: bool = False) -> tuple:
    answer = len(item.answer_ids or ()) if forced else 0  # teacher forcing: a batch shares the answer's length
    return (item.question, answer, *((name, len(ranges)) for name, ranges in item.spans.items()))


def run_items(
    pm, items: list[Item], max_new_tokens: int, batch_size: int, progress, label: str, kv=None, stats=None, forced: bool = False
):
    """Generate an answer for every item and measure its span masses: items with the same
    span layout and near-equal lengths share batches, left-padded to the longest of their
    batch (one prefill per prompt). Returns (outcomes in item order, layer labels).

    ``kv`` (an ``attnkit.kv.protocol.KVSetting``): answer through a compressed cache
    instead, by the setting's protocol (the question asked after the compression); no
    span masses are measured then (a policy's cache no longer holds every position), and
    ``stats`` (a list) receives each batch's ``Answer`` (bytes held, decoding time).
    ``forced`` (with ``kv``): feed each item's ``answer_ids`` instead of decoding greedily
    and record the answer's negative log-likelihood (``Outcome.nll``)."""
    if forced and (kv is None or any(not it.answer_ids for it in items)):
        raise ValueError(f"kv: teacher forcing needs a KV setting and every {label} prompt's answer tokens")
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(_layout(item, forced), []).append(i)
    batches = []
    for idx in groups.values():
        batch: list = []
        for i in sorted(idx, key=lambda i: len(items[i].ids)):
            # A new batch when this one is full or the prompt is over 1/8 longer than the
            # batch's shortest: grids of distinct lengths never pad, near-equal ones share.
            if batch and (len(batch) == batch_size or 8 * len(items[i].ids) > 9 * len(items[batch[0]].ids)):
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
    outcomes: list = [None] * len(items)
    layers = None
    for n, batch in enumerate(batches, 1):
        chosen = [items[i] for i in batch]
        prompts = left_pad([item.ids for item in chosen], pad_id(pm.tokenizer))
        width = prompts.length
        progress(f"{label}: batch {n}/{len(batches)} ({len(chosen)} prompts of up to {width} tokens)")
        if kv is not None:
            from ..kv.protocol import ask

            if chosen[0].question < 1:
                raise ValueError(
                    f"kv: the {label} probe's prompts do not mark their question, so they cannot be asked "
                    "through a compressed cache"
                )
            gold = torch.tensor([item.answer_ids for item in chosen]) if forced else None
            answer = ask(
                pm.model,
                prompts.input_ids,
                prompts.attention_mask,
                chosen[0].question,
                kv,
                max_new_tokens if gold is None else gold.shape[1],
                forced=gold,
            )
            if stats is not None:
                stats.append(answer)
            for b, (i, item) in enumerate(zip(batch, chosen)):
                tokens = answer.tokens[b].tolist()
                output = _decoded(pm, tokens)
                nll = None if answer.nll is None else float(answer.nll[b])
                outcomes[i] = Outcome(item, output, score(output, item.answer, item.words), {}, {}, tokens, nll)
            continue
        flat = {
            f"{name}#{j}": [
                (s + pad, e + pad) for (s, e), pad in ((item.spans[name][j], p) for item, p in zip(chosen, prompts.pads))
            ]
            for name, ranges in chosen[0].spans.items()
            for j in range(len(ranges))
        }
        meter = RowSpanMass(flat, q_lo=width - 1)
        gen = greedy_generate(pm.model, pm.tokenizer, prompts, max_new_tokens, observers=[meter])
        layers = meter.layers_seen
        per_name = {key: meter.per_example(key) for key in flat}  # (B, L, H)
        for b, (i, item) in enumerate(zip(batch, chosen)):
            rows = gen.steps[b]  # answer rows observed: the last prompt row and rows - 1 generated
            length = len(item.ids)  # a row at offset r past the prompt's end sees length + r keys
            visible = sum(1.0 / (length + r) for r in range(rows)) / rows
            mass: dict[str, torch.Tensor] = {}
            uniform: dict[str, float] = {}
            for name, ranges in item.spans.items():
                # a span has at least one range (probes leave empty ones out), so the sum is a tensor
                mass[name] = cast(torch.Tensor, sum(per_name[f"{name}#{j}"][b] for j in range(len(ranges))))
                uniform[name] = sum(e - s for s, e in ranges) * visible
            tokens = gen.tokens[b, : gen.steps[b]].tolist()
            output = gen.texts[b] if pm.task is None else _decoded(pm, tokens)
            outcomes[i] = Outcome(item, output, score(output, item.answer, item.words), mass, uniform, tokens)
    return outcomes, layers


def _decoded(pm, tokens: list[int]) -> str:
    """The answer's text. An arena export pads with one of its own symbols (the filler),
    which skip_special_tokens would drop from the answer: every symbol generated is read."""
    if pm.task is not None:
        return pm.tokenizer.decode(tokens, skip_special_tokens=False)
    from .generation import decode

    return decode(pm.tokenizer, tokens, getattr(pm.tokenizer, "eos_token_id", None))


def add_mass_rows(result, outcomes: list[Outcome], layers, keys: tuple[str, ...], name: str, prefix: str) -> None:
    """Rows of span ``name``'s mass averaged over the outcomes sharing each value of
    ``keys``: ``<prefix>`` per (cell, layer, head), ``<prefix>_max`` (the best head) and
    ``<prefix>_uniform`` (the even-spread share) per cell."""
    cells: dict = {}
    for o in outcomes:
        cells.setdefault(tuple(o.item.params[k] for k in keys), []).append(o)
    for cell, group in cells.items():
        where = dict(zip(keys, cell))
        mean = torch.stack([o.mass[name] for o in group]).mean(0)  # (L, H)
        for li, layer in enumerate(layers):
            for h in range(mean.shape[1]):
                result.add(prefix, float(mean[li, h]), **where, layer=layer, head=h)
        result.add(f"{prefix}_max", float(mean.max()), **where)
        result.add(f"{prefix}_uniform", sum(o.uniform[name] for o in group) / len(group), **where)


def add_accuracy_rows(result, outcomes: list[Outcome], keys: tuple[str, ...], metric: str = "accuracy") -> None:
    cells: dict = {}
    for o in outcomes:
        cells.setdefault(tuple(o.item.params[k] for k in keys), []).append(o.score)
    for cell, scores in cells.items():
        result.add(metric, sum(scores) / len(scores), **dict(zip(keys, cell)))


def examples(outcomes: list[Outcome], limit: int = 200) -> list[dict]:
    """Per prompt, what was asked and answered (meta["examples"], for reading failures)."""
    return [
        {
            **o.item.params,
            "answer": o.item.answer,
            "output": o.output[:limit],
            "score": o.score,
            **({k: v for k, v in o.item.extra.items()}),
        }
        for o in outcomes
    ]
