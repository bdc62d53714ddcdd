"""Attention layers and a small decoder built on attnkit's mechanisms.

layer = attnkit.nn.Attention(256, 8, n_kv_heads=2, rope=True, mechanism="softmax")
model = attnkit.nn.TransformerLM(attnkit.nn.TransformerConfig(vocab_size=256, mechanism=["softmax", "gla"]))
"""

from .attention import Attention, build_mechanism
from .cache import Cache, LayerCache
from .mla import LatentAttention, LatentConfig
from .positions import POSITIONS, LearnedPositions, RopeScaling, RotaryEmbedding, rope_frequencies
from .transformer import Block, SwiGLU, TransformerConfig, TransformerLM

__all__ = [
    "Attention",
    "Block",
    "Cache",
    "LatentAttention",
    "LatentConfig",
    "LayerCache",
    "LearnedPositions",
    "POSITIONS",
    "RopeScaling",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerConfig",
    "TransformerLM",
    "build_mechanism",
    "rope_frequencies",
]
