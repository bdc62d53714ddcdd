"""The named linear-attention mechanisms: presets of LinearAttention, one per paper.

Every keyword of LinearAttention still applies and overrides the preset, e.g.
``get_mechanism("based", short_conv=3)`` or ``get_mechanism("dpfp", feature_map=DPFP(3))``.
"""

from __future__ import annotations

from typing import ClassVar

from ..base import register
from .feature_maps import DPFP, CosReweight, FAVORPlus, L2Norm, SiLU, SumNorm
from .mechanism import LinearAttention


class _Preset(LinearAttention):
    defaults: ClassVar[dict] = {}

    def __init__(self, **overrides):
        super().__init__(**{**self.defaults_now(), **overrides})

    @classmethod
    def defaults_now(cls) -> dict:
        # Fresh feature-map objects per instance (FAVOR+ caches its projection).
        return {key: value() if callable(value) else value for key, value in cls.defaults.items()}


@register("linear_elu")
class LinearElu(_Preset):
    """Transformers are RNNs (Katharopoulos et al. 2020): φ = elu + 1, normalised."""

    paper = "arXiv:2006.16236"
    defaults: ClassVar[dict] = {"feature_map": "elu+1", "normalize": True}


@register("linear_relu")
class LinearReLU(_Preset):
    """φ = ReLU, normalised (the ReLU kernel studied alongside elu+1, e.g. cosFormer's baseline)."""

    paper = "arXiv:2202.08791"
    defaults: ClassVar[dict] = {"feature_map": "relu", "normalize": True}


@register("dpfp")
class DPFPAttention(_Preset):
    """Linear attention with the DPFP-ν feature map (Schlag et al. 2021), normalised; nu=1."""

    paper = "arXiv:2102.11174"
    defaults: ClassVar[dict] = {"feature_map": lambda: DPFP(1), "normalize": True}


@register("based")
class Based(_Preset):
    """Based (Arora et al. 2024): second-order Taylor features of exp(scale·q·k), normalised.
    The paper projects q and k to 16 dims first (273 features); add ``short_conv`` for the
    convolution its mixer puts in front."""

    paper = "arXiv:2402.18668"
    defaults: ClassVar[dict] = {"feature_map": "taylor2", "normalize": True}


@register("performer")
class Performer(_Preset):
    """Performer FAVOR+ (Choromanski et al. 2020): positive orthogonal random features,
    an unbiased estimate of softmax attention; normalised."""

    paper = "arXiv:2009.14794"
    defaults: ClassVar[dict] = {"feature_map": lambda: FAVORPlus(), "normalize": True}


@register("cosformer")
class CosFormer(_Preset):
    """cosFormer (Qin et al. 2022): ReLU features re-weighted by cos(π/2·(i-j)/M), normalised.

    ``context`` fixes the horizon M (same as ``feature_map=CosReweight(context)``): then
    every call — a prefix, the full sequence, cached or stateful decoding — re-weights a
    pair at distance i - j the same way. Without it M is the length of each call (the
    paper's choice), so a prefix call differs from the full call's rows and calls with
    states are refused. ``attnkit.hf.use`` passes the config's ``max_position_embeddings``
    and ``attnkit.nn.TransformerLM`` its ``max_len``."""

    paper = "arXiv:2202.08791"
    defaults: ClassVar[dict] = {"feature_map": lambda: CosReweight(), "normalize": True}

    def __init__(self, context: int | None = None, **overrides):
        if context is not None:
            if isinstance(context, bool) or not isinstance(context, int) or context < 1:
                raise ValueError(f"cosformer(context): expected an int >= 1 (the horizon M) or None, got {context!r}")
            overrides.setdefault("feature_map", CosReweight(context))
        super().__init__(**overrides)


@register("fast_weight")
class FastWeight(_Preset):
    """Linear Transformers are Secretly Fast Weight Programmers (Schlag et al. 2021): the
    delta rule on sum-normalised DPFP-1 features with a learned β = σ(w·k), unnormalised."""

    paper = "arXiv:2102.11174"
    defaults: ClassVar[dict] = {"feature_map": lambda: SumNorm(DPFP(1)), "rule": "delta", "beta": "learned"}


@register("deltanet")
class DeltaNet(_Preset):
    """DeltaNet (Yang et al. 2024): the delta rule on L2-normalised SiLU features, learned β."""

    paper = "arXiv:2406.06484"
    defaults: ClassVar[dict] = {"feature_map": lambda: L2Norm(SiLU()), "rule": "delta", "beta": "learned"}


@register("retnet")
class RetNet(_Preset):
    """Retention (Sun et al. 2023): (QKᵀ ⊙ D)V with fixed per-head decays γ_h = 1 - 2^(-5-h),
    unnormalised (the paper's GroupNorm on the output follows the mechanism)."""

    paper = "arXiv:2307.08621"
    defaults: ClassVar[dict] = {"decay": "retnet"}


@register("lightning")
class Lightning(_Preset):
    """Lightning Attention-2 (Qin et al. 2024): unnormalised linear attention with fixed
    per-head decays λ_h = exp(-s_h), s the ALiBi slopes."""

    paper = "arXiv:2401.04658"
    defaults: ClassVar[dict] = {"decay": "lightning"}


@register("gla")
class GLA(_Preset):
    """Gated Linear Attention (Yang et al. 2023): diagonal data-dependent decays
    α_t = σ(k_t W_1 W_2 + b)^(1/16) computed from the keys, unnormalised."""

    paper = "arXiv:2312.06635"
    defaults: ClassVar[dict] = {"decay": "gla"}


@register("gated_deltanet")
class GatedDeltaNet(_Preset):
    """Gated DeltaNet (Yang et al. 2024): the delta rule on L2-normalised SiLU features with a
    learned β and a Mamba-2 scalar decay, both computed from the keys."""

    paper = "arXiv:2412.06464"
    defaults: ClassVar[dict] = {"feature_map": lambda: L2Norm(SiLU()), "rule": "delta", "beta": "learned", "decay": "mamba2"}


NAMED = (
    "linear",
    "linear_elu",
    "linear_relu",
    "dpfp",
    "based",
    "performer",
    "cosformer",
    "fast_weight",
    "deltanet",
    "retnet",
    "lightning",
    "gla",
    "gated_deltanet",
)
