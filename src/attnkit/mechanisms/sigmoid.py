"""Sigmoid attention (Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for
Sigmoid Self-Attention", arXiv 2409.04431).

Each weight is an independent gate, ``w_ij = sigmoid(s_ij + b)``, with no normalisation
over the row; ``b = -log n`` keeps the initial output norm close to softmax attention's.
The paper's n is the sequence length the model trains at, a constant of the model: here
``context`` (default ``DEFAULT_CONTEXT``), never the number of keys a call happens to
hold, so a prefix call, a full call and token-by-token decoding with a KV cache give the
same rows. ``attnkit.hf.use`` sets ``context`` from the model config's
``max_position_embeddings`` and ``attnkit.nn.TransformerLM`` from its ``max_len``;
``bias=`` fixes b directly. Without a row normaliser the chunked path needs no running max and
no rescaling: every tile adds ``sigmoid(S + b) V`` to the output and is done.

For inference it also runs through FlexAttention (``backend="flex"``): FlexAttention
normalises, so the score mod is ``log sigmoid(s + b)`` and the normalisation is undone
afterwards. Where FlexAttention returns the logsumexp (CUDA, or uncompiled), the output
is multiplied by ``exp(lse)`` (the row sum of the gates). Compiled FlexAttention on CPU
returns no lse (torch 2.13: "return_lse is not supported yet"), so there one extra key
with logit 0 (weight 1) and a value that is 1 in an extra column carries the normaliser:
that column comes out as ``1 / (1 + sum sigmoid)``, which undoes the rest exactly.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..kernels import cpu
from ..kernels.engine import Block, GradBlock, Problem, TileKernel, fused_band, observe_kernel, run_kernel
from ..kernels.few_queries import few_queries, few_query_attention
from ..kernels.flex import flex_attention_call, flex_unsupported
from ..kernels.mechanism_call import dense_logits, dense_values, request
from ..kernels.plan import CAUSAL_SEG, FULL_SEG
from ..kernels.request import Request, make_request
from ..mods import Mask, ScoreMod
from .base import Mechanism, register

Tensor = torch.Tensor


LOG2E = 1.0 / math.log(2.0)
#: n of b = -log n when neither ``bias`` nor ``context`` is given: the paper's language
#: models train at 4096 tokens (arXiv 2409.04431, Sec. 5)
DEFAULT_CONTEXT = 4096


def sigmoid_(s: Tensor, bias: float) -> Tensor:
    """``sigmoid(s + bias)`` in place, computed as ``1 / (1 + 2^(-(s + bias) log2 e))``.

    Same value as ``(s + bias).sigmoid_()`` to float rounding, but torch's CPU ``exp2``
    is about twice as fast as the ``exp`` inside ``sigmoid``, and the gate is the only
    non-matmul work of the kernel. Masked logits (-inf) give exactly 0. Where the C tile
    loops are available (kernels/cpu/) it is one pass instead of four."""
    if cpu.usable(s):
        return cpu.sigmoid_(s, bias)
    torch.add(s.new_tensor(-bias * LOG2E), s, alpha=-LOG2E, out=s)
    return s.exp2_().add_(1.0).reciprocal_()


def _sigmoid_grad_(dw: Tensor, w: Tensor) -> Tensor:
    """dS = dW * w * (1 - w), written into dw in one pass."""
    return torch.ops.aten.sigmoid_backward.grad_input(dw, w, grad_input=dw)


class SigmoidKernel(TileKernel):
    """Unnormalised pointwise weights: out = sum over tiles of sigmoid(S + b) V
    (Ramapuram et al. 2024, arXiv 2409.04431, FlashSigmoid)."""

    def __init__(self, bias: float):
        self.bias = bias

    def gates(self, blk: Block, kind: str, k0: int, k1: int) -> Tensor:
        """The tile's weights sigmoid(S + b), 0 where masked."""
        if kind == CAUSAL_SEG and blk.prob.score is None:
            # The square diagonal tile of a plain causal mask: zeroing the gates above the
            # diagonal in place is cheaper than building the mask and filling -inf logits.
            return sigmoid_(blk.raw_logits(k0, k1), self.bias).tril_()
        return sigmoid_(blk.logits(kind, k0, k1), self.bias)

    def gates_t(self, blk: Block, k0: int, k1: int) -> Tensor:
        """W^T = sigmoid(K Q^T + b) of an unmasked tile with no score mod, keys as rows,
        grouped: (Bt, Hkv, span, G * BQ).

        On CPU a matmul runs ~20% slower when its left operand is a transposed view; in
        this layout every product of the backward (S^T, dW^T, dV = W^T dO, dK = dS^T Q,
        dQ^T = K^T dS^T) takes contiguous operands."""
        k = blk.prob.k[blk.bs, :, k0:k1]
        return sigmoid_(torch.matmul(k, blk.qg.transpose(-1, -2)), self.bias)

    def forward_fused(self, prob: Problem):
        """FlashSigmoid's loop in C: per head and tile two sgemm calls and one pass of gates,
        no Python in between (q already holds the scale)."""
        band = fused_band(prob)
        return None if band is None else (cpu.sigmoid_attention(prob.q, prob.k, prob.v, 1.0, self.bias, prob.q_start, band), {})

    def backward_fused(self, prob: Problem, grad_out: Tensor, stats):
        band = fused_band(prob)
        if band is None:
            return None
        dq, dk, dv = cpu.sigmoid_attention_backward(
            grad_out.contiguous(), prob.q, prob.k, prob.v, 1.0, self.bias, prob.q_start, band
        )
        return dq.mul_(prob.scale), dk, dv  # gradients w.r.t. the unscaled q

    def forward_block(self, blk: Block):
        acc = blk.zeros(blk.prob.v.shape[-1])
        for kind, k0, k1 in blk.tiles():
            blk.pv_add_(acc, self.gates(blk, kind, k0, k1), k0, k1)
        return acc, {}

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        dq_t = None  # dQ^T of the block's full tiles, (Bt, Hkv, D, G * BQ)
        for kind, k0, k1 in blk.tiles():
            if kind == FULL_SEG and blk.prob.score is None:
                dq_t = self.full_tile_grads(blk, k0, k1, dq_t)
                continue
            if blk.prob.track_score:
                s, tracked = blk.tracked_logits(kind, k0, k1)
                w = sigmoid_(s.detach().clone(), self.bias)  # the score mod's graph may hold s
            else:
                s, tracked, w = None, None, self.gates(blk, kind, k0, k1)
            dw = blk.dw(k0, k1)
            blk.add(k0, k1, _sigmoid_grad_(dw, w), w, (s, tracked))
        if dq_t is not None:
            blk.dq_acc += dq_t.transpose(-1, -2)
        return []

    def full_tile_grads(self, blk: GradBlock, k0: int, k1: int, dq_t: Tensor | None) -> Tensor:
        """dV and dK of an unmasked tile with no score mod, from W^T and dS^T (see
        ``gates_t``); returns dq_t plus the tile's dQ^T."""
        prob, g = blk.prob, blk.grads
        ks = (blk.bs, slice(None), slice(k0, k1))
        k = prob.k[ks]
        w_t = self.gates_t(blk, k0, k1)
        ds_t = _sigmoid_grad_(torch.matmul(prob.v[ks], blk.gog.transpose(-1, -2)), w_t)
        g.dv[ks] += torch.matmul(w_t, blk.gog)
        g.dk[ks] += torch.matmul(ds_t, blk.qg)
        dq = torch.matmul(k.transpose(-1, -2), ds_t)
        return dq if dq_t is None else dq_t.add_(dq)

    def observe_block(self, blk: Block, stats):
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            yield k0, k1, torch.sigmoid(s + self.bias), s


