"""The call shared by mechanisms that transform a block of logits across heads or
positions before the softmax and mix the weights after it (talking heads, multi-token
attention): checks, the chunked kernel of kernels/mixed.py or the dense formula,
observers, the finite check."""

from __future__ import annotations

import torch

from ..kernels.engine import observe_kernel, run_kernel
from ..kernels.mechanism_call import check_options, finish, request
from ..kernels.mixed import MixedSoftmaxKernel
from ..kernels.request import Request
from .base import Mechanism

Tensor = torch.Tensor


class MixedSoftmaxMechanism(Mechanism):
    """Subclasses define ``kernel(req)``, ``_check(req)``, ``_dense(req) -> (out, lse)`` and
    ``has_lse`` (False when weights are mixed after the softmax: no single lse exists)."""

    has_lse: bool = True

    def kernel(self, req: Request) -> MixedSoftmaxKernel:
        raise NotImplementedError

    def forward(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False, backend="auto",
                check_finite=True, observers=None, layer=None):
        check_options(self.name, sinks=sinks, return_lse=return_lse, backend=backend, lse=self.has_lse)
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req)
        kernel = self.kernel(req)
        if backend == "reference":
            out, lse = self._dense(req)
        else:
            out, stats = run_kernel(req, kernel)
            lse = stats["lse"]
        if observers:
            observe_kernel(req, kernel, {"lse": lse}, observers, layer, self.name)
        finish(req, out, check_finite)
        return (out, lse) if return_lse else out

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req)
        out, lse = self._dense(req)
        return (out, lse) if return_lse else out
