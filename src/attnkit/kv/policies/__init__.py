"""The KV-cache policies, by name."""

from .adakv import AdaKV
from .base import Policy, Step
from .h2o import H2O
from .knorm import KNorm
from .pyramid import PyramidKV
from .quest import Quest, page_bounds, page_extremes, page_mask
from .selective import Selective
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Streaming, H2O, SnapKV, TOVA, Quest, PyramidKV, AdaKV, KNorm, Selective)}

__all__ = [
    "POLICIES",
    "AdaKV",
    "H2O",
    "KNorm",
    "Policy",
    "PyramidKV",
    "Quest",
    "Selective",
    "SnapKV",
    "Step",
    "Streaming",
    "TOVA",
    "page_bounds",
    "page_extremes",
    "page_mask",
]
