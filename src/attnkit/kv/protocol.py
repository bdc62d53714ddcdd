"""Asking a question of a compressed cache: the two protocols of KV-cache evaluation.

A policy compresses right after the prefill, so a one-token answer read off the prefill's
last logits never sees the compression. The evaluation therefore prefills a context,
compresses it, and then asks the question through the compressed cache, one decoding step
per question token, before the answer is generated greedily:

- ``agnostic`` (kvpress's query-agnostic setting): the context is prefilled without the
  question, so what the policy keeps cannot depend on what will be asked;
- ``aware``: the question is part of the prefill too (SnapKV's observation window sees
  it, arXiv 2404.14469), compressed with the context, and asked again after it.

The full cache (``policy="full"``) runs the same protocol with transformers'
``DynamicCache``, so a policy's loss is measured against the same sequence of calls.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

PROTOCOLS = ("agnostic", "aware")
#: the setting that keeps everything: transformers' DynamicCache
FULL = "full"


@dataclass(frozen=True)
class KVSetting:
    """A policy, its ``budget`` (a fraction of the context in (0, 1] or a token count),
    its parameters (``params``: sorted (name, value) pairs) and the ``protocol``."""

    policy: str
    budget: float | int = 0.5
    params: tuple = ()
    protocol: str = "agnostic"

    def __post_init__(self):
        from . import POLICIES
        from .budget import check_budget

        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.policy == FULL:
            if self.params:
                raise ValueError(f"{self.params[0][0]}: the full cache takes no parameters")
            return
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r}; expected {FULL} or one of {', '.join(POLICIES)}")
        if POLICIES[self.policy].needs_mechanism is not None:
            raise ValueError(
                f"policy: {self.policy!r} needs a model trained with the "
                f"{POLICIES[self.policy].needs_mechanism!r} mechanism; it is run from Python inside attnkit.hf.use"
            )
        check_budget(self.budget)
        POLICIES[self.policy](**dict(self.params))  # each bad parameter named

    @classmethod
    def parse(cls, text: str) -> KVSetting:
        """``POLICY[:budget=F][:protocol=P][:NAME=VALUE ...]``, e.g.
        ``snapkv:budget=0.25:window=8`` (a budget written as an int is a token count)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"kv: expected POLICY[:budget=F][:protocol=agnostic|aware][:NAME=VALUE ...], got {text!r}")
        policy, *parts = text.strip().split(":")
        budget, protocol, params = 0.5, "agnostic", {}
        for part in parts:
            name, sep, value = part.partition("=")
            if not sep or not name:
                raise ValueError(f"kv: expected NAME=VALUE after {policy!r}, got {part!r} (in {text!r})")
            if name == "budget":
                budget = parameter_value(value)
            elif name == "protocol":
                protocol = value
            else:
                params[name] = parameter_value(value)
        return cls(policy, budget, tuple(sorted(params.items())), protocol)

    @property
    def label(self) -> str:
        extra = "".join(f":{k}={v}" for k, v in self.params)
        return FULL if self.policy == FULL else f"{self.policy}:budget={self.budget}{extra}"

    def cache(self, model):
        """A fresh cache for one batch: the policy's, or a DynamicCache for the full one."""
        if self.policy == FULL:
            from transformers import DynamicCache

            return DynamicCache()
        from . import policy_cache

        return policy_cache(model, self.policy, budget=self.budget, **dict(self.params))


