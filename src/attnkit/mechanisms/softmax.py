"""Standard softmax attention (Vaswani et al. 2017, arXiv 1706.03762) on every backend."""

from __future__ import annotations

from ..kernels import make_request, reference_attention
from ..kernels.run import softmax_attention
from .base import Mechanism, register


@register("softmax")
class Softmax(Mechanism):
    paper = "arXiv:1706.03762"

    # not the template: the call is kernels/run.py's exact softmax attention (every backend, sinks, its observed path)
    def forward(self, q, k, v, **call):
        return softmax_attention(q, k, v, **call)

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False, **_):
        out, lse = reference_attention(make_request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks, return_lse=True))
        return (out, lse) if return_lse else out