@register("sigmoid")
class Sigmoid(Mechanism):
    """``sigmoid(s + b) V`` with no row normalisation.

    Args:
        bias: b itself; None means the paper's ``b = -log n`` with n = ``context``.
        context: n, the context length the model trains at (default ``DEFAULT_CONTEXT``);
            a property of the model, not of a call, so every call (prefix, full, cached
            decoding, padded batch) uses the same b. ``attnkit.hf.use`` passes the
            config's ``max_position_embeddings``, ``attnkit.nn.TransformerLM`` its
            ``max_len``. Ignored when ``bias`` is given.
    """

    paper = "arXiv:2409.04431"

    def __init__(self, bias: float | None = None, context: int | None = None):
        super().__init__()
        if bias is not None and (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)):
            raise ValueError(f"sigmoid(bias): expected a finite number or None (for -log n), got {bias!r}")
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise ValueError(
                f"sigmoid(context): expected an int >= 1 (n of b = -log n, the training context length) or None, got {context!r}"
            )
        self.context = DEFAULT_CONTEXT if context is None else context
        self.bias = -math.log(self.context) if bias is None else float(bias)
        self._flex_mods: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def bias_for(self, k_len: int | None = None) -> float:
        """b for a call; the same for every call whatever its number of keys ``k_len``."""
        return self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bias={self.bias:.6g}"

    backends = ("auto", "chunked", "flex", "reference")
    has_lse = False

    def fast_path(self, req, backend):
        if backend == "flex":
            if req.needs_grad and req.q.device.type == "cpu":
                raise ValueError(
                    "backend='flex' cannot run this call: FlexAttention has no backward on CPU; use backend='chunked' to train"
                )
            return self.flex(req), None
        if few_queries(req) and req.q_len > 0:  # a decoding step: the dense formula, no tiling
            bias = self.bias_for(req.k_len)
            return few_query_attention(req, lambda s: torch.sigmoid(s + bias)), None
        out, _ = run_kernel(req, SigmoidKernel(self.bias_for(req.k_len)))
        return out, None

    def observe_call(self, req, lse, observers, layer):
        observe_kernel(req, SigmoidKernel(self.bias_for(req.k_len)), {}, observers, layer, self.name)

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, **_):
        """The paper's Eq. (1): sigmoid(Q K^T / sqrt(d) + b) V, masked gates are 0."""
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        w = torch.sigmoid(dense_logits(req) + self.bias_for(req.k_len))
        return torch.matmul(w, dense_values(req)).to(q.dtype)

    # ----------------------------------------------------------------- FlexAttention

    def flex(self, req: Request, run=flex_attention_call, lse_route: bool | None = None) -> Tensor:
        """Inference through FlexAttention. ``run`` evaluates a softmax request and returns
        (out, lse | None); ``lse_route`` undoes the normalisation with the lse (default:
        everywhere but CPU, whose compiled FlexAttention returns no lse)."""
        if lse_route is None:
            lse_route = req.q.device.type != "cpu"
        bias = self.bias_for(req.k_len)
        if req.q_len == 0 or req.k_len == 0:
            return torch.zeros(req.batch, req.heads, req.q_len, req.v_dim, dtype=req.q.dtype, device=req.q.device)
        if lse_route:
            soft = make_request(
                req.q, req.k, req.v, mask=req.mask, score=_LogSigmoid(req.score, bias, None, 0), scale=req.scale, return_lse=True
            )
            out, lse = run(_flex_checked(soft, run))
            return (out.to(lse.dtype) * torch.exp(lse).unsqueeze(-1)).to(req.q.dtype)
        return self._flex_with_unit_key(req, bias, run)

    def _flex_with_unit_key(self, req: Request, bias: float, run) -> Tensor:
        B, Hkv, Nk, D = req.k.shape
        Dv = req.v_dim
        width = max(D, Dv + 1)  # CPU FlexAttention wants one head size for q, k and v
        q = torch.nn.functional.pad(req.q, (0, width - D))
        k = torch.nn.functional.pad(req.k, (0, width - D, 0, 1))  # key Nk: the unit key
        v = torch.nn.functional.pad(req.v, (0, width - Dv, 0, 1))
        v[:, :, Nk, Dv] = 1.0
        mask = None if req.mask is None else self._unit_key_mask(req.mask, Nk)
        soft = make_request(q, k, v, mask=mask, score=_LogSigmoid(req.score, bias, Nk, 1), scale=req.scale)
        out, _ = run(_flex_checked(soft, run))
        return (out[..., :Dv] / out[..., Dv : Dv + 1]).to(req.q.dtype)

    def _unit_key_mask(self, mask: Mask, nk: int) -> Mask:
        # One wrapper per user mask, so FlexAttention's block-mask cache keeps working.
        per_mask = self._flex_mods.setdefault(mask, {})
        if nk not in per_mask:
            per_mask[nk] = _OrUnitKey(mask, nk)
        return per_mask[nk]


