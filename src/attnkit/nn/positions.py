"""Position information: RoPE and its context-extension variants, ALiBi, NoPE, learned.

- RoPE (Su et al. 2021, arXiv 2104.09864): rotate pairs of q/k dims by angle
  ``position * theta_i``, ``theta_i = base^(-2i/d)``; "rotate half" pairing (dim i with
  i + d/2, as GPT-NeoX and Llama). ``rotary_dim < head_dim`` rotates only the first
  ``rotary_dim`` dims (partial rotary, GPT-NeoX / Phi).
- Scaling for contexts longer than training (``RopeScaling``):
  ``linear`` position interpolation, positions divided by the factor (Chen et al. 2023,
  arXiv 2306.15595); ``ntk`` NTK-aware base change ``base * s^(d/(d-2))`` (bloc97 2023,
  as written in the YaRN paper); ``yarn`` NTK-by-parts interpolation plus the attention
  temperature ``0.1 ln s + 1`` on q and k (Peng et al. 2023, arXiv 2309.00071; the ramp
  over dims with floor/ceil correction range is the authors' reference code).
- ALiBi (Press et al. 2021, arXiv 2108.12409) is a score mod: ``attnkit.alibi(n_heads)``.
- NoPE: nothing at all (Kazemnejad et al. 2023, arXiv 2305.19466).
- Learned absolute positions (GPT-2): ``LearnedPositions``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

Tensor = torch.Tensor

POSITIONS = ("rope", "alibi", "nope", "learned")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is stretched past the training context.

    kind: "linear", "ntk" or "yarn". factor: s = new context / original context.
    original_max_len: the training context (needed by yarn). beta_fast / beta_slow:
    yarn's rotation counts bounding the interpolated band. truncate: yarn's floor/ceil
    of the band edges. attention_factor: override of yarn's 0.1 ln s + 1."""

    kind: str
    factor: float
    original_max_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ("linear", "ntk", "yarn"):
            raise ValueError(f"rope scaling kind: expected 'linear', 'ntk' or 'yarn', got {self.kind!r}")
        if not (isinstance(self.factor, (int, float)) and self.factor >= 1):
            raise ValueError(f"rope scaling factor: expected a number >= 1, got {self.factor!r}")
        if self.kind == "yarn" and not (isinstance(self.original_max_len, int) and self.original_max_len > 0):
            raise ValueError(
                f"rope scaling original_max_len: yarn needs the training context length, got {self.original_max_len!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def rope_frequencies(rotary_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None) -> tuple[Tensor, float]:
    """(inverse frequencies theta_i (rotary_dim/2,) float64, attention factor on q and k)."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number >= 2, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    if scaling is not None and scaling.kind == "ntk":
        base = base * scaling.factor ** (rotary_dim / (rotary_dim - 2))
    inv_freq = base**-exponents
    if scaling is None or scaling.kind == "ntk":
        return inv_freq, 1.0
    s = float(scaling.factor)
    if scaling.kind == "linear":
        return inv_freq / s, 1.0

    # YaRN: dims that turn fewer than beta_slow times over the training context are
    # interpolated (theta / s), those that turn more than beta_fast times are kept, with a
    # linear ramp over the dim index in between.
    original_max_len = scaling.original_max_len
    assert original_max_len is not None  # RopeScaling.__post_init__: yarn has it

    def band_edge(rotations: float) -> float:
        return rotary_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = band_edge(scaling.beta_fast), band_edge(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / s * ramp + inv_freq * (1 - ramp)
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    return inv_freq, float(factor)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to q or k of shape (B, H, N, head_dim).

    Args:
        head_dim: size of each head.
        rotary_dim: how many leading dims rotate (even; default all: full rotary).
        base: theta base (10000 in the paper).
        scaling: a RopeScaling (or its dict) for context extension; None for plain RoPE.
    """

    inv_freq: Tensor  # a buffer

    def __init__(
        self, head_dim: int, rotary_dim: int | None = None, base: float = 10000.0, scaling: RopeScaling | dict | None = None
    ):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (isinstance(rotary_dim, int) and 2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim: expected an even int in [2, head_dim={head_dim}], got {rotary_dim!r}")
        if isinstance(scaling, dict):
            scaling = RopeScaling(**scaling)
        self.head_dim, self.rotary_dim, self.base, self.scaling = head_dim, rotary_dim, float(base), scaling
        inv_freq, self.attention_factor = rope_frequencies(rotary_dim, base, scaling)
        # Derived from the arguments, so not saved with the weights.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of shape (N, rotary_dim) or (B, 1, N, rotary_dim) for (N,) or (B, N) positions."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(work)[..., None] * self.inv_freq.to(work)
        angles = torch.cat((angles, angles), dim=-1)
        if positions.dim() == 2:
            angles = angles[:, None]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x: expected (B, H, N, head_dim={self.head_dim}), got {tuple(x.shape)}")
        if positions.dim() not in (1, 2) or positions.shape[-1] != x.shape[2] or positions.is_floating_point():
            raise ValueError(
                f"positions: expected integer positions of shape (N,) or (B, N) with N={x.shape[2]}, got {tuple(positions.shape)}"
            )
        cos, sin = self.cos_sin(positions, x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        work = cos.dtype
        out = (rot.to(work) * cos + rotate_half(rot.to(work)) * sin).to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def extra_repr(self) -> str:
        extra = "" if self.scaling is None else f", scaling={self.scaling.kind} x{self.scaling.factor:g}"
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}{extra}"


class LearnedPositions(nn.Module):
    """Learned absolute position embeddings added to the token embeddings (GPT-2)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, positions: Tensor) -> Tensor:
        if int(positions.max()) >= self.max_len or int(positions.min()) < 0:
            raise ValueError(
                f"positions: learned positions cover 0..{self.max_len - 1}, got positions up to {int(positions.max())}"
            )
        return self.weight[positions]
