"""The CPU operators: the tile loops that PyTorch cannot fuse, as PyTorch operators in C++
(``torch.ops.attnkit.*``, registered with ``TORCH_LIBRARY``, schema-checked), each family's
C++ beside its Python binding:

- ``pointwise``: tile steps for the PyTorch tile loops (sigmoid gates, softcap, the
  online-softmax update, stick-breaking, head mixing, top-k of rows, depthwise conv);
- ``fused``: whole calls: sigmoid attention forward and backward, softmax forward with
  free head sizes and softcap, top-k forward;
- ``mixed``: softmax with a logit transform and head mixing (multi-token attention,
  talking heads), forward and backward;
- ``sparse``: NSA's inference forward;
- ``kv``: the KV-cache policies' steps (``attnkit.kv``): evicting the lowest-scoring entry
  and refilling its slot (H2O, TOVA), and attention that reads the cache where it lies
  and returns what the policy reads (a step's weights, a prefill's mass per key, packed
  heads, Quest's pages).

Numerics live in common.h (vectorised exp, bands), the tile products in gemm.cpp: oneDNN's
brgemm ukernel for A B (``at::native::cpublas::brgemm``), ATen's addmm on views of the
tile buffers for A B^T and A^T B. Measured per tile on this machine's CPU (one thread,
us; "sgemm" = the MKL ``sgemm_`` symbol the old loader took from libtorch):

    shape (m, n, k)     A B^T: sgemm / addmm       A B (+=): sgemm / addmm / brgemm
    256, 256, 64          98 / 104                  100 / 101 / 77
    128, 256, 64          51 / 54                    50 /  56 / 38
     32, 256, 64          15 / 18.5                  16 /  17 / 11
     64, 1024, 64        108 / 113                  101 / 105 / 76

(brgemm on A B^T needs a transposed copy of the key tile: 108 / 67 / 37 us for the first
three shapes, slower than addmm.) Threads: ``at::parallel_for`` (torch's intra-op pool).
``build.py`` compiles them (cpp_extension, cached and locked); without them, or with
``ATTNKIT_NATIVE=0``, every caller runs its PyTorch tiles, which compute the same values.
"""

from __future__ import annotations

import torch

from .build import Status, available, disabled, status, warn_fallback
from .fused import sigmoid_attention, sigmoid_attention_backward, softmax_attention, topk_attention
from .mixed import mixed_softmax_attention, mixed_softmax_attention_backward
from .pointwise import (
    MAX_MIX_HEADS,
    abs_boost_,
    depthwise_conv2d,
    depthwise_conv2d_weight_grad,
    mix_heads,
    online_softmax_step_,
    sigmoid_,
    softcap_,
    stick_breaking_,
    stick_breaking_backward_,
    topk_rows,
)
from .sparse import nsa_forward

Tensor = torch.Tensor

__all__ = [
    "MAX_MIX_HEADS",
    "Status",
    "abs_boost_",
    "available",
    "depthwise_conv2d",
    "depthwise_conv2d_weight_grad",
    "disabled",
    "engine",
    "fused_usable",
    "mix_heads",
    "mixed_softmax_attention",
    "mixed_softmax_attention_backward",
    "nsa_forward",
    "online_softmax_step_",
    "sigmoid_",
    "sigmoid_attention",
    "sigmoid_attention_backward",
    "softcap_",
    "softmax_attention",
    "status",
    "stick_breaking_",
    "stick_breaking_backward_",
    "topk_attention",
    "topk_rows",
    "usable",
]


def _qualifies(t: Tensor, grad: bool) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and not (grad and t.requires_grad)


def usable(*tensors: Tensor) -> bool:
    """True when the operators can run on these tensors in place of PyTorch's tile steps:
    float32, contiguous, CPU, not tracked by autograd, and the operators available (built
    on the first call; a fallback warns once)."""
    grad = torch.is_grad_enabled()
    if not all(_qualifies(t, grad) for t in tensors):
        return False
    if available():
        return True
    warn_fallback()
    return False


def fused_usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when a whole-call operator can run on q, k, v."""
    return usable(q, k, v)


def engine(*tensors: Tensor) -> str:
    """Which engine runs the tile loops for these tensors, in words (for explain())."""
    if tensors and not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return "PyTorch tiles (the C++ operators take float32 CPU tensors)"
    st = status()
    if st.available:
        return "C++ operators (torch.ops.attnkit, threads: torch's intra-op pool)"
    return f"PyTorch tiles: {st.describe()}"
