"""Independent references for the style and entropy tests: what an attention module's
own linear layers produce (to_q, to_k, to_v outputs and the merged attention output
entering to_out[0]), captured by hooks, and literal float64 attention and entropy."""

from __future__ import annotations

import math

import torch


class Capture:
    """Per attention module path: the outputs of to_q, to_k, to_v and the input of
    to_out[0] of its latest call (float64 copies); nothing of attnkit involved. As a
    context manager (``with Capture(model) as cap:``) the hooks go at the block's end."""

    def __init__(self, model):
        from attnkit.diffusion import attention_layers

        self.seen, self.handles = {}, []
        for layer in attention_layers(model):
            m = layer.module
            for proj in ("to_q", "to_k", "to_v"):
                self.handles.append(getattr(m, proj).register_forward_hook(self._out(layer.name, proj)))
            self.handles.append(m.to_out[0].register_forward_pre_hook(self._in(layer.name)))

    def _out(self, name, proj):
        def hook(module, args, out):
            self.seen.setdefault(name, {})[proj] = out.detach().double()

        return hook

    def _in(self, name):
        def hook(module, args):
            self.seen.setdefault(name, {})["out"] = args[0].detach().double()

        return hook

    def snapshot(self):
        return {k: dict(v) for k, v in self.seen.items()}

    def close(self):
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def split_heads(x, heads):  # (B, N, H*D) -> (B, H, N, D)
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def probabilities(q, k, heads, factor=1.0):
    """softmax(factor * q k^T / sqrt(D)) per head, float64: (B, H, Nq, Nk)."""
    q, k = split_heads(q, heads), split_heads(k, heads)
    return torch.softmax(factor * (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)


def attention(q, k, v, heads, factor=1.0):
    """softmax(factor * q k^T / sqrt(D)) v with heads merged: (B, Nq, H*Dv), float64."""
    o = probabilities(q, k, heads, factor) @ split_heads(v, heads)
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def mean_entropy(p):
    """-sum p log p per row, averaged over every row of every head and batch row."""
    return float((-(p * torch.log(p.clamp_min(1e-300))).sum(-1)).mean())
