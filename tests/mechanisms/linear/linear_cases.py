"""Inputs and mechanism configurations shared by the linear-attention tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.mechanisms.linear import LinearAttention
from attnkit.observe import Observer

# (label, LinearAttention kwargs, gate kind): every rule x normalisation x gate kind.
CONFIGS = [
    ("sum", {}, None),
    ("sum elu norm", {"feature_map": "elu+1", "normalize": True}, None),
    ("sum scalar", {}, "scalar"),
    ("sum diag", {}, "diag"),
    ("sum elu norm diag", {"feature_map": "elu+1", "normalize": True}, "diag"),
    ("sum dpfp scalar", {"feature_map": "dpfp"}, "scalar"),
    ("delta", {"feature_map": "silu+l2", "rule": "delta"}, None),
    ("delta scalar", {"feature_map": "silu+l2", "rule": "delta"}, "scalar"),
    ("delta diag", {"feature_map": "silu+l2", "rule": "delta"}, "diag"),
    ("delta norm", {"feature_map": "silu+l2", "rule": "delta", "normalize": True}, "scalar"),
]


def qkv(B=2, Hq=4, Hkv=2, Nq=23, Nk=23, D=4, Dv=3, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64)
    out = [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]
    return out


def gates(kind, B, H, N, Df, dtype=torch.float64, seed=1, strength=1.0, requires_grad=False):
    """Random log-gates in (-inf, 0): logsigmoid of a Gaussian, times ``strength``."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, N) if kind == "scalar" else (B, H, N, Df)
    out = (F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 2) * strength).to(dtype)
    return out.requires_grad_(requires_grad)


def betas(rule, B, H, N, dtype=torch.float64, seed=2, requires_grad=False):
    if rule != "delta":
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(B, H, N, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(requires_grad)


def build(kwargs, chunk_size=5):
    return LinearAttention(chunk_size=chunk_size, **kwargs)


def feature_dim(mech, D):
    return mech.feature_map.out_dim(D)


class Recorder(Observer):
    """Keeps every call and tile it is shown."""

    def __init__(self):
        self.calls, self.tiles = [], []

    def begin(self, call):
        self.calls.append(call)

    def update(self, tile):
        self.tiles.append(tile)


def dense_weights(recorder, B, H, Nq, Nk):
    """The recorded tiles as one (B, H, Nq, Nk) matrix, and how often each pair was shown."""
    w = torch.zeros(B, H, Nq, Nk, dtype=torch.float64)
    seen = torch.zeros(Nq, Nk, dtype=torch.int64)
    for tile in recorder.tiles:
        rows = tile.q_pos - recorder.calls[0].q_start
        w[:, :, rows[:, None], tile.k_pos[None, :]] = tile.weights
        seen[rows[:, None], tile.k_pos[None, :]] += 1
    return w, seen
