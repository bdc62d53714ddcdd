"""PASTA: post-hoc attention steering (Zhang et al. 2023, arXiv 2311.02262).

On the chosen heads, the weight of every key outside the emphasised spans is multiplied
by α and each row renormalised: ``A'[i, j] = α^[j ∉ spans] A[i, j] / Z_i``. Since
``A[i, j] ∝ exp(s_ij)``, this is ``s_ij + log α`` on keys outside the spans, which runs
inside the kernels as a per-(row, head, key) additive bias. As in PASTA's "exclude"
mode, every key outside the spans is scaled, generated tokens included.

Spans are token ranges ``(start, end)`` (end exclusive) of the input as the model sees
it (left padding included), the same for every batch row or one list per row, or
substrings of the prompt, mapped to tokens through the tokenizer's character offsets.
"""

from __future__ import annotations

import math

import torch

from .base import Intervention, softmax_rows
from .mods import KeyBias

Tensor = torch.Tensor


class Emphasize(Intervention):
    name = "emphasize"

    def __init__(self, spans, heads, alpha: float = 0.01, *, text=None, tokenizer=None, encoding=None):
        super().__init__(heads)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 < alpha <= 1.0) or not math.isfinite(alpha):
            raise ValueError(f"alpha: expected a number in (0, 1] (the weight kept outside the spans), got {alpha!r}")
        self.alpha = float(alpha)
        self.rows = _token_spans(spans, text, tokenizer, encoding)  # None-batch: shared list; else one list per row
        self.shared = isinstance(self.rows, _Shared)

    def token_spans(self) -> list:
        """The spans as token ranges: one list for every row, or one list per batch row."""
        return list(self.rows.spans) if self.shared else [list(r) for r in self.rows]

    def spans_for(self, batch: int, k_len: int) -> list[list[tuple[int, int]]]:
        if self.shared:
            rows = [self.rows.spans] * batch
        else:
            if len(self.rows) != batch:
                raise ValueError(f"spans: given for {len(self.rows)} batch rows, but the call has a batch of {batch}")
            rows = self.rows
        for b, ranges in enumerate(rows):
            for start, end in ranges:
                if end > k_len:
                    raise ValueError(f"spans: ({start}, {end}) of batch row {b} lies outside the prompt of {k_len} tokens")
        return rows

    def inside(self, batch: int, k_len: int, device=None) -> Tensor:
        """(B, Nk) bool: keys inside an emphasised span."""
        inside = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
        for b, ranges in enumerate(self.spans_for(batch, k_len)):
            for start, end in ranges:
                inside[b, start:end] = True
        return inside

    def scores_for(self, layer, query, key, keep):
        flags = self.selected(layer, query.shape[1], query.device)
        if flags is None or self.alpha == 1.0:
            return []
        B, H, Nk = query.shape[0], query.shape[1], key.shape[2]
        outside = ~self.inside(B, Nk, query.device)
        on = flags.view(1, H, 1) & outside.view(B, 1, Nk)
        table = torch.where(
            on,
            torch.tensor(math.log(self.alpha), dtype=torch.float64, device=query.device),
            torch.zeros((), dtype=torch.float64, device=query.device),
        )
        return [KeyBias(table)]

    def reference(self, logits, values, layer):
        # PASTA's own statement: scale the weights outside the spans by α, renormalise.
        weights = softmax_rows(logits)
        B, H, _, Nk = weights.shape
        outside = ~self.inside(B, Nk)
        for h in self.heads.get(layer, ()):
            factor = torch.where(outside, torch.tensor(self.alpha, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
            w = weights[:, h] * factor.view(B, 1, Nk).to(weights.dtype)
            weights[:, h] = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        return weights @ values

    def __repr__(self):
        return f"emphasize({self.rows!r}, {self.heads_spec!r}, alpha={self.alpha:g})"


class _Shared:
    def __init__(self, spans):
        self.spans = spans

    def __repr__(self):
        return repr(self.spans)


def _token_spans(spans, text, tokenizer, encoding):
    """A ``_Shared`` list of ranges, or one list of ranges per batch row."""
    if isinstance(spans, (str, tuple)):
        spans = [spans]
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"spans: expected a non-empty list of (start, end) token ranges or substrings, got {spans!r}")
    per_row = all(isinstance(s, list) for s in spans)
    if not per_row and any(isinstance(s, list) for s in spans):
        raise ValueError("spans: mix of per-row lists and single spans; give one list per batch row, or one list for all rows")
    rows = spans if per_row else [spans]
    if any(isinstance(s, str) for row in rows for s in row):
        out = _substring_spans(rows, per_row, text, tokenizer, encoding)
        return out if per_row else _Shared(out[0])
    checked = [[_range(s) for s in row] for row in rows]
    for row in checked:
        if not row:
            raise ValueError("spans: a batch row has no span")
    return checked if per_row else _Shared(checked[0])


def _range(span) -> tuple[int, int]:
    if (
        isinstance(span, (tuple, list))
        and len(span) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
        and 0 <= span[0] < span[1]
    ):
        return int(span[0]), int(span[1])
    raise ValueError(f"spans: expected token ranges (start, end) with 0 <= start < end, or substrings, got {span!r}")


def _substring_spans(rows, per_row: bool, text, tokenizer, encoding) -> list[list[tuple[int, int]]]:
    if text is None:
        raise ValueError("text: substrings in spans need the prompt text (text=prompt or a list of prompts)")
    texts = [text] if isinstance(text, str) else list(text)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"text: expected a prompt string or a list of them, got {text!r}")
    if per_row and len(rows) != len(texts):
        raise ValueError(f"spans: {len(rows)} per-row lists for {len(texts)} prompts in text")
    if encoding is None:
        if tokenizer is None:
            raise ValueError(
                "tokenizer: substrings in spans need the tokenizer (or encoding=, the BatchEncoding with offset_mapping)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "tokenizer: mapping substrings to tokens needs a fast tokenizer (one that returns character offsets)"
            )
        encoding = tokenizer(texts, return_offsets_mapping=True, padding=True)
    offsets = encoding.get("offset_mapping") if hasattr(encoding, "get") else None
    if offsets is None:
        raise ValueError("encoding: expected the tokenizer's output with return_offsets_mapping=True")
    offsets = torch.as_tensor(offsets)
    if offsets.dim() == 2:
        offsets = offsets.unsqueeze(0)
    if offsets.shape[0] != len(texts):
        raise ValueError(f"encoding: has {offsets.shape[0]} rows for {len(texts)} prompts in text")
    out = []
    for b, prompt in enumerate(texts):
        row = rows[b] if per_row else rows[0]
        ranges = []
        for span in row:
            if not isinstance(span, str):
                ranges.append(_range(span))
                continue
            at = prompt.find(span) if span else -1
            if at < 0:
                raise ValueError(f"spans: substring {span!r} not found in prompt {b} of text")
            lo, hi = at, at + len(span)
            starts, ends = offsets[b, :, 0], offsets[b, :, 1]
            hit = ((ends > starts) & (starts < hi) & (ends > lo)).nonzero().view(-1)
            if hit.numel() == 0:
                raise ValueError(f"spans: substring {span!r} of prompt {b} covers no token (is it inside special tokens?)")
            ranges.append((int(hit[0]), int(hit[-1]) + 1))
        out.append(ranges)
    return out


def emphasize(spans, heads, alpha: float = 0.01, *, text=None, tokenizer=None, encoding=None) -> Emphasize:
    """PASTA: on ``heads``, weights of keys outside ``spans`` times ``alpha``, rows
    renormalised. ``spans``: token ranges ``(start, end)`` for every row, a list of them
    per batch row, or substrings of ``text`` (the prompt, or one per row) mapped through
    ``tokenizer``'s offsets (or ``encoding``, the BatchEncoding the model ran on, made
    with ``return_offsets_mapping=True``)."""
    return Emphasize(spans, heads, alpha, text=text, tokenizer=tokenizer, encoding=encoding)
