"""Greedy generation through attnkit's kernels, with observers on every attention call.

Probes need behaviour and attention from the same run: the prompt is prefilled once,
then each new token is one cached decoding call. All of it runs under ``attnkit.hf.use``,
so the observers (meters on the answer's query rows, top keys for retrieval scores) see
the prefill and every decoding step tile by tile, in O(N) memory.

Prompts of a batch are left-padded, so every prompt ends at the same position ``P - 1``
and the rows that produce the answer are positions ``P - 1`` onwards in every row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


@dataclass
class Prompts:
    """A left-padded batch: ``input_ids`` and ``attention_mask`` (B, P), and ``pads``,
    the padding each row got (a token at index i of prompt b sits at ``pads[b] + i``)."""

    input_ids: Tensor
    attention_mask: Tensor
    pads: list[int]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class Generation:
    """What ``greedy_generate`` produced: the ``prompts``, the new ``tokens`` (B, T)
    (``pad_id`` after a row's end-of-sequence token) and their ``texts``."""

    prompts: Prompts
    tokens: Tensor
    texts: list[str]
    #: per batch row, the tokens it generated up to and including its end-of-sequence
    #: token: its answer's query rows (the last prompt row and steps - 1 decoding rows)
    steps: list[int] = field(default_factory=list)


def pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def left_pad(sequences: list[list[int]], pad: int) -> Prompts:
    """Token id lists -> a left-padded batch."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("prompts: expected a non-empty list of non-empty token sequences")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    pads = []
    for b, seq in enumerate(sequences):
        ids[b, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[b, width - len(seq) :] = 1
        pads.append(width - len(seq))
    return Prompts(ids, mask, pads)


def _forward_kwargs(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def greedy_generate(
    model, tokenizer, prompts, max_new_tokens: int, *, observers=None, mechanism="softmax", stop_at_eos: bool = True
) -> Generation:
    """Greedy decoding of ``prompts`` (a list of token-id lists, or a ``Prompts`` batch)
    through attnkit, observed by ``observers``; one prefill per batch, then one cached call
    per token. Stops early once every row has produced the end-of-sequence token."""
    from .. import hf

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    pad = pad_id(tokenizer)
    batch = prompts if isinstance(prompts, Prompts) else left_pad(prompts, pad)
    eos = getattr(tokenizer, "eos_token_id", None) if stop_at_eos else None
    accepted = _forward_kwargs(model)
    cache_arg = "cache" if "cache" in accepted else "past_key_values"
    mask = batch.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    kwargs = {"input_ids": batch.input_ids, "attention_mask": mask, "use_cache": True}
    if "position_ids" in accepted:
        kwargs["position_ids"] = positions
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1  # the (P x vocab) logits of the prompt are never read
    produced, done = [], torch.zeros(len(batch.pads), dtype=torch.bool)
    with torch.no_grad(), hf.use(model, mechanism=mechanism, observers=observers):
        out = model(**kwargs)
        for step in range(max_new_tokens):
            token = out.logits[:, -1].argmax(-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            produced.append(token)
            if eos is not None:
                done |= token == eos
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            # a finished row is still decoded with its batch; meters that can, stop counting it
            for observer in observers or ():
                if hasattr(observer, "set_active"):
                    observer.set_active(~done)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            kwargs = {"input_ids": token[:, None], "attention_mask": mask, "use_cache": True, cache_arg: _cache_of(out)}
            if "position_ids" in accepted:
                kwargs["position_ids"] = positions
            out = model(**kwargs)
    tokens = torch.stack(produced, dim=1)
    rows = tokens.tolist()
    texts = [decode(tokenizer, row, eos) for row in rows]
    steps = [row.index(eos) + 1 if eos is not None and eos in row else len(row) for row in rows]
    return Generation(batch, tokens, texts, steps)


def _cache_of(out):
    """The KV cache a forward returned (transformers >= 5.25 names it ``cache`` and warns
    on the older ``past_key_values``)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def decode(tokenizer, ids: list[int], eos: int | None = None) -> str:
    """Text of generated ids, cut at the first end-of-sequence token."""
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)
