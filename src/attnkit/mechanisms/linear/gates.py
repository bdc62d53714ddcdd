"""Decays G_t = exp(g_t) and delta-rule strengths β_t, fixed or computed from the keys.

A gate module maps the keys k (B, Hkv, N, D) of a call to log-gates g <= 0:
(B, H, N) for one decay per head and token, or (B, H, N, D_f) for one per feature row
of the state, with H = Hkv (computed from the keys) or H = Hq (fixed per query head).

Data-dependent gates are small per-head projections of k whose weights are
``torch.nn`` lazy parameters: they take their shapes from the first call (pass
``heads=`` and ``head_dim=`` to create them at once). Their output weights start at
zero, so every gate starts at the data-independent value the paper's initialisation
centres on and a named mechanism gives the same result on every call until it is
trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

from ...mods import alibi_slopes

Tensor = torch.Tensor


def retnet_log_decays(heads: int) -> Tensor:
    """log γ_h with γ_h = 1 - 2^(-5-h), h = 0..H-1 (RetNet, Sun et al. 2023, arXiv 2307.08621, Sec. 2.2)."""
    return torch.log1p(-torch.exp2(-5.0 - torch.arange(heads, dtype=torch.float64)))


def lightning_log_decays(heads: int) -> Tensor:
    """log λ_h = -s_h with s the ALiBi slopes (Lightning Attention-2, Qin et al. 2024,
    arXiv 2401.04658; TransNormerLLM additionally scales them by layer depth)."""
    return -alibi_slopes(heads).to(torch.float64)


class FixedDecay(nn.Module):
    """One constant decay per query head, not learned (RetNet, Lightning Attention)."""

    per_query_head = True

    def __init__(self, log_decays):
        super().__init__()
        self.log_decays = log_decays  # heads -> (H,) float64 tensor of log-decays <= 0

    def forward(self, k: Tensor, heads: int, feature_dim: int) -> Tensor:
        g = self.log_decays(heads).to(device=k.device, dtype=_dtype(k))
        return g.view(1, heads, 1).expand(k.shape[0], heads, k.shape[2])

    def extra_repr(self) -> str:
        return getattr(self.log_decays, "__name__", "")


@dataclass(frozen=True)
class KeyGate:
    """Gates computed token by token from the keys, ``fn(k, *params)``, with the weights
    repeated to the query heads. The chunked form evaluates it span by span inside its
    checkpointed scan, so the gates never exist for the whole sequence at once."""

    fn: Callable[..., Tensor]
    params: tuple[Tensor, ...]

    def __call__(self, k: Tensor) -> Tensor:
        return self.fn(k, *self.params)


class _KeyProjection(LazyModuleMixin, nn.Module):
    """Base for gates computed from k with per-kv-head weights created on first use.

    Subclasses define ``weights()`` (each with heads first) and ``compute(k, *weights)``;
    calling the module gives the gates of k, ``key_gate`` the same as a KeyGate."""

    per_query_head = False

    def forward(self, k: Tensor, heads: int, feature_dim: int) -> Tensor:
        if self.traced:
            return self.compute(k, *self._initial(k.shape[1], k.shape[-1], feature_dim, k.device))
        self._check(feature_dim)
        return self.compute(k, *self.weights())

    def key_gate(self, k: Tensor, heads: int, feature_dim: int) -> KeyGate:
        """The gates for query heads ``heads`` (each kv head's weights repeated to its group)."""
        if self.traced:
            weights = self._initial(k.shape[1], k.shape[-1], feature_dim, k.device)
        else:
            if self.lazy:
                if torch.compiler.is_compiling():
                    raise ValueError(
                        f"{type(self).__name__}: this gate's weights take their shapes from its first call, which "
                        "torch.compile cannot trace; build the mechanism with heads= and head_dim= (or call it once) "
                        "before compiling"
                    )
                self(k[:, :, :0], heads, feature_dim)  # materialise through the lazy-module hook
            self._check(feature_dim)
            weights = self.weights()
        group = heads // k.shape[1]
        return KeyGate(self.compute, tuple(w.repeat_interleave(group, dim=0) if group > 1 else w for w in weights))

    def _check(self, feature_dim: int) -> None:
        pass

    def weights(self) -> tuple[Tensor, ...]:
        """The weights, each with the heads first."""
        raise NotImplementedError

    def compute(self, k: Tensor, *weights: Tensor) -> Tensor:
        """The gates of k from ``weights`` (in the order of ``weights()``)."""
        raise NotImplementedError

    @property
    def lazy(self) -> bool:
        """True while the weights await their shapes from the first call (an isinstance
        test, which torch.compile traces; ``has_uninitialized_params`` it cannot)."""
        return any(isinstance(w, UninitializedParameter) for w in self.weights())

    def __init__(self, heads: int | None = None, head_dim: int | None = None, feature_dim: int | None = None):
        #: built while torch.compile traces (a mechanism given by name, made inside the
        #: compiled call): Dynamo can neither register the lazy-module hooks nor create
        #: parameters there, and nothing could train them once the call returns, so such
        #: a gate holds no weights and every call runs on the initial ones, made for it
        self.traced = torch.compiler.is_compiling()
        if self.traced:
            super(LazyModuleMixin, self).__init__()  # nn.Module only: no lazy-module hooks
            return
        super().__init__()
        self._declare()
        if heads is not None and head_dim is not None:
            self._materialize(heads, head_dim, head_dim if feature_dim is None else feature_dim, torch.device("cpu"))

    def initialize_parameters(self, k: Tensor, heads: int, feature_dim: int) -> None:
        if self.has_uninitialized_params():
            self._materialize(k.shape[1], k.shape[-1], feature_dim, k.device)

    def _declare(self) -> None:
        raise NotImplementedError

    def _initial(self, heads: int, head_dim: int, feature_dim: int, device) -> tuple[Tensor, ...]:
        """The initial weights, in the order of ``weights()``, in the default dtype."""
        raise NotImplementedError

    def _materialize(self, heads: int, head_dim: int, feature_dim: int, device) -> None:
        initial = self._initial(heads, head_dim, feature_dim, device)
        with torch.no_grad():
            for w, x in zip(self.weights(), initial):
                lazy = cast(UninitializedParameter, w)  # still awaiting its shape here
                lazy.materialize(x.shape, device=device)
                lazy.copy_(x)


def _dtype(k: Tensor) -> torch.dtype:
    """Gates are computed in float32, or float64 for float64 inputs."""
    return torch.float64 if k.dtype == torch.float64 else torch.float32


def _per_head(k: Tensor, w: Tensor) -> Tensor:
    """(B, H, N, D) x (H, D, R) -> (B, H, N, R), in the gate dtype. A broadcast matmul, not
    einsum: einsum would permute k into a copy and keep it for the backward pass."""
    dt = _dtype(k)
    return torch.matmul(k.to(dt), w.to(dt).unsqueeze(0))


class GLAGate(_KeyProjection):
    """Diagonal data-dependent gates (GLA, Yang et al. 2023, arXiv 2312.06635, Sec. 4.4):
    log α_t = logsigmoid(k_t W_1 W_2 + b) / τ, low rank 16 and τ = 16 as in the paper,
    which says τ pushes the forget rate towards 1. W_1 is random (Xavier, gain 2^-2.5 as
    in the authors' code), W_2 and b start at zero: α = 0.5^(1/16) ≈ 0.958 at start."""

    def __init__(
        self,
        rank: int = 16,
        tau: float = 16.0,
        heads: int | None = None,
        head_dim: int | None = None,
        feature_dim: int | None = None,
    ):
        self.rank, self.tau = rank, tau
        super().__init__(heads, head_dim, feature_dim)

    def _declare(self):
        self.down, self.up, self.bias = UninitializedParameter(), UninitializedParameter(), UninitializedParameter()

    def _initial(self, heads, head_dim, feature_dim, device):
        bound = 2**-2.5 * math.sqrt(6 / (head_dim + self.rank))
        down = torch.empty(heads, head_dim, self.rank, device=device).uniform_(-bound, bound)
        return down, torch.zeros(heads, self.rank, feature_dim, device=device), torch.zeros(heads, feature_dim, device=device)

    def weights(self):
        return self.down, self.up, self.bias

    def compute(self, k, down, up, bias):
        logits = _per_head(_per_head(k, down), up) + bias.to(_dtype(k))[:, None]
        return F.logsigmoid(logits) / self.tau

    def _check(self, feature_dim):
        if self.up.shape[-1] != feature_dim:
            raise ValueError(f"k: this GLA gate was built for {self.up.shape[-1]} feature rows, the call has {feature_dim}")

    def extra_repr(self):
        return f"rank={self.rank}, tau={self.tau}"


class MambaGate(_KeyProjection):
    """Scalar data-dependent decay of Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464),
    taken from Mamba-2: g_t = -exp(A_log) · softplus(k_t·w + dt_bias). Mamba-2 draws
    A ~ U[1, 16] and Δt ~ logU[0.001, 0.1] per head; here head h takes the (h + ½)/H
    quantile of each, so the heads span the same range deterministically; w starts at 0."""

    def _declare(self):
        self.weight, self.A_log, self.dt_bias = UninitializedParameter(), UninitializedParameter(), UninitializedParameter()

    def _initial(self, heads, head_dim, feature_dim, device):
        u = (torch.arange(heads, dtype=torch.float64) + 0.5) / heads
        a = 1 + 15 * u
        dt = torch.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3))).clamp_min(1e-4)
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(Δt)
        dtype = torch.get_default_dtype()
        return (
            torch.zeros(heads, head_dim, 1, device=device),
            torch.log(a).to(device=device, dtype=dtype),
            dt_bias.to(device=device, dtype=dtype),
        )

    def weights(self):
        return self.weight, self.A_log, self.dt_bias

    def compute(self, k, weight, A_log, dt_bias):
        dt = _dtype(k)
        step = F.softplus(_per_head(k, weight).squeeze(-1) + dt_bias.to(dt)[:, None])
        return -torch.exp(A_log.to(dt))[:, None] * step


class BetaGate(_KeyProjection):
    """Delta-rule strength β_t = σ(k_t·w) ∈ (0, 1) per head (DeltaNet, arXiv 2406.06484;
    Schlag et al. 2021, arXiv 2102.11174); w starts at 0, so β = ½ at start."""

    def _declare(self):
        self.weight = UninitializedParameter()

    def _initial(self, heads, head_dim, feature_dim, device):
        return (torch.zeros(heads, head_dim, 1, device=device),)

    def weights(self):
        return (self.weight,)

    def compute(self, k, weight):
        return torch.sigmoid(_per_head(k, weight).squeeze(-1))