def parameter_value(text: str):
    """A parameter's text as an int, else a float, else the text itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@dataclass
class Answer:
    """What ``ask`` produced: the greedy ``tokens`` (B, T), the bytes of keys and values
    held at the end (``kv_bytes``), the entries held per KV head after the question as a
    fraction of those a full cache holds (``kept``, mean over layers, heads and rows), and
    the decoding steps' wall time (``decode_seconds`` over ``decode_steps`` calls), and the
    ``cache`` itself (what it kept: ``cache.kept_positions(layer)`` for a policy's)."""

    tokens: torch.Tensor
    kv_bytes: int
    kept: float
    decode_seconds: float
    decode_steps: int
    cache: object = None
    #: with teacher forcing (``ask(..., forced=...)``), each row's mean negative log-likelihood of the answer
    nll: torch.Tensor | None = None


@torch.no_grad()
def ask(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    question: int,
    setting: KVSetting,
    max_new_tokens: int,
    forced: torch.Tensor | None = None,
) -> Answer:
    """Run ``setting``'s protocol on a left-padded batch whose last ``question`` tokens
    (every row's) are the question: prefill the context (with the question when
    ``aware``), then feed the question one token per step through the compressed cache,
    then ``max_new_tokens`` greedy tokens. The answer's first token comes from the last
    question step, so the compression always stands between the context and the answer.

    ``forced`` (B, max_new_tokens): teacher forcing instead of greedy decoding: these
    tokens are fed, and ``Answer.nll`` (B,) is their mean negative log-likelihood (the
    answer's perplexity is its exp)."""
    B, P = input_ids.shape
    if forced is not None and (not isinstance(forced, torch.Tensor) or tuple(forced.shape) != (B, max_new_tokens)):
        raise ValueError(
            f"forced: expected a ({B}, {max_new_tokens}) tensor of answer tokens, got "
            f"{tuple(forced.shape) if isinstance(forced, torch.Tensor) else type(forced).__name__}"
        )
    if isinstance(question, bool) or not isinstance(question, int) or not 1 <= question < P:
        raise ValueError(
            f"question: expected an int in [1, {P - 1}] (the question's tokens at the end of each prompt), got {question!r}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    accepted = set(inspect.signature(model.forward).parameters)
    cache_arg = "cache" if "cache" in accepted else "past_key_values"
    cache = setting.cache(model)
    context = P if setting.protocol == "aware" else P - question
    mask = attention_mask[:, :context]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    kwargs = {"input_ids": input_ids[:, :context], "attention_mask": mask, "use_cache": True, cache_arg: cache}
    if "position_ids" in accepted:
        kwargs["position_ids"] = positions
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1
    model(**kwargs)
    steps = [input_ids[:, t] for t in range(P - question, P)] + [None] * max_new_tokens
    produced: list[torch.Tensor] = []
    seconds, nll = 0.0, torch.zeros(B, dtype=torch.float64)
    out = None
    for token in steps:
        if token is None:
            assert out is not None  # the question's tokens (at least one) ran before
            logits = out.logits[:, -1]
            if forced is None:
                token = logits.argmax(-1)
            else:
                token = forced[:, len(produced)]
                nll -= torch.log_softmax(logits.double(), -1).gather(1, token[:, None]).squeeze(1)
            produced.append(token)
            if len(produced) == max_new_tokens:
                break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        kwargs = {"input_ids": token[:, None], "attention_mask": mask, "use_cache": True, cache_arg: cache}
        if "position_ids" in accepted:
            kwargs["position_ids"] = positions
        start = time.perf_counter()
        out = model(**kwargs)
        seconds += time.perf_counter() - start
    return Answer(
        torch.stack(produced, dim=1),
        _kv_bytes(cache),
        _kept(cache, mask),
        seconds,
        question + max_new_tokens - 1,
        cache,
        None if forced is None else nll / max_new_tokens,
    )


def _kv_bytes(cache) -> int:
    if hasattr(cache, "kv_nbytes"):
        return int(cache.kv_nbytes())
    from .compare import dynamic_cache_bytes

    return dynamic_cache_bytes(cache)


def _kept(cache, mask: torch.Tensor) -> float:
    """Entries held over those a full cache holds (every real token fed), mean over
    layers, KV heads and rows; 1.0 for Quest, which evicts nothing (it reads its budget)."""
    if not hasattr(cache, "lengths"):
        return 1.0
    real = mask.sum(-1).to(torch.float64)  # (B,) a row's real tokens (padding is never kept)
    fractions = [(cache.lengths(i).to(torch.float64) / real[:, None]).mean() for i in range(len(cache.layers))]
    return float(torch.stack(fractions).mean())


__all__ = ["FULL", "PROTOCOLS", "Answer", "KVSetting", "ask", "parameter_value"]
