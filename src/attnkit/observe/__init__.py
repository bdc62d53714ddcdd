"""Observers of attention: meters fed tile by tile by the kernels, O(N) memory.

A meter never sees the N x N matrix: kernels hand it tiles of normalised weights
(``AttentionTile``) and it keeps small running state. See ``base.py`` for the protocol.
"""

from .base import AttentionTile, CallInfo, Observer, feed

__all__ = ["AttentionTile", "CallInfo", "Observer", "feed"]
