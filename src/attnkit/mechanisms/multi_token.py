"""Multi-token attention (Golovneva, Wang, Weston, Sukhbaatar 2025, "Multi-Token
Attention", arXiv 2504.00927).

Every attention weight may depend on several queries, keys and heads at once:

- key-query convolution before the softmax: each head convolves its logits with a
  learned (cq x ck) kernel over (query, key), looking back cq - 1 queries and
  (ck - 1) / 2 keys to either side. Hidden logits enter the convolution as 0 and are
  hidden again after it (the paper's Mask_0 then Mask_-inf), so no future key leaks in;
- head mixing after the softmax: heads in groups of ch mix their weights with a learned
  (ch x ch) matrix per group.

Kernels start as the identity (a 1 at the current query and key, the paper's "identity"
initialisation), so the mechanism computes softmax attention until it trains. The
paper's group normalisation with depth scaling acts on the heads' outputs and belongs
to the layer.

The chunked path computes each tile's logits with a halo of cq - 1 rows above and
(ck - 1) / 2 keys on each side, convolves, and runs the two-pass mixed softmax of
kernels/mixed.py; the gradient of the halo logits is scattered back into dq and dk. For
band masks without a score mod the whole call runs in C (kernels/cpu/loops_mixed.cpp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu
from ..kernels.engine import dense_softmax
from ..kernels.mechanism_call import dense_logits, dense_values
from ..kernels.mixed import CTransform, MixedSoftmaxKernel, mix_heads
from ..kernels.request import Request
from .base import register
from .mixed_heads import MixedSoftmaxMechanism

Tensor = torch.Tensor


class KeyQueryConv(torch.autograd.Function):
    """Depthwise 2-D convolution of logit tiles (one kernel per head), in C where the
    tensors allow. Its backward avoids torch's CPU ``convolution_backward``, which takes a
    slow path for depthwise weight gradients (30x here): the input gradient is the
    transposed convolution (the flipped kernel over the padded gradient), the kernel
    gradient one dot product per tap (in PyTorch: a convolution of the input with dZ as
    the kernel, batch rows as groups)."""

    @staticmethod
    def forward(ctx, s: Tensor, kernel: Tensor) -> Tensor:  # s (B, H, R, C), kernel (H, 1, cq, ck)
        ctx.save_for_backward(s, kernel)
        flat = kernel.squeeze(1)
        if cpu.usable(s, flat):  # several times faster than oneDNN's depthwise path here
            return cpu.depthwise_conv2d(s, flat.contiguous())
        return F.conv2d(s, kernel, groups=kernel.shape[0])

    @staticmethod
    def backward(ctx, dz: Tensor):
        s, kernel = ctx.saved_tensors
        b, h = s.shape[:2]
        cq, ck = kernel.shape[2:]
        dz = dz.contiguous()
        c_loops = cpu.usable(s, dz, kernel)
        ds = dk = None
        if ctx.needs_input_grad[0]:
            if c_loops:  # the transposed convolution: the flipped kernel over dz padded by the kernel's reach
                flipped = kernel.squeeze(1).flip(-1, -2).contiguous()
                ds = cpu.depthwise_conv2d(F.pad(dz, (ck - 1, ck - 1, cq - 1, cq - 1)), flipped)
            else:
                ds = F.conv_transpose2d(dz, kernel, groups=h)
        if ctx.needs_input_grad[1]:
            if c_loops:
                dk = cpu.depthwise_conv2d_weight_grad(s.contiguous(), dz, (cq, ck)).unsqueeze(1)
            else:
                per_row = F.conv2d(s.reshape(1, b * h, *s.shape[2:]), dz.reshape(b * h, 1, *dz.shape[2:]), groups=b * h)
                dk = per_row.view(b, h, *kernel.shape[2:]).sum(dim=0).unsqueeze(1)
        return ds, dk


def _positive(value, name: str, odd: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (odd and value % 2 == 0):
        raise ValueError(f"multi_token({name}): expected an {'odd ' if odd else ''}int >= 1, got {value!r}")
    return value


@register("multi_token")
class MultiToken(MixedSoftmaxMechanism):
    """Key-query convolution of the logits (per head) and head mixing of the weights (per group)."""

    paper = "arXiv:2504.00927"
    # The convolution looks back cq - 1 queries: decoding carries them beside the cache.
    cache_state = True

    def __init__(self, num_heads: int | None = None, query_kernel: int = 6, key_kernel: int = 11, head_kernel: int = 2):
        super().__init__()
        self.cq = _positive(query_kernel, "query_kernel")
        self.ck = _positive(key_kernel, "key_kernel", odd=True)
        self.ch = _positive(head_kernel, "head_kernel")
        #: mixing the weights of groups of heads after the softmax leaves no single lse
        self.has_lse = self.ch == 1
        self.num_heads = None if num_heads is None else _positive(num_heads, "num_heads")
        if self.num_heads is not None and self.num_heads % self.ch:
            raise ValueError(f"multi_token(head_kernel): {self.ch} must divide num_heads={self.num_heads}")
        if self.num_heads is None:
            self.register_parameter("kq_kernel", None)
            self.register_parameter("head_mix", None)
            return
        kernel = torch.zeros(self.num_heads, self.cq, self.ck)
        kernel[:, -1, self.ck // 2] = 1.0  # identity: the current query and key
        self.kq_kernel = nn.Parameter(kernel)
        groups = self.num_heads // self.ch
        self.head_mix = nn.Parameter(torch.eye(self.ch).repeat(groups, 1, 1)) if self.ch > 1 else None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", num_heads={self.num_heads}, kernel=({self.cq}, {self.ck}), head_kernel={self.ch}"

    def _check(self, req: Request) -> None:
        if self.num_heads is None:
            raise ValueError("multi_token: no kernels; build MultiToken(num_heads=H) (they start as the identity)")
        if req.heads != self.num_heads:
            raise ValueError(f"multi_token: kernels for {self.num_heads} heads but the call has Hq={req.heads}")

    # wraps the template: initial_state is checked before its options and runs again as the call's first rows
    def forward(self, q, k, v, *, initial_state=None, return_state=False, return_lse=False, **call):
        """``initial_state`` (B, Hq, m, D), m <= cq - 1: the last queries before this call
        (decoding with a KV cache), which the convolution over queries looks back to; they
        run again as the call's first rows (queries stay bottom-right aligned, so they
        sit at their own positions, and observers see them too) and are dropped from the
        output. ``return_state=True`` also returns the call's last cq - 1 queries."""
        m = 0
        if initial_state is not None:
            m = initial_state.shape[2] if isinstance(initial_state, Tensor) and initial_state.dim() == 4 else -1
            if (
                m < 0
                or m > self.cq - 1
                or initial_state.shape[:2] != q.shape[:2]
                or initial_state.shape[3] != q.shape[3]
                or m + q.shape[2] > k.shape[2]
            ):
                raise ValueError(
                    f"initial_state: expected the last m <= {self.cq - 1} queries before the call, (B, Hq, m, D) = "
                    f"({q.shape[0]}, {q.shape[1]}, m, {q.shape[3]}) with m + Nq <= Nk = {k.shape[2]}, got {getattr(initial_state, 'shape', initial_state)!r}"
                )
            q = torch.cat((initial_state.to(q.dtype), q), dim=2)
        result = super().forward(q, k, v, return_lse=return_lse, **call)
        out, lse = result if return_lse else (result, None)
        out = out[:, :, m:]
        result = (out, lse[:, :, m:]) if return_lse else (out,)
        if return_state:
            result += (q[:, :, max(q.shape[2] - (self.cq - 1), 0) :].detach(),)
        return result if len(result) > 1 else result[0]

    def mixing_matrix(self) -> Tensor | None:
        """The (H x H) block-diagonal matrix of the per-group head mixing."""
        return None if self.head_mix is None else torch.block_diag(*self.head_mix)

    def _convolve(self, s: Tensor) -> Tensor:
        return KeyQueryConv.apply(s, self.kq_kernel.to(s.dtype).unsqueeze(1))

    def kernel(self, req: Request | None = None) -> MixedSoftmaxKernel:
        halo = (self.cq - 1, self.ck // 2, self.ck // 2)
        return MixedSoftmaxKernel(
            self._convolve, [self.kq_kernel], self.mixing_matrix(), halo, CTransform(self.ch, conv=self.kq_kernel)
        )

    def _dense(self, req: Request):
        """As the paper's code: zero the hidden logits, pad (cq - 1 queries before, (ck - 1) / 2
        keys each side), depthwise conv2d, hide again, softmax, mix heads within groups."""
        s = dense_logits(req)
        hidden = torch.isneginf(s)
        padded = F.pad(s.masked_fill(hidden, 0.0), (self.ck // 2, self.ck // 2, self.cq - 1, 0))
        z = self._convolve(padded).masked_fill(hidden, float("-inf"))
        p, lse = dense_softmax(z)
        mix = self.mixing_matrix()
        if mix is not None:
            p = mix_heads(mix, p)
        return torch.matmul(p, dense_values(req)).to(req.q.dtype), lse
