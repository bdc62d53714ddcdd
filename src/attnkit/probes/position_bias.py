"""The ``position-bias`` probe: does an embedding model reflect every part of a document
equally, whatever its position?

A permutation-based evaluation of reflection bias (as in the study of positional and
language biases of multi-segment document embeddings, whose authors trace the bias to
"front-loaded attention distributions in pooling-token embeddings"; PosIR, the
position-aware retrieval benchmark, reports the same primacy bias for most embedders):

1. split a document into segments (paragraphs or sentences);
2. for each of ``samples`` permutations of the segments, embed the permuted document
   and each segment alone, with the model's pooling (mean, CLS or last token);
3. record cos(segment, document) against the position the segment held;
4. in the same forward pass, measure the attention mass each segment's tokens receive
   from the rows the embedding is pooled from (all real tokens, weighted 1/n, for mean
   pooling; the first token for CLS; the last real token for last-token pooling), by
   position, per layer and averaged over layers and heads (attnkit meters, O(N)).

Permutations come in blocks of rotations of a random order: within a block of as many
samples as segments, every segment takes every position exactly once, so a segment's
content is not confounded with its position.

Only encoders are probed (``kind == "encoder"``); a causal model, arena exports
included, is refused with an error naming ``model``.

The default document is bundled (``data/position_bias.txt``): six paragraphs of one
essay written for attnkit (public domain, as the rest of its data), about 370 MiniLM
word pieces. One document matters: the probe asks how well the whole document's
embedding represents each of its parts, and unrelated paragraphs share so little that
their similarities hardly move with position (measured on all-MiniLM-L6-v2, mean
pooling, 12 permutations: first-minus-last gap 0.12 on this essay, 0.04 on six
unrelated classic openings).
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from importlib import resources

import torch

from ..validate import integer
from .model import as_probe_model
from .pooled_mass import PooledSpanMass
from .result import ProbeResult

Tensor = torch.Tensor

POOLINGS = ("mean", "cls", "last")
UNITS = ("paragraph", "sentence")
#: what joins segments back into a document, per unit
JOINERS = {"paragraph": "\n\n", "sentence": " "}


def default_text() -> str:
    """The bundled document (six paragraphs of one essay, about 370 MiniLM word pieces)."""
    return resources.files(__package__).joinpath("data/position_bias.txt").read_text(encoding="utf-8")


def split_segments(text: str, unit: str) -> list[str]:
    """Paragraphs (separated by blank lines) or sentences (ending in . ! or ?, then
    space), each with its whitespace collapsed to single spaces."""
    if unit == "paragraph":
        parts = re.split(r"\n[ \t]*\n", text)
    else:
        # a closing quote or bracket stays with the sentence it ends
        parts = re.split(r"(?<=[.!?][\"')\]])\s+|(?<=[.!?])\s+", " ".join(text.split()))
    return [" ".join(p.split()) for p in parts if p.strip()]


def permutations(segments: int, samples: int, rng: random.Random) -> list[list[int]]:
    """``samples`` orders of ``segments`` segments: blocks of the ``segments`` rotations of
    a random order (``perm[p]`` is the segment at position ``p``)."""
    out: list[list[int]] = []
    while len(out) < samples:
        base = list(range(segments))
        rng.shuffle(base)
        out += [base[r:] + base[:r] for r in range(segments)]
    return out[:samples]


# -- parameters -------------------------------------------------------------------------------


def _read_text(text) -> str:
    if text is None:
        return default_text()
    if not isinstance(text, (str, os.PathLike)) or not str(text):
        raise ValueError(f"text: expected the path of a UTF-8 text file, got {text!r}")
    path = str(text)
    if not os.path.isfile(path):
        raise ValueError(f"text: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"text: could not read {path} as UTF-8 text: {e}") from e


def _segments(text, segments, unit: str) -> list[str]:
    if segments is not None:
        if text is not None:
            raise ValueError("text: give a file or a list of segments, not both")
        if (
            isinstance(segments, str)
            or not isinstance(segments, (list, tuple))
            or not all(isinstance(s, str) and s.strip() for s in segments)
        ):
            raise ValueError(f"segments: expected a list of non-empty strings, got {segments!r}")
        found = [" ".join(s.split()) for s in segments]
        where = "segments"
    else:
        found = split_segments(_read_text(text), unit)
        where = "text"
    if len(found) < 2:
        raise ValueError(
            f"{where}: found {len(found)} {unit}(s); position bias needs at least 2 segments"
            + (" (paragraphs are separated by blank lines; try --unit sentence)" if unit == "paragraph" else "")
        )
    return found


# -- encoding -----------------------------------------------------------------------------------


def _encode(tokenizer, texts: list[str]):
    enc = tokenizer(texts, padding=True, return_tensors="pt", return_offsets_mapping=True, return_special_tokens_mask=True)
    offsets = enc.pop("offset_mapping")
    special = enc.pop("special_tokens_mask").bool()
    return dict(enc), offsets, special


def _key_segments(offsets: Tensor, special: Tensor, mask: Tensor, bounds: list[list[tuple[int, int]]]) -> Tensor:
    """(B, N): the segment each token's first character lies in (-1 for special tokens,
    padding and characters between segments)."""
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for b, ranges in enumerate(bounds):
        for i in range(mask.shape[1]):
            s, e = int(offsets[b, i, 0]), int(offsets[b, i, 1])
            if not mask[b, i] or special[b, i] or e <= s:
                continue
            for j, (lo, hi) in enumerate(ranges):
                if lo <= s < hi:
                    out[b, i] = j
                    break
    return out


def pooling_rows(mask: Tensor, pooling: str) -> Tensor:
    """(B, N) weight of each row in the pooled embedding: 1/n on the n real tokens
    (mean), 1 on token 0 (cls) or on the last real token (last)."""
    mask = mask.double()
    if pooling == "mean":
        return mask / mask.sum(-1, keepdim=True)
    rows = torch.zeros_like(mask)
    if pooling == "cls":
        rows[:, 0] = 1.0
    else:
        last = (mask * torch.arange(mask.shape[1], dtype=torch.float64)).argmax(-1)
        rows[torch.arange(mask.shape[0]), last] = 1.0
    return rows


def pool(hidden: Tensor, mask: Tensor, pooling: str) -> Tensor:
    """(B, D) embeddings from the last hidden states (not normalised: only cosines are read)."""
    rows = pooling_rows(mask, pooling).to(hidden.dtype)
    return torch.einsum("bn,bnd->bd", rows, hidden)


def _embed(model, enc: dict, pooling: str, observers=None) -> Tensor:
    from .. import hf

    with torch.no_grad(), hf.use(model, observers=observers):
        out = model(**enc)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return pool(hidden.double(), enc["attention_mask"], pooling)


# -- the probe ----------------------------------------------------------------------------------


def position_bias(
    model=None,
    tokenizer=None,
    *,
    text: str | os.PathLike | None = None,
    segments: list[str] | None = None,
    unit: str = "paragraph",
    samples: int = 12,
    pooling: str | None = None,
    seed: int = 0,
    progress=None,
    batch_size: int = 8,
) -> ProbeResult:
    """Position bias of an embedding model (see the module docstring).

    Args:
        text: a UTF-8 text file, the document (``--text``; default: the bundled one).
        segments: the document's segments as a list of strings (Python only; instead of
            ``text``).
        unit: "paragraph" (blank-line separated) or "sentence" (``--unit``).
        samples: permutations of the segments (``--samples``).
        pooling: "mean", "cls" or "last" (``--pooling``; default "mean", what
            all-MiniLM-L6-v2 uses).

    Rows: ``similarity`` at (position, sample, segment); ``attention_mass`` at (position)
    and at (position, layer): the mass the pooled rows put on the segment at that
    position, mean over samples, heads (and layers); ``token_share`` at (position): the
    mean share of the document's tokens the segment there holds (what uniform attention
    would give it); ``first_last_gap``: mean similarity at the first position minus the
    last. ``meta["permutations"]``, ``meta["segments"]``: what was embedded."""
    started = time.perf_counter()
    pm = as_probe_model(model, tokenizer)
    if pm.task is not None:
        raise ValueError(
            f"model: the position-bias probe measures embedding models; {pm.name or 'this model'} is an "
            f"arena export (a causal model trained on the {pm.task.get('task')!r} task), which embeds no text"
        )
    pm.require("encoder", "position-bias")
    if unit not in UNITS:
        raise ValueError(f"unit: expected one of {', '.join(UNITS)}, got {unit!r}")
    pooling = "mean" if pooling is None else pooling
    if pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
    samples = integer(samples, "samples", 1, "the number of permutations")
    batch_size = integer(batch_size, "batch_size", 1, "documents per forward pass")
    seed = integer(seed, "seed", None)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable taking a line of text, got {type(progress).__name__}")
    if not getattr(pm.tokenizer, "is_fast", False):
        raise ValueError("tokenizer: position-bias needs a fast tokenizer (one that returns character offsets)")
    parts = _segments(text, segments, unit)
    joiner = JOINERS[unit]
    orders = permutations(len(parts), samples, random.Random(seed))

    # The document in its own order: too long for the model is an error before anything runs
    # (permutations may tokenise a little differently; each batch is checked again below).
    pm.check_length(len(pm.tokenizer(joiner.join(parts))["input_ids"]), "text")

    # Each segment alone: its embedding does not depend on the permutation.
    embedded = []
    for lo in range(0, len(parts), batch_size):
        enc, _, _ = _encode(pm.tokenizer, parts[lo : lo + batch_size])
        pm.check_length(enc["input_ids"].shape[1], "text")
        embedded.append(_embed(pm.model, enc, pooling))
    alone = torch.cat(embedded)

    result = ProbeResult("position-bias")
    S = len(parts)
    mass_sum: Tensor | None = None
    share_sum = torch.zeros(S, dtype=torch.float64)
    batches = list(range(0, samples, batch_size))
    for _step, lo in enumerate(batches):
        chunk = orders[lo : lo + batch_size]
        documents, bounds = [], []
        for order in chunk:
            pieces, ranges, at = [], [], 0
            for p, seg in enumerate(order):
                if p:
                    at += len(joiner)
                ranges.append((at, at + len(parts[seg])))
                at += len(parts[seg])
                pieces.append(parts[seg])
            documents.append(joiner.join(pieces))
            bounds.append(ranges)  # by position
        enc, offsets, special = _encode(pm.tokenizer, documents)
        pm.check_length(enc["input_ids"].shape[1], "text")
        mask = enc["attention_mask"]
        positions = _key_segments(offsets, special, mask, bounds)  # the position each key's segment holds
        missing = [p for b in range(len(chunk)) for p in range(S) if not bool((positions[b] == p).any())]
        if missing:
            raise ValueError(f"text: segment at position {missing[0]} has no tokens of its own after tokenisation")
        meter = PooledSpanMass(pooling_rows(mask, pooling), positions, S)
        docs = _embed(pm.model, enc, pooling, observers=[meter])
        for b, order in enumerate(chunk):
            sample = lo + b
            cos = torch.nn.functional.cosine_similarity(alone[order], docs[b : b + 1].expand(S, -1), dim=-1)
            for p, seg in enumerate(order):
                result.add("similarity", float(cos[p]), position=p, sample=sample, segment=seg)
            real = float(mask[b].sum())
            share_sum += torch.stack([(positions[b] == p).sum() for p in range(S)]).double() / real
        per = meter.per_example().mean(2).sum(0)  # (L, S): summed over the batch, mean over heads
        mass_sum = per if mass_sum is None else mass_sum + per
        if progress is not None:
            progress(f"position-bias: permutations {lo + len(chunk)}/{samples}")

    assert mass_sum is not None  # samples >= 1: at least one batch ran
    mass = mass_sum / samples  # (L, S)
    for p in range(S):
        result.add("attention_mass", float(mass[:, p].mean()), position=p)
        for layer in range(mass.shape[0]):
            result.add("attention_mass", float(mass[layer, p]), position=p, layer=layer)
        result.add("token_share", float(share_sum[p] / samples), position=p)
    gap = result.mean("similarity", position=0) - result.mean("similarity", position=S - 1)
    result.add("first_last_gap", gap)
    result.meta = {
        "model": pm.name,
        "params": {
            "text": None if text is None else str(text),
            "unit": unit,
            "samples": samples,
            "pooling": pooling,
            "seed": seed,
            "batch_size": batch_size,
        },
        "seconds": time.perf_counter() - started,
        "figures": [
            {
                "kind": "curve",
                "x": "position",
                "metric": "similarity",
                "series": None,
                "title": f"cos(segment, document) by the segment's position ({pooling} pooling)",
            },
            {
                "kind": "curve",
                "x": "position",
                "metric": ["attention_mass", "token_share"],
                "series": None,
                "title": "attention mass from the pooled rows onto each position's segment",
            },
        ],
        "segments": parts,
        "joiner": joiner,
        "permutations": orders,
        "first_last_gap": gap if not math.isnan(gap) else None,
    }
    return result
