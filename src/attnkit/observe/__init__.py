"""Observers of attention: meters fed tile by tile by the kernels, O(N) memory.

A meter never sees the N x N matrix: kernels hand it tiles of normalised weights
(``AttentionTile``) and it keeps small running state. See ``base.py`` for the protocol
and ``meter.py`` for what every meter shares (restriction to layers, heads, queries).

    meters = [SinkMass(), Entropy(), DistanceProfile(), LogitStats(), TopKeys(k=8)]
    attnkit.attention(q, k, v, mask=attnkit.causal(), observers=meters, layer=0)
    rows = [r for m in meters for r in m.rows()]   # (layer, head, metric, value)
"""

from .base import AttentionTile, CallInfo, Observer, Selection, feed, interested
from .classify import LABELS, HeadClass, classify_heads
from .distance import DistanceProfile
from .entropy import Entropy
from .logits import LogitStats
from .meter import TOKEN_VIEW_LIMIT, Meter, TileView
from .sinks import SinkMass
from .spans import SpanMass
from .topkeys import TopKeys
from .visual import VisualAttention

#: meters by the names the CLI and ``attnkit.inspect(meters=[...])`` accept
METERS = {
    "sink": SinkMass,
    "entropy": Entropy,
    "distance": DistanceProfile,
    "logits": LogitStats,
    "topkeys": TopKeys,
    "spans": SpanMass,
}
# VisualAttention needs the image keys, so it is built by attnkit.vision, not by name.

__all__ = [
    "AttentionTile",
    "CallInfo",
    "DistanceProfile",
    "Entropy",
    "HeadClass",
    "LABELS",
    "LogitStats",
    "METERS",
    "Meter",
    "Observer",
    "Selection",
    "SinkMass",
    "SpanMass",
    "TOKEN_VIEW_LIMIT",
    "TileView",
    "TopKeys",
    "VisualAttention",
    "classify_heads",
    "feed",
    "interested",
]
