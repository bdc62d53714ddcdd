"""The fixed-size state a linear-attention mechanism carries between calls.

A decoding loop (and later context parallelism) passes it from one call to the next:
``out, state = mech(q, k, v, mask=causal(), return_state=True)`` then
``mech(q1, k1, v1, mask=causal(), initial_state=state, return_state=True)``; N tokens in
one call equal N/2 then N/2 with the state, to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class LinearState:
    """Memory of a linear-attention mechanism after ``position`` tokens.

    memory: S, (B, H, D_f, Dv): the fast-weight matrix every query reads, φ(q)ᵀ S.
    normalizer: z, (B, H, D_f), the running sum of (decayed) key features that
        normalised mechanisms divide by; None for unnormalised ones.
    position: how many tokens the state has consumed (the absolute position of the next
        token; cosFormer's re-weighting depends on it).
    conv: the last (w - 1) raw q, k, v inputs of the short causal convolution, each
        (B, H, w - 1, D), or None when the mechanism has no convolution.

    H is the number of query heads. The tensors are float32 for float16/bfloat16 inputs
    (the recurrence accumulates), float64 for float64 ones.
    """

    memory: Tensor
    normalizer: Tensor | None = None
    position: int = 0
    conv: tuple[Tensor, Tensor, Tensor] | None = None

    def tensors(self) -> list[Tensor]:
        out = [self.memory] + ([] if self.normalizer is None else [self.normalizer])
        return out + list(self.conv or ())

    def _map(self, fn) -> LinearState:
        return replace(
            self,
            memory=fn(self.memory),
            normalizer=None if self.normalizer is None else fn(self.normalizer),
            conv=None if self.conv is None else tuple(fn(t) for t in self.conv),
        )

    def detach(self) -> LinearState:
        """The same state cut from the autograd graph (truncated backprop through time)."""
        return self._map(Tensor.detach)

    def to(self, *args, **kwargs) -> LinearState:
        return self._map(lambda t: t.to(*args, **kwargs))

    def select(self, index: Tensor) -> LinearState:
        """Batch rows ``index`` (a 1-D index tensor), e.g. to reorder beams."""
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

    @property
    def batch(self) -> int:
        return self.memory.shape[0]

    @property
    def heads(self) -> int:
        return self.memory.shape[1]
