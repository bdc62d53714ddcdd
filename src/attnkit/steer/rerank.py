"""Re-ranking documents by the attention a causal LM pays them: no training, no scores
generated as text, one prefill of the documents.

``rerank(model, tokenizer, query, documents, method=...) -> (order, scores)``:

- ``"icr"`` — in-context re-ranking (Chen et al. 2024, arXiv 2410.02642). Per context
  token, the attention of the query tokens (mean over query rows, summed over layers and
  heads), minus the same for a content-free query ("N/A") in the same template, which
  removes the model's positional and sink biases. In each document, tokens whose
  calibrated score lies below mean - 2 sigma are dropped (outliers where the content-free
  query attends far more); a document's score is the sum of the rest. Both queries run
  against one prefill of the documents (each on a copy of the KV cache). ``order`` ranks
  the documents, most relevant first. ``calibrate=False`` gives the uncalibrated variant
  (raw query attention summed per document).
- ``"sorting"`` — attention sorting (Peysakhovich & Lerer 2023, arXiv 2310.01427): one
  decoding step (the row of the query's last token, which produces the first answer
  token), documents sorted by the attention they receive with the highest *last*
  (nearest the question), and again on the sorted context, ``rounds`` times or until the
  order stops changing. ``order`` is the final arrangement of the context.
- ``"basin"`` — attention-basin re-ordering (AttnRank, "attention basin": models attend
  most to the first and last items of a list): the ICR ranking placed so that the most
  relevant document goes first, the second last, the third second, the fourth second to
  last, and so on inward (or into ``positions``, slots ordered from most to least
  attended, as ``slot_attention`` measures them for a model on a calibration set). ``order``
  is that arrangement.

``scores`` holds one float per document, in the input order (ICR scores for icr and
basin; for sorting, the attention each received in the last round measured).

The prompt is ``prefix``, the documents joined and followed by ``separator``, then
``query_template`` with the query: each piece tokenized on its own, so every document's
token span is exact and the context's tokens are the same for every query. Only query
rows are computed against the cached keys (Nq x Nk), never the N x N matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch

from .query_rows import prefill, query_key_mass

Tensor = torch.Tensor
T = TypeVar("T")

METHODS = ("icr", "sorting", "basin")


# -- prompts ----------------------------------------------------------------------------------


def encode(tokenizer, text: str, argument: str = "text") -> list[int]:
    """Token ids of ``text`` without special tokens; an error naming ``argument`` when the
    tokenizer cannot encode it (a word-level vocabulary without an unknown token)."""
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(f"{argument}: the tokenizer cannot encode {text!r} ({e})") from None


def leading_special_tokens(tokenizer) -> list[int]:
    """The BOS token when the tokenizer puts one before any text (as Llama's does), else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if not isinstance(bos, int):
        return []
    return [bos] if list(tokenizer("")["input_ids"])[:1] == [bos] else []


def build_context(
    tokenizer, documents: Sequence[str], prefix: str = "", separator: str = "\n\n"
) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids of the context, (start, end) token span of each document). The context
    is ``[BOS] prefix doc_1 separator doc_2 ... doc_n separator``."""
    ids = leading_special_tokens(tokenizer) + (encode(tokenizer, prefix, "prefix") if prefix else [])
    sep = encode(tokenizer, separator, "separator") if separator else []
    spans = []
    for i, doc in enumerate(documents):
        tokens = encode(tokenizer, doc, "documents")
        if not tokens:
            raise ValueError(f"documents: document {i} ({doc!r}) has no tokens")
        spans.append((len(ids), len(ids) + len(tokens)))
        ids += tokens + sep
    return ids, spans


# -- checks -----------------------------------------------------------------------------------


def _check(query, documents, method, rounds, calibration, query_template, positions):
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"query: expected a non-empty string, got {query!r}")
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise ValueError(f"documents: expected a list of strings, got {type(documents).__name__}")
    if len(documents) == 0:
        raise ValueError("documents: expected at least one document, got an empty list")
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc.strip():
            raise ValueError(f"documents: document {i} must be a non-empty string, got {doc!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    if not isinstance(calibration, str) or not calibration.strip():
        raise ValueError(f"calibration: expected a non-empty content-free query such as 'N/A', got {calibration!r}")
    if not isinstance(query_template, str) or "{query}" not in query_template:
        raise ValueError(f"query_template: expected a string containing {{query}}, got {query_template!r}")
    if positions is not None:
        if sorted(positions) != list(range(len(documents))) or any(isinstance(p, bool) for p in positions):
            raise ValueError(
                f"positions: expected a permutation of 0..{len(documents) - 1} (slots from most to least "
                f"attended), got {positions!r}"
            )


def _causal(model, tokenizer):
    from ..hf.switch import check_model
    from ..probes import as_probe_model

    pm = as_probe_model(model, tokenizer)
    check_model(pm.model)  # a model attnkit cannot switch fails here, before any pass
    if pm.kind != "causal":
        raise ValueError(
            f"model: re-ranking reads a causal language model's attention over a KV cache; "
            f"{pm.name or 'the model'} is an {pm.kind}"
        )
    return pm


# -- scores -----------------------------------------------------------------------------------


def icr_document_scores(real: Tensor, calib: Tensor | None, spans) -> list[float]:
    """Per document: ICR's masked calibrated sum (``calib`` given) or the raw sum of the
    per-token query attention ``real`` over the document's tokens."""
    scores = []
    for a, b in spans:
        if calib is None:
            scores.append(float(real[a:b].sum()))
            continue
        c = real[a:b] - calib[a:b]
        spread = c.std() if len(c) > 1 else c.new_zeros(())
        # >= keeps every token of a document whose tokens all score alike (a strict > would drop them all)
        keep = c >= c.mean() - 2 * spread
        scores.append(float((c * keep).sum()))
    return scores


