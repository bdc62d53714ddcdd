"""Independent references for attnkit.diffusion tests, run on the model's default
processors (nothing of attnkit's routing involved): ``SDPAByModule``, a TorchFunctionMode
that sees every SDPA call of the model's attention modules with the module making it;
``Record``, which records their q and k (with their graph) and optionally replaces the
call by a literal float64 softmax of changed logits; dense per-token maps from recorded
calls; and literal float64 formulas for the maps' post-processing (smoothing,
Attend-and-Excite's loss)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SDPAByModule(TorchFunctionMode):
    """Hands every SDPA call made inside one of ``model``'s attention modules to
    ``self.sdpa(module path, call)`` (``call``: SDPA's arguments by name); a tensor it
    returns replaces SDPA's result, None lets SDPA run. SDPA calls outside those modules
    (a VAE's) run untouched. Use as ``with Mode(model, ...) as mode:``; the module hooks
    are there for the block only."""

    def __init__(self, model):
        super().__init__()
        self.model, self.current, self.handles = model, None, []

    def sdpa(self, name: str, call: dict):
        return None

    def __enter__(self):
        from attnkit.diffusion import attention_layers

        for layer in attention_layers(self.model):
            self.handles.append(layer.module.register_forward_pre_hook(self._enter(layer.name)))
            self.handles.append(layer.module.register_forward_hook(self._leave))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for h in self.handles:
                h.remove()
            self.handles, self.current = [], None

    def _enter(self, name):
        def hook(module, args):
            self.current = name

        return hook

    def _leave(self, module, args, out):
        self.current = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.current is not None:
            call = dict(zip(ARGS, args), **kwargs)
            assert call.get("attn_mask") is None and not call.get("is_causal")  # the references below assume none
            out = self.sdpa(self.current, call)
            if out is not None:
                return out
        return func(*args, **kwargs)


def call_scale(call: dict) -> float:
    """The logit scale of an SDPA call: its ``scale``, or SDPA's default 1/sqrt(D)."""
    return call.get("scale") or 1 / math.sqrt(call["query"].shape[-1])


def softmax64(q, k, scale, logits=None):
    """softmax(logits(q k^T * scale)) in float64 over the keys: (B, H, Nq, Nk)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s if logits is None else logits(s), dim=-1)


class Record(SDPAByModule):
    """Records (module path, q, k, scale) of every SDPA call in ``calls``, q and k as the
    processors made them (their graph kept when autograd records one). With ``logits``
    (a function s -> s on float64 logits of shape (B, H, Nq, Nk)) SDPA is replaced by
    softmax(logits(q k^T * scale)) v in float64."""

    def __init__(self, model, logits=None):
        super().__init__(model)
        self.calls, self.logits = [], logits

    def sdpa(self, name, call):
        q, k, v = call["query"], call["key"], call["value"]
        scale = call_scale(call)
        self.calls.append((name, q, k, scale))
        if self.logits is None:
            return None
        return (softmax64(q, k, scale, self.logits) @ v.double()).to(q.dtype)


def recorded(model, run, logits=None):
    """``run()`` under a ``Record`` of ``model``; returns (its result, the calls)."""
    with Record(model, logits) as rec:
        out = run()
    return out, rec.calls


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
        block = softmax64(q, k, scale)[:, :, rows, cols].sum(1)  # (B, N_img, T)
        m = block.transpose(1, 2).reshape(block.shape[0], block.shape[2], h, w)
        if (h, w) != tuple(size):
            m = F.interpolate(m, size=tuple(size), mode="bilinear", align_corners=False)
        total = m if total is None else total + m
        count += q.shape[1]
    return total / count


def smooth_literal(m, sigma, size=3):
    """(..., h, w) float64 maps convolved with a normalised size x size Gaussian,
    borders reflected (index -1 -> 1, h -> h - 2), by explicit loops over the offsets."""
    r = size // 2
    h, w = m.shape[-2:]
    offsets = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)]
    weight = {o: math.exp(-(o[0] ** 2 + o[1] ** 2) / (2 * sigma**2)) for o in offsets}
    total = sum(weight.values())

    def reflect(i, n):
        return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)

    out = torch.zeros_like(m)
    for y in range(h):
        for x in range(w):
            out[..., y, x] = sum(weight[(dy, dx)] * m[..., reflect(y + dy, h), reflect(x + dx, w)] for dy, dx in offsets) / total
    return out


def excite_literal(maps, tokens, sigma, lo=1):
    """Attend-and-Excite's loss per batch row, literally: softmax over tokens lo.. of
    100 x maps, the targets' maps smoothed, 1 - their peak, the worst target."""
    renorm = torch.softmax(100 * maps[:, lo:].double(), dim=1)
    peaks = torch.stack([smooth_literal(renorm[:, t - lo], sigma).flatten(1).max(1).values for t in tokens], 1)
    return (1 - peaks).clamp_min(0).max(1).values


def restored(model) -> bool:
    """Whether attnkit left ``model`` as it found it: neither the model's nor any attention
    module's ``forward`` replaced, no intervention left in ``EDITS``."""
    from attnkit.diffusion import EDITS, attention_layers

    layers = attention_layers(model)
    return "forward" not in model.__dict__ and all(
        "forward" not in layer.module.__dict__ and layer.module not in EDITS for layer in layers
    )
