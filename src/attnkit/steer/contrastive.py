"""HICD: contrastive decoding against hallucinations induced by dispersing the attention
of "inducing heads" (the reading lists' HICD paper: it "selects attention heads crucial
to the model's prediction as inducing heads, then induces hallucinations by dispersing
attention of these inducing heads and compares the hallucinated outputs with the
original outputs").

Each step scores the next token as in induce-then-contrast decoding:

    c = (1 + λ) · log p(x | prompt) − λ · log p_dispersed(x | prompt)

(the model's log-probabilities minus λ times those of the model with the inducing heads
dispersed, plus λ times its own, so λ = 0 is greedy decoding), over the plausible tokens
only: those with p ≥ ``plausibility`` × max p (the adaptive plausibility constraint of
contrastive decoding); greedy on c. Both models keep their own KV cache.

Head selection (``inducing_heads``): a head's score is the mean drop, over the prompts,
of the log-probability of the model's own greedy next token when that head alone is
dispersed; the top ``k`` are the inducing heads ("crucial to the model's prediction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .apply import apply
from .head_ops import disperse
from .targets import model_shape

Tensor = torch.Tensor


@dataclass
class Generation:
    """What ``contrastive_generate`` produced: new token ids and their decoded text."""

    ids: list[int]
    text: str


def _encode(tokenizer, prompt) -> Tensor:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("tokenizer: a text prompt needs the tokenizer")
        return torch.tensor([tokenizer(prompt)["input_ids"]])
    ids = torch.as_tensor(prompt)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.shape[1] == 0:
        raise ValueError(f"prompt: expected a string or one non-empty sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.long()


def contrastive_generate(
    model,
    tokenizer,
    prompt,
    heads,
    lam: float = 1.0,
    *,
    strength: float = 1.0,
    max_new_tokens: int = 16,
    plausibility: float = 0.1,
    eos_token_id: int | None = None,
) -> Generation:
    """Greedy HICD decoding of ``prompt`` (text, or token ids) with ``heads`` dispersed at
    ``strength`` in the contrast model (see the module docstring)."""
    from ..hf.switch import check_model, use

    check_model(model)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam: expected a finite number >= 0, got {lam!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if isinstance(plausibility, bool) or not isinstance(plausibility, (int, float)) or not 0 <= plausibility <= 1:
        raise ValueError(f"plausibility: expected a number in [0, 1], got {plausibility!r}")
    contrast = disperse(heads, strength)
    contrast.bind(model)  # heads and strength checked before anything runs
    ids = _encode(tokenizer, prompt)
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    import inspect

    from transformers import DynamicCache

    # transformers >= 5.2x renames past_key_values to cache
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    plain_cache, dispersed_cache = DynamicCache(), DynamicCache()
    new: list[int] = []
    step_ids = ids
    with torch.no_grad(), use(model):
        for _ in range(max_new_tokens):
            logits = model(step_ids, **{cache_arg: plain_cache}, use_cache=True).logits[0, -1].double()
            with apply(model, contrast):
                dispersed = model(step_ids, **{cache_arg: dispersed_cache}, use_cache=True).logits[0, -1].double()
            token = int(contrastive_choice(logits, dispersed, lam, plausibility))
            new.append(token)
            if eos_token_id is not None and token == eos_token_id:
                break
            step_ids = torch.tensor([[token]])
    text = tokenizer.decode(new) if tokenizer is not None else ""
    return Generation(new, text)


def contrastive_choice(logits: Tensor, dispersed: Tensor, lam: float, plausibility: float) -> Tensor:
    """argmax of (1 + λ) log p − λ log p_dispersed over tokens with p ≥ plausibility · max p."""
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(dispersed, -1)
    score = (1 + lam) * logp - lam * logq
    plausible = logp >= logp.max() + math.log(plausibility) if plausibility > 0 else torch.ones_like(logp, dtype=torch.bool)
    return torch.where(plausible, score, torch.tensor(-math.inf, dtype=score.dtype)).argmax()


def inducing_heads(model, prompts, k: int, *, strength: float = 1.0, attention_mask: Tensor | None = None) -> list[list[int]]:
    """HICD's head selection: the ``k`` heads whose dispersal (alone) most lowers the
    log-probability of the model's own greedy next token at the end of ``prompts``
    (input ids (B, N), right-aligned: the last column is each prompt's last token).
    Returns ``[[layer, head], ...]``, most inducing first."""
    from ..hf.switch import use

    layers, heads = model_shape(model)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= layers * heads:
        raise ValueError(f"k: expected an int in [1, {layers * heads}], got {k!r}")
    prompts = torch.as_tensor(prompts)
    if prompts.dim() != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prompts: expected token ids of shape (B, N), got {tuple(prompts.shape)}")
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    with torch.no_grad(), use(model):
        base = torch.log_softmax(model(prompts, **extra).logits[:, -1].double(), -1)
        target = base.argmax(-1, keepdim=True)
        plain = base.gather(-1, target).squeeze(-1)
        drops = []
        for layer in range(layers):
            for head in range(heads):
                with apply(model, disperse([(layer, head)], strength)):
                    lp = torch.log_softmax(model(prompts, **extra).logits[:, -1].double(), -1).gather(-1, target).squeeze(-1)
                drops.append((float((plain - lp).mean()), layer, head))
    drops.sort(key=lambda d: (-d[0], d[1], d[2]))
    return [[layer, head] for _, layer, head in drops[:k]]
