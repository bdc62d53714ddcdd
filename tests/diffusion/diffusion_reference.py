"""Independent references for attnkit.diffusion tests: a TorchFunctionMode that records
every SDPA call of the model's default processors (with the attention module making it)
and optionally replaces it with a literal float64 softmax, and dense per-token maps."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class Record(TorchFunctionMode):
    """Records (module path, q, k, scale) of every SDPA call under ``model``'s attention
    modules. With ``logits`` (a function (s, heads) -> s on float64 logits of shape
    (B, H, Nq, Nk)) SDPA is replaced by softmax(logits(q k^T * scale)) v in float64."""

    def __init__(self, model, logits=None):
        super().__init__()
        from attnkit.diffusion import attention_layers

        self.calls, self.current, self.logits = [], None, logits
        self.handles = []
        for layer in attention_layers(model):
            self.handles.append(layer.module.register_forward_pre_hook(self._enter(layer.name)))
            self.handles.append(layer.module.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(module, args):
            self.current = name

        return hook

    def _leave(self, module, args, out):
        self.current = None  # SDPA calls outside the model (a VAE's) are not recorded

    def close(self):
        for h in self.handles:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.current is not None:
            call = dict(zip(ARGS, args), **kwargs)
            q, k, v = call["query"], call["key"], call["value"]
            assert call.get("attn_mask") is None and not call.get("is_causal")
            scale = call.get("scale") or 1 / math.sqrt(q.shape[-1])
            self.calls.append((self.current, q.detach().clone(), k.detach().clone(), scale))
            if self.logits is not None:
                s = (q.double() @ k.double().transpose(-1, -2)) * scale
                p = torch.softmax(self.logits(s), dim=-1)
                return (p @ v.double()).to(q.dtype)
        return func(*args, **kwargs)


def dense_maps(calls, layout, size):
    """Per-token maps from recorded calls, literally: P = softmax(q k^T * scale) in
    float64, the image-query x text-key block of each call (``layout(name, nq, nk)`` ->
    (image rows slice, text cols slice, grid) or None to skip), summed over heads, calls
    resized to ``size`` (bilinear), divided by the number of (call, head) pairs."""
    total, count = None, 0
    for name, q, k, scale in calls:
        where = layout(name, q.shape[2], k.shape[2])
        if where is None:
            continue
        rows, cols, (h, w) = where
        p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
        block = p[:, :, rows, cols].sum(1)  # (B, N_img, T)
        m = block.transpose(1, 2).reshape(block.shape[0], block.shape[2], h, w)
        if (h, w) != tuple(size):
            m = F.interpolate(m, size=tuple(size), mode="bilinear", align_corners=False)
        total = m if total is None else total + m
        count += q.shape[1]
    return total / count
