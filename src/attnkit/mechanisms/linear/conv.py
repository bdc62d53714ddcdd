"""The short causal convolution that Based/Zoology mixers, DeltaNet and Gated DeltaNet
put before linear attention (Arora et al. 2024, arXiv 2402.18668; Yang et al. 2024,
arXiv 2406.06484): a depthwise convolution over time of width w, per head and channel,
followed by SiLU, on each of q, k and v. It gives the recurrence a precise view of the
last few tokens, which a decaying fixed-size state blurs.

Decoding carries the last w - 1 raw inputs of q, k, v in the state.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

Tensor = torch.Tensor


class ShortConv(LazyModuleMixin, nn.Module):
    """Weights (H, D, w) for q, k and v, created on the first call (PyTorch's Conv1d
    initialisation for a depthwise filter: U(-1/√w, 1/√w)); no bias, as in fla."""

    def __init__(self, size: int):
        super().__init__()
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"short_conv: expected a positive kernel width, got {size!r}")
        self.size = size
        self.weight_q, self.weight_k, self.weight_v = UninitializedParameter(), UninitializedParameter(), UninitializedParameter()

    def initialize_parameters(self, q: Tensor, k: Tensor, v: Tensor, cache=None) -> None:
        # Called by the lazy-module hook on the first call even when the weights were
        # created at construction (LinearAttention given heads= and head_dim=): keep them.
        if not self.has_uninitialized_params():
            return
        bound = 1 / math.sqrt(self.size)
        with torch.no_grad():
            for w, x in ((self.weight_q, q), (self.weight_k, k), (self.weight_v, v)):
                w.materialize((x.shape[1], x.shape[-1], self.size), device=x.device)
                w.uniform_(-bound, bound)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor, Tensor] | None = None):
        """(q, k, v) convolved, and the new cache: the last w - 1 raw inputs of each."""
        outs, new_cache = [], []
        for i, (x, w) in enumerate(((q, self.weight_q), (k, self.weight_k), (v, self.weight_v))):
            if w.shape[0] != x.shape[1] or w.shape[1] != x.shape[-1]:
                raise ValueError(
                    f"{'qkv'[i]}: the short convolution was built for {w.shape[0]} heads of dim {w.shape[1]}, got shape {tuple(x.shape)}"
                )
            dt = torch.promote_types(x.dtype, w.dtype)  # float32 at least: bf16 taps lose the sum
            past = x.new_zeros(*x.shape[:2], self.size - 1, x.shape[-1]) if cache is None else cache[i]
            padded = torch.cat([past.to(dt), x.to(dt)], dim=2)
            n = x.shape[2]
            taps = w.to(dt).permute(2, 0, 1).unsqueeze(2)  # (w, H, 1, D); tap j reads x_{t-w+1+j}
            y = cast(Tensor, sum(taps[j] * padded[:, :, j : j + n] for j in range(self.size)))  # size >= 1 taps
            outs.append(F.silu(y))
            new_cache.append(padded[:, :, padded.shape[2] - (self.size - 1) :])
        return (*outs, tuple(new_cache))

    def extra_repr(self) -> str:
        return f"size={self.size}"
