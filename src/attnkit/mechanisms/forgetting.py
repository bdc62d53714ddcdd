"""Forgetting attention, the attention of the Forgetting Transformer (FoX; Lin, Nikishin,
He, Courville 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate",
arXiv 2503.02130).

Every token t has a forget gate ``f_t`` in (0, 1] per head (computed by the model, e.g.
``sigmoid(w_f . x_t + b_f)``); with ``Lambda = cumsum(log f)`` the logits become

    s_ij + Lambda_i - Lambda_j  =  s_ij + sum_{j < l <= i} log f_l,

a data-dependent decay: with a constant gate it is ALiBi. Score mods and masks apply to
these logits (a softcap sees the decayed logit).

The decay is a sum of a per-query and a per-key term, so it folds into two extra head
dimensions: ``q' = [q, Lambda_i / scale, 1 / scale]`` and ``k' = [k, 1, -Lambda_j]`` give
``scale * q'.k' = s_ij + Lambda_i - Lambda_j``. The call then runs on the chunked
backend's fused flash tiles (forward and backward, O(N) memory), and the gradient of the
gates comes back through the two extra columns of dq', dk'.

Without gates at call time, ``Forgetting(num_heads=H)`` learns one data-independent gate
per head, initialised to ALiBi's slopes (``log f_h = -slope_h``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import chunked_attention, empty_result, make_request
from ..kernels.engine import dense_index
from ..kernels.mechanism_call import observe_softmax_as, request
from ..kernels.request import Request
from ..mods import alibi_slopes
from .base import Mechanism, register

Tensor = torch.Tensor


@register("forgetting")
class Forgetting(Mechanism):
    """Softmax over ``s_ij + Lambda_i - Lambda_j``, ``Lambda = cumsum(log f)``; gates are
    passed at call time (``forget=`` or ``log_forget=``, (B, H, Nk) with H = Hq or Hkv)
    or learned per head (``num_heads=``)."""

    paper = "arXiv:2503.02130"
    takes_sinks = True
    #: the gates of a call (without them, the learned ones: ``num_heads=``)
    call_keywords = ("forget", "log_forget")

    def __init__(self, num_heads: int | None = None):
        super().__init__()
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(f"forgetting(num_heads): expected an int >= 1 or None, got {num_heads!r}")
        self.num_heads = num_heads
        if num_heads is None:
            self.register_parameter("gate_logit", None)
        else:
            f = torch.exp(-alibi_slopes(num_heads).double())
            self.gate_logit = nn.Parameter(torch.log(f / (1 - f)).float())

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.num_heads is None else f", num_heads={self.num_heads} (learned gates)")

    def log_gates(self, req: Request, forget=None, log_forget=None) -> Tensor:
        """log f of shape (B, Hg, Nk), Hg = Hq or Hkv, in the compute dtype."""
        if forget is not None and log_forget is not None:
            raise ValueError("forget, log_forget: give one of them, not both")
        cd = torch.float64 if req.q.dtype == torch.float64 else torch.float32
        if forget is None and log_forget is None:
            if self.gate_logit is None:
                raise ValueError(
                    "forgetting: no forget gates; pass forget= or log_forget= of shape (B, H, Nk) to the mechanism, "
                    "or build Forgetting(num_heads=H) to learn one gate per head"
                )
            if self.gate_logit.shape[0] != req.heads:
                raise ValueError(
                    f"forgetting: learned gates for {self.gate_logit.shape[0]} heads but the call has Hq={req.heads}"
                )
            log_f = F.logsigmoid(self.gate_logit.to(cd))
            return log_f.view(1, -1, 1).expand(req.batch, -1, req.k_len)
        name, gates = ("forget", forget) if forget is not None else ("log_forget", log_forget)
        if (
            not isinstance(gates, Tensor)
            or not gates.is_floating_point()
            or gates.dim() != 3
            or gates.shape[0] != req.batch
            or gates.shape[1] not in (req.heads, req.kv_heads)
            or gates.shape[2] != req.k_len
        ):
            raise ValueError(
                f"{name}: expected a float tensor (B, H, Nk) = ({req.batch}, {req.heads} or {req.kv_heads}, {req.k_len}), "
                f"one gate per key position and head, got {getattr(gates, 'shape', gates)!r}"
            )
        g = gates.detach()
        if name == "forget":
            if bool(((g <= 0) | (g > 1) | torch.isnan(g)).any()):
                raise ValueError("forget: gates must lie in (0, 1]")
            return torch.log(gates.to(cd))
        if bool(((g > 0) | torch.isnan(g)).any()):
            raise ValueError("log_forget: log-gates must be <= 0 (gates in (0, 1])")
        return gates.to(cd)

    def _augmented(self, req: Request, log_f: Tensor) -> Request:
        """The FoX call as plain softmax attention with two extra head dimensions."""
        lam = torch.cumsum(log_f, dim=-1)  # (B, Hg, Nk)
        groups = req.heads // req.kv_heads
        k, v = req.k, req.v
        if lam.shape[1] != req.kv_heads:  # one gate per query head: every query head gets its own keys
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            lam_q = lam
        else:
            lam_q = lam.repeat_interleave(groups, dim=1)
        dtype = req.q.dtype if req.q.dtype in (torch.float32, torch.float64) else torch.float32  # Lambda needs the mantissa
        lam_q = lam_q[:, :, req.q_start :]
        q_extra = torch.stack([lam_q / req.scale, torch.full_like(lam_q, 1.0 / req.scale)], dim=-1)
        k_extra = torch.stack([torch.ones_like(lam), -lam], dim=-1)
        q2 = torch.cat([req.q.to(dtype), q_extra.to(dtype)], dim=-1)
        k2 = torch.cat([k.to(dtype), k_extra.to(dtype)], dim=-1)
        return make_request(
            q2, k2, v.to(dtype), mask=req.mask, score=req.score, scale=req.scale, sinks=req.sinks, return_lse=True
        )

    def fast_path(self, req, backend, forget=None, log_forget=None):
        """(out, lse) and the request it ran: the call as plain softmax attention (``_augmented``)."""
        if req.q_len == 0 or req.k_len == 0:
            self.log_gates(req, forget, log_forget)  # still checked
            return (*empty_result(req), req)
        aug = self._augmented(req, self.log_gates(req, forget, log_forget))
        out, lse = chunked_attention(aug)
        return out.to(req.q.dtype), lse, aug

    def observe_call(self, req, lse, observers, layer, found=None, forget=None, log_forget=None):
        # the request the fast path ran, or (after the reference) the same made here
        aug = found or self._augmented(req, self.log_gates(req, forget, log_forget))
        observe_softmax_as(aug, lse, observers, layer, self.name)

    def reference(
        self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, return_lse=False, forget=None, log_forget=None, **_
    ):
        """The paper's Eq. (6): softmax over ``q_i.k_j / sqrt(d) + sum_{j<l<=i} log f_l``."""
        req = request(q, k, v, mask=mask, score=score, scale=scale, sinks=sinks)
        log_f = self.log_gates(req, forget, log_forget)
        cd = log_f.dtype
        groups = req.heads // req.kv_heads
        lam = torch.cumsum(log_f, dim=-1)
        if lam.shape[1] == req.kv_heads:
            lam = lam.repeat_interleave(groups, dim=1)
        decay = lam[:, :, req.q_start :, None] - lam[:, :, None, :]
        s = torch.matmul(req.q.to(cd), req.k.to(cd).repeat_interleave(groups, dim=1).transpose(-1, -2)) * req.scale + decay
        b, h, qi, ki = dense_index(req)
        if req.score is not None:
            s = req.score(s, b, h, qi, ki).to(cd)
        if req.mask is not None:
            s = s.masked_fill(~torch.as_tensor(req.mask(b, h, qi, ki), dtype=torch.bool), -math.inf)
        if req.sinks is not None:
            s = torch.cat([s, req.sinks.to(cd).view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        dead = torch.isneginf(s).all(-1, keepdim=True)
        lse = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1, keepdim=True)
        p = torch.exp(s - lse).masked_fill(dead, 0.0)
        if req.sinks is not None:
            p = p[..., :-1]
        out = torch.matmul(p, req.v.to(cd).repeat_interleave(groups, dim=1)).to(q.dtype)
        lse = lse.masked_fill(dead, -math.inf).squeeze(-1)
        return (out, lse) if return_lse else out
