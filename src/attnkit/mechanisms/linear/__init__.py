"""The linear-attention family: feature maps, sum and delta rules, decays and gates.

    sum rule:    S_t = G_t ⊙ S_{t-1} + φ(k_t) v_tᵀ
    delta rule:  S_t = G_t ⊙ S_{t-1} + β_t φ(k_t) (v_t - (G_t ⊙ S_{t-1})ᵀ φ(k_t))ᵀ
    output:      o_t = φ(q_t)ᵀ S_t   (÷ φ(q_t)ᵀ z_t when normalised)

in four forms that agree (reference, parallel, chunked, recurrent), with first-class
states for decoding. Importing this package registers the named instances listed in
``NAMED`` (see docs/linear.md).
"""

from .feature_maps import (
    DPFP,
    FEATURE_MAPS,
    CosReweight,
    EluPlusOne,
    FAVORPlus,
    FeatureMap,
    Identity,
    L2Norm,
    ReLU,
    SiLU,
    SumNorm,
    Taylor2,
    feature_map,
)
from .gates import BetaGate, FixedDecay, GLAGate, MambaGate
from .instances import NAMED
from .mechanism import FORMS, LinearAttention
from .state import LinearState

__all__ = [
    "DPFP",
    "FEATURE_MAPS",
    "FORMS",
    "NAMED",
    "BetaGate",
    "CosReweight",
    "EluPlusOne",
    "FAVORPlus",
    "FeatureMap",
    "FixedDecay",
    "GLAGate",
    "Identity",
    "L2Norm",
    "LinearAttention",
    "LinearState",
    "MambaGate",
    "ReLU",
    "SiLU",
    "SumNorm",
    "Taylor2",
    "feature_map",
]
