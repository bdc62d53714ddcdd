"""The call shared by mechanisms that transform a block of logits across heads or
positions before the softmax and mix the weights after it (talking heads, multi-token
attention): the chunked kernel of kernels/mixed.py or the dense formula in the steps of
``Mechanism.forward``'s template."""

from __future__ import annotations

import torch

from ..kernels.engine import observe_kernel, run_kernel
from ..kernels.mechanism_call import request
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

    def _check(self, req: Request) -> None:
        """Raise ValueError when the mechanism's parameters do not fit the call."""
        raise NotImplementedError

    def _dense(self, req: Request) -> tuple[Tensor, Tensor]:
        """(out, lse) by the paper's dense formula."""
        raise NotImplementedError

    def call_request(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, **own) -> Request:
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req)
        return req

    def reference_result(self, req, q, k, v, **call):
        return self._dense(req)

    def fast_path(self, req, backend):
        out, stats = run_kernel(req, self.kernel(req))
        return out, stats["lse"]

    def observe_call(self, req, lse, observers, layer):
        observe_kernel(req, self.kernel(req), {"lse": lse}, observers, layer, self.name)

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, **_):
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req)
        out, lse = self._dense(req)
        return (out, lse) if return_lse else out
