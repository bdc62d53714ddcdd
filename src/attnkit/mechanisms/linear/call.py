"""One validated linear-attention call, as every form receives it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import Recurrence, log_gates, skip_keys
from .gates import KeyGate

Tensor = torch.Tensor


@dataclass(frozen=True)
class LinearCall:
    """Heads already expanded to the H query heads (GQA), gates and β resolved.

    q (B, H, Nq, D); k (B, H, Nk, D); v (B, H, Nk, Dv); g log-gates <= 0 of shape (B, H, Nk)
    (scalar) or (B, H, Nk, D_f) (diagonal), a KeyGate that computes them from k, or None;
    beta (B, H, Nk), a KeyGate, or None (sum rule);
    memory (B, H, D_f, Dv') the state before the first key in the compute dtype, with the
    normaliser z as its last column when normalised, or None for zeros. ``start`` is the
    absolute position of the first key. Causal queries are the last Nq key positions
    (bottom-right aligned); non-causal ones read the state after every key.
    """

    rec: Recurrence
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor | KeyGate | None
    beta: Tensor | KeyGate | None
    memory: Tensor | None
    start: int
    causal: bool
    #: (B, Nk) bool, False for keys a padding mask hides: they neither write nor decay
    keep: Tensor | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    @property
    def q_offset(self) -> int:
        """Index of the first query's key position among this call's keys."""
        return self.k.shape[2] - self.q.shape[2]

    @property
    def feature_dim(self) -> int:
        return self.rec.feature_map.out_dim(self.k.shape[-1])

    @property
    def memory_dim(self) -> int:
        return self.v.shape[-1] + int(self.rec.normalize)

    def gates(self) -> tuple[Tensor | None, Tensor | None]:
        """(log-gates (B, H, Nk, Dg) or None, β (B, H, Nk) or None) as tensors, zero at
        skipped keys."""
        g = self.g(self.k) if isinstance(self.g, KeyGate) else self.g
        beta = self.beta(self.k) if isinstance(self.beta, KeyGate) else self.beta
        return skip_keys(log_gates(g), self.keep), skip_keys(beta, self.keep)

    def initial_memory(self) -> Tensor:
        if self.memory is not None:
            return self.memory
        B, H = self.k.shape[:2]
        return torch.zeros(B, H, self.feature_dim, self.memory_dim, dtype=self.compute_dtype, device=self.k.device)

    def features(self) -> tuple[Tensor, Tensor, Tensor]:
        """(φ(q), φ(k), v') in the compute dtype, skipped keys zeroed; queries at their key
        positions (bottom-right aligned)."""
        cd = self.compute_dtype
        kf = skip_keys(self.rec.keys(self.k.to(cd), self.start), self.keep)
        v = skip_keys(self.rec.values(self.v.to(cd)), self.keep)
        return self.rec.queries(self.q.to(cd), self.start + self.q_offset), kf, v
