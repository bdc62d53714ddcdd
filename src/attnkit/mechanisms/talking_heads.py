"""Talking-heads attention (Shazeer, Lan, Cheng, Ding, Hou 2020, "Talking-Heads
Attention", arXiv 2003.02436).

Heads exchange information twice: the logits of all heads are mixed by a learned
(H x H) matrix before the softmax, and the normalised weights are mixed by another after
it:

    J' = P_l J,    W = softmax(J'),    W' = P_w W,    O = W' V

(mixing acts on the head axis, at every (query, key) pair). Both matrices start as the
identity, so a model switched to talking heads computes softmax attention until they
train. Score mods act on the logits of each head before the mixing; hidden pairs enter
the mix as 0 and are hidden again after it.

The chunked path mixes the logits inside each tile; mixing after the softmax needs every
head's final lse, so each block of rows makes two passes over its keys (kernels/mixed.py;
for band masks without a score mod, whole in C++: kernels/cpu/loops_mixed.cpp).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.engine import dense_softmax
from ..kernels.mechanism_call import dense_logits, dense_values
from ..kernels.mixed import CTransform, MixedSoftmaxKernel, mix_heads
from ..kernels.request import Request
from .base import register
from .mixed_heads import MixedSoftmaxMechanism

Tensor = torch.Tensor


@register("talking_heads")
class TalkingHeads(MixedSoftmaxMechanism):
    """Learned (H x H) head mixing of the logits (``pre``) and of the weights (``post``)."""

    paper = "arXiv:2003.02436"

    def __init__(self, num_heads: int | None = None, pre: bool = True, post: bool = True):
        super().__init__()
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(f"talking_heads(num_heads): expected an int >= 1, got {num_heads!r}")
        if not isinstance(pre, bool) or not isinstance(post, bool) or not (pre or post):
            raise ValueError(f"talking_heads(pre, post): expected bools, at least one True, got pre={pre!r}, post={post!r}")
        self.num_heads = num_heads
        eye = None if num_heads is None else torch.eye(num_heads)
        self.pre_mix = nn.Parameter(eye.clone()) if pre and eye is not None else None
        self.post_mix = nn.Parameter(eye.clone()) if post and eye is not None else None
        self.pre, self.post = pre, post
        #: mixing the weights after the softmax leaves no single lse
        self.has_lse = not post

    def extra_repr(self) -> str:
        return super().extra_repr() + f", num_heads={self.num_heads}, pre={self.pre}, post={self.post}"

    def _check(self, req: Request) -> None:
        if self.num_heads is None:
            raise ValueError("talking_heads: no mixing matrices; build TalkingHeads(num_heads=H) (they start as the identity)")
        if req.heads != self.num_heads:
            raise ValueError(f"talking_heads: matrices for {self.num_heads} heads but the call has Hq={req.heads}")

    def kernel(self, req: Request) -> MixedSoftmaxKernel:
        pre, heads = self.pre_mix, self.num_heads
        assert heads is not None  # _check ran first
        if pre is None:
            return MixedSoftmaxKernel(lambda s: s, [], self.post_mix, c_transform=CTransform(heads))
        return MixedSoftmaxKernel(lambda s: mix_heads(pre, s), [pre], self.post_mix, c_transform=CTransform(heads, pre=pre))

    def _dense(self, req: Request):
        """The paper's Sec. 4 listing: J = QK^T; J' = P_l J; W = softmax(J'); W' = P_w W; O = W' V."""
        J = dense_logits(req)
        hidden = torch.isneginf(J)
        if self.pre_mix is not None:
            J = mix_heads(self.pre_mix, J.masked_fill(hidden, 0.0)).masked_fill(hidden, float("-inf"))
        W, lse = dense_softmax(J)
        if self.post_mix is not None:
            W = mix_heads(self.post_mix, W)
        return torch.matmul(W, dense_values(req)).to(req.q.dtype), lse
