"""Contrastive decoding against a visually-ablated run.

Visual contrastive decoding (VCD, Leng et al. 2023, arXiv 2311.16922) contrasts the
model's next-token distribution with that of a run on a distorted image, so tokens the
language prior alone would produce lose weight. Here the "amateur" is the same model
with the image tokens hidden from the decoder's attention (``steer.ablate_visual`` on
``heads``, all by default), so its distribution is the language prior given the text:

    c = (1 + λ) · log p(x | image, text) − λ · log p_ablated(x | text)

over the plausible tokens, p ≥ ``plausibility`` × max p (the adaptive plausibility
constraint), greedy on c; λ = 0 is greedy decoding. The amateur runs the whole sequence
so far at every step (no cache of its own), which is exact for every family (Qwen2-VL's
3-D positions included) and costs one extra forward per step.
"""

from __future__ import annotations

import math

import torch

from ..steer import ablate_visual, apply
from ..steer.contrastive import contrastive_choice
from .spans import image_spans

Tensor = torch.Tensor


def contrastive_generate(
    model, inputs, spans=None, lam: float = 1.0, *, heads="all", plausibility: float = 0.1, max_new_tokens: int = 16
) -> Tensor:
    """Greedy decoding of ``inputs`` (the processor's output) contrasted with the run whose
    ``heads`` cannot see the image (see the module docstring). Returns the sequences
    (B, N0 + new tokens), as ``generate`` does."""
    from transformers import LogitsProcessor, LogitsProcessorList

    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam: expected a finite number >= 0, got {lam!r}")
    if isinstance(plausibility, bool) or not isinstance(plausibility, (int, float)) or not 0 <= plausibility <= 1:
        raise ValueError(f"plausibility: expected a number in [0, 1], got {plausibility!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    spans = image_spans(model, inputs) if spans is None else spans
    amateur = ablate_visual(spans, heads)
    prompt = torch.as_tensor(inputs["input_ids"])
    n0 = prompt.shape[1]

    def extended(ids: Tensor) -> dict:
        grown = dict(inputs, input_ids=ids)
        extra = ids.shape[1] - n0
        for name in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
            if name in inputs and inputs[name] is not None:
                t = torch.as_tensor(inputs[name])
                fill = 1 if name == "attention_mask" else 0
                grown[name] = torch.cat([t, t.new_full((t.shape[0], extra), fill)], 1)
        return grown

    class Contrast(LogitsProcessor):
        def __call__(self, input_ids, scores):
            with torch.no_grad(), apply(model, amateur):
                ablated = model(**extended(input_ids), use_cache=False).logits[:, -1].double()
            out = torch.full_like(scores, -math.inf)
            for b in range(scores.shape[0]):
                out[b, int(contrastive_choice(scores[b].double(), ablated[b], float(lam), float(plausibility)))] = 0.0
            return out

    with torch.no_grad():
        return model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=LogitsProcessorList([Contrast()])
        )
