"""One attention call, validated: the shapes, mods and options every backend receives."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..mods import Mask, ScoreMod, as_mask, as_score

Tensor = torch.Tensor
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Request:
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask | None
    score: ScoreMod | None
    scale: float
    sinks: Tensor | None
    return_lse: bool

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def k_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def v_dim(self) -> int:
        return self.v.shape[3]

    @property
    def q_start(self) -> int:
        """Position of the first query among the keys (bottom-right alignment)."""
        return self.k_len - self.q_len

    @property
    def needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [self.q, self.k, self.v]
        if self.sinks is not None:
            tensors.append(self.sinks)
        if self.score is not None:
            tensors += self.score.parameters()
        return any(t.requires_grad for t in tensors)

    def shapes(self) -> str:
        return (
            f"B={self.batch} Hq={self.heads} Hkv={self.kv_heads} Nq={self.q_len} Nk={self.k_len} "
            f"D={self.head_dim}{'' if self.v_dim == self.head_dim else f' Dv={self.v_dim}'} {str(self.q.dtype).replace('torch.', '')}"
        )


def make_request(q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False) -> Request:
    """Validate a call; every error names the argument and what was expected."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = {"q": "(B, Hq, Nq, D)", "k": "(B, Hkv, Nk, D)", "v": "(B, Hkv, Nk, Dv)"}[name]
            raise ValueError(f"{name}: expected a 4-D tensor of shape {want}, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: devices differ ({q.device}, {k.device}, {v.device})")
    B, Hq, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k, v: batch size must equal q's B={B}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k: head dim must equal q's D={D}, got k of shape {tuple(k.shape)}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(
            f"v: expected shape (B, Hkv, Nk, Dv) = ({B}, {k.shape[1]}, {k.shape[2]}, Dv) to match k, got {tuple(v.shape)}"
        )
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k, v: query heads Hq={Hq} must be a multiple of key/value heads Hkv={Hkv} (GQA/MQA)")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"q, k, v: head dims must be >= 1, got D={D}, Dv={v.shape[3]}")

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, Tensor) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite Python number, got {scale!r}")

    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.shape != (Hq,) or not sinks.is_floating_point():
            raise ValueError(
                f"sinks: expected a float tensor of shape (Hq,) = ({Hq},), one logit per query head, got {getattr(sinks, 'shape', sinks)!r}"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks: on {sinks.device} but q is on {q.device}")
        if not torch.isfinite(sinks.detach()).all():
            raise ValueError("sinks: contains NaN or inf")

    bound_mask = None if mask is None else as_mask(mask).bind(B, Hq, Nq, k.shape[2])
    bound_score = None if score is None else as_score(score).bind(B, Hq, Nq, k.shape[2])
    return Request(q, k, v, bound_mask, bound_score, float(scale), sinks, bool(return_lse))


def empty_result(req: Request) -> tuple[Tensor, Tensor]:
    """Output for Nq == 0 or Nk == 0: no keys means zeros and lse = -inf, with gradients."""
    B, H, Nq, Dv = req.batch, req.heads, req.q_len, req.v_dim
    # Multiply by zero so the result stays connected to the inputs' graph (zero gradients).
    link = req.q.sum() * 0 + req.k.sum() * 0 + req.v.sum() * 0
    if req.sinks is not None:
        link = link + req.sinks.sum() * 0
    out = torch.zeros(B, H, Nq, Dv, dtype=req.q.dtype, device=req.q.device) + link.to(req.q.dtype)
    lse_dtype = torch.float64 if req.q.dtype == torch.float64 else torch.float32
    lse = torch.full((B, H, Nq), -math.inf, dtype=lse_dtype, device=req.q.device)
    if req.sinks is not None and Nq:
        # The sink is the only key: it takes all the mass and its value is zero.
        lse = req.sinks.to(lse_dtype).view(1, H, 1).expand(B, H, Nq).clone()
    return out, lse


def nonfinite_error(req: Request) -> ValueError:
    """The error for a non-finite output: names the input that carried NaN/inf."""
    for name, t in (("q", req.q), ("k", req.k), ("v", req.v), ("sinks", req.sinks)):
        if t is not None and not bool(torch.isfinite(t.detach()).all()):
            bad = (~torch.isfinite(t.detach())).nonzero()[0].tolist()
            return ValueError(
                f"{name}: contains NaN or inf (first at index {bad}); attention spreads it to the output. "
                "Clean the input, or pass check_finite=False to get the raw result"
            )
    return ValueError(f"attention produced NaN or inf from finite inputs ({req.shapes()}); check the score mod for overflow")


def all_finite(t: Tensor) -> bool:
    """Cheap finiteness test: one reduction, confirmed elementwise only when it fails
    (a large sum can overflow while every element is finite)."""
    if t.numel() == 0 or torch.compiler.is_compiling():  # a compiled graph cannot branch on data: no check there
        return True
    t = t.detach()
    return math.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())