def _flex_checked(req: Request, run) -> Request:
    if run is flex_attention_call:
        why = flex_unsupported(req)
        if why is not None:
            raise ValueError(f"backend='flex' cannot run this call: {why}")
    return req


class _LogSigmoid(ScoreMod):
    """log sigmoid(score(s) + b), so that a softmax over it is sigmoid / (row sum); the
    unit key (index ``unit``, if any) gets logit 0. Query positions are shifted back by
    ``shift`` (the unit key moved the bottom-right alignment by one)."""

    def __init__(self, inner: ScoreMod | None, bias: float, unit: int | None, shift: int):
        self.inner, self.bias, self.unit, self.shift = inner, bias, unit, shift

    def __call__(self, s, b, h, q_idx, kv_idx):
        if self.inner is not None:
            real_kv = kv_idx if self.unit is None else kv_idx.clamp(max=self.unit - 1)  # mods may index tables by key
            s = self.inner(s, b, h, q_idx - self.shift, real_kv)
        out = torch.nn.functional.logsigmoid(s + self.bias)
        return out if self.unit is None else torch.where(kv_idx == self.unit, torch.zeros_like(out), out)

    def atoms(self):
        return (self,) if self.inner is None else (self, *self.inner.atoms())

    def __repr__(self):
        return f"log_sigmoid(+{self.bias:g})"


class _OrUnitKey(Mask):
    """The user's mask (queries shifted back by one), or the unit key at index ``unit``."""

    def __init__(self, inner: Mask, unit: int):
        self.inner, self.unit = inner, unit
        self.batch_dependent = inner.batch_dependent

    def __call__(self, b, h, q_idx, kv_idx):
        inner = self.inner(b, h, q_idx - 1, kv_idx.clamp(max=self.unit - 1))  # masks may index tables by key
        return (kv_idx == self.unit) | torch.as_tensor(inner, dtype=torch.bool)

    def bind(self, *shape):
        return self  # the inner mask is already bound to the original call

    def children(self):
        return (self.inner,)

    def __repr__(self):
        return f"({self.inner!r}) | unit_key({self.unit})"
