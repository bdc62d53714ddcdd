"""``attnkit.steer``: training-free interventions on attention, applied through attnkit's
attention function (score mods and output transforms inside the kernels, never a
materialised attention matrix).

    with attnkit.steer.apply(model, steer.emphasize([(3, 7)], {1: [0, 2]}, alpha=0.01)):
        out = model(ids)
"""

from .apply import Steering, apply
from .base import Intervention
from .calibrate import PositionCalibration, calibrate_positions
from .contrastive import contrastive_generate, inducing_heads
from .emphasize import Emphasize, emphasize
from .head_ops import Ablate, Disperse, Scale, Temperature, ablate, disperse, scale, temperature
from .prune import LayerPruning, coupling_scores, prune_layers
from .registry import INTERVENTIONS, register_intervention
from .rerank import rerank
from .selection import HeadRanking, profile_heads, rank_heads
from .targets import resolve_heads
from .visual import (
    AblateVisual,
    AmplifyVisual,
    CalibrateVisual,
    HoldVisual,
    ablate_visual,
    amplify_visual,
    calibrate_visual,
    hold_visual,
)

__all__ = [
    "apply",
    "Steering",
    "Intervention",
    "resolve_heads",
    "INTERVENTIONS",
    "register_intervention",
    "emphasize",
    "Emphasize",
    "ablate",
    "Ablate",
    "scale",
    "Scale",
    "temperature",
    "Temperature",
    "disperse",
    "Disperse",
    "contrastive_generate",
    "inducing_heads",
    "calibrate_positions",
    "PositionCalibration",
    "prune_layers",
    "LayerPruning",
    "coupling_scores",
    "rerank",
    "rank_heads",
    "profile_heads",
    "HeadRanking",
    "amplify_visual",
    "AmplifyVisual",
    "calibrate_visual",
    "CalibrateVisual",
    "hold_visual",
    "HoldVisual",
    "ablate_visual",
    "AblateVisual",
]