def ranking(scores: Sequence[float]) -> list[int]:
    """Document indices by descending score (ties keep the input order)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def basin_slots(n: int) -> list[int]:
    """Context slots from most to least attended under the attention basin: first, last,
    second, second to last, ... inward."""
    lo, hi, out = 0, n - 1, []
    while lo <= hi:
        out.append(lo)
        if hi != lo:
            out.append(hi)
        lo, hi = lo + 1, hi - 1
    return out


def basin_order(ranked: Sequence[T], positions: Sequence[int] | None = None) -> list[T]:
    """The arrangement that puts ``ranked[r]`` (r-th most relevant) in the r-th most
    attended slot (``positions``, default ``basin_slots``)."""
    slots = list(positions) if positions is not None else basin_slots(len(ranked))
    out: list[T | None] = [None] * len(ranked)
    for doc, slot in zip(ranked, slots):
        out[slot] = doc
    return cast("list[T]", out)  # every slot filled: the slots are a permutation of 0..n-1


def slot_attention(
    model,
    tokenizer,
    examples: Sequence[tuple[str, Sequence[str]]],
    *,
    prefix: str = "",
    separator: str = "\n\n",
    query_template: str = "{query}",
    layers=None,
    heads=None,
) -> list[float]:
    """A model's positional attention preference, AttnRank's calibration step: over
    ``examples`` (``(query, documents)`` pairs, every one with the same number of
    documents), the mean attention the document in each slot receives from the query
    rows (ICR's uncalibrated per-document score). ``basin_slots_from(slot_attention(...))``
    gives ``positions`` for ``rerank(method="basin")`` measured for this model rather
    than assumed."""
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence) or not examples:
        raise ValueError("examples: expected a non-empty list of (query, documents) pairs")
    pm = _causal(model, tokenizer)
    _check_indices(pm, layers, heads)
    totals: list[float] | None = None
    for i, example in enumerate(examples):
        if not isinstance(example, (tuple, list)) or len(example) != 2:
            raise ValueError(f"examples: example {i} must be a (query, documents) pair")
        query, documents = example
        _check(query, documents, "icr", 1, "N/A", query_template, None)
        if totals is not None and len(documents) != len(totals):
            raise ValueError(
                f"examples: example {i} has {len(documents)} documents, the first has {len(totals)}; "
                "slots are compared across examples with the same number of documents"
            )
        _, scores = _icr(
            pm,
            query,
            documents,
            prefix=prefix,
            separator=separator,
            query_template=query_template,
            calibration="N/A",
            calibrate=False,
            layers=layers,
            heads=heads,
        )
        totals = scores if totals is None else [a + b for a, b in zip(totals, scores)]
    assert totals is not None  # examples is non-empty (checked above)
    return [t / len(examples) for t in totals]


def basin_slots_from(attention: Sequence[float]) -> list[int]:
    """Slots from most to least attended (ties: earlier slot first)."""
    return ranking(attention)


# -- the methods ------------------------------------------------------------------------------


def _check_indices(pm, layers, heads) -> None:
    from .targets import model_shape

    n_layers, n_heads = model_shape(pm.model)
    for name, values, limit in (("layers", layers, n_layers), ("heads", heads, n_heads)):
        if values is None:
            continue
        items = [values] if isinstance(values, int) else values
        if (
            isinstance(items, (str, bytes))
            or not isinstance(items, Sequence)
            or not items
            or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < limit for v in items)
        ):
            raise ValueError(f"{name}: expected None or a non-empty list of indices below {limit}, got {values!r}")


def _tokens(tokenizer, text: str, argument: str) -> list[int]:
    ids = encode(tokenizer, text, argument)
    if not ids:
        raise ValueError(f"{argument}: {text!r} has no tokens")
    return ids


def _check_length(pm, n: int) -> None:
    if pm.max_positions is not None and n > pm.max_positions:
        raise ValueError(
            f"documents: the prompt (documents and query) has {n} tokens, more than the {pm.max_positions} "
            f"positions {pm.name or 'the model'} reads; re-rank fewer or shorter documents"
        )


def _icr(pm, query, documents, *, prefix, separator, query_template, calibration, calibrate, layers, heads):
    model, tokenizer = pm.model, pm.tokenizer
    ids, spans = build_context(tokenizer, documents, prefix, separator)
    q_ids = _tokens(tokenizer, query_template.format(query=query), "query")
    _check_length(pm, len(ids) + len(q_ids))
    cache = prefill(model, ids)
    calib = None
    if calibrate:
        na_ids = _tokens(tokenizer, query_template.format(query=calibration), "calibration")
        calib = query_key_mass(model, cache, len(ids), na_ids, layers=layers, heads=heads)
    real = query_key_mass(model, cache, len(ids), q_ids, layers=layers, heads=heads, keep_cache=True)
    scores = icr_document_scores(real, calib, spans)
    return ranking(scores), scores


def _sorting(pm, query, documents, *, prefix, separator, query_template, rounds, layers, heads):
    model, tokenizer = pm.model, pm.tokenizer
    q_ids = _tokens(tokenizer, query_template.format(query=query), "query")
    arrangement = list(range(len(documents)))
    received = [0.0] * len(documents)
    for _ in range(rounds):
        ids, spans = build_context(tokenizer, [documents[i] for i in arrangement], prefix, separator)
        _check_length(pm, len(ids) + len(q_ids))
        mass = query_key_mass(
            model, prefill(model, ids), len(ids), q_ids, layers=layers, heads=heads, last_only=True, keep_cache=True
        )
        for doc, (a, b) in zip(arrangement, spans):
            received[doc] = float(mass[a:b].sum())
        # ascending and stable: the most attended document goes last, nearest the question
        new = sorted(arrangement, key=lambda doc: received[doc])
        if new == arrangement:
            break
        arrangement = new
    return arrangement, received


def rerank(
    model,
    tokenizer,
    query: str,
    documents: Sequence[str],
    method: str = "icr",
    *,
    prefix: str = "",
    separator: str = "\n\n",
    query_template: str = "{query}",
    calibration: str = "N/A",
    calibrate: bool = True,
    rounds: int = 2,
    positions: Sequence[int] | None = None,
    layers=None,
    heads=None,
) -> tuple[list[int], list[float]]:
    """Re-rank ``documents`` for ``query`` by a causal LM's attention; see the module
    docstring for the three methods.

    Args:
        model: a transformers causal LM (or a model directory), switched to attnkit for
            the passes and restored after.
        tokenizer: its tokenizer (None when ``model`` is a directory).
        query: the question; ``query_template`` (containing ``{query}``) wraps it, and the
            content-free ``calibration`` query in the same way.
        documents: the texts to re-rank (non-empty strings).
        method: "icr", "sorting" or "basin".
        prefix, separator: the prompt before the documents, and what follows each one.
        calibrate: icr/basin: subtract the content-free query's attention (ICR proper).
        rounds: sorting: how many times to measure and re-sort.
        positions: basin: context slots from most to least attended (default: first,
            last, second, second to last, ...).
        layers, heads: restrict the attention summed to these layer / head indices.

    Returns:
        ``(order, scores)``: document indices (icr: most relevant first; sorting and basin:
        the context arrangement, first slot first) and one float per input document.
    """
    _check(query, documents, method, rounds, calibration, query_template, positions)
    pm = _causal(model, tokenizer)
    _check_indices(pm, layers, heads)
    common = dict(prefix=prefix, separator=separator, query_template=query_template, layers=layers, heads=heads)
    if method == "sorting":
        return _sorting(pm, query, documents, rounds=rounds, **common)
    ranked, scores = _icr(pm, query, documents, calibration=calibration, calibrate=calibrate, **common)
    if method == "basin":
        return basin_order(ranked, positions), scores
    return ranked, scores
