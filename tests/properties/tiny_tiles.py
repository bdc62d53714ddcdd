"""Run the public API's chunked backend with tiny tiles, so small inputs cross many
query blocks, key tiles, masked, skipped and causal-diagonal tiles."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from attnkit.kernels import BACKENDS, Tiling, chunked_attention
from attnkit.kernels.chunked import fused_unsupported

SMALL = Tiling(
    fused_q_block=8,
    fused_q_block_large=16,
    fused_q_block_bias=8,
    fused_k_block=4,
    fused_max_masked_span=12,
    tiled_q_block=8,
    tiled_k_block=4,
    tiled_tile_k=8,
    single_tile=0,
)


@contextmanager
def tiny_tiles(engine: str | None = None):
    """Inside: ``backend="chunked"`` (and "auto" when it picks chunked) uses ``SMALL`` and
    the given engine ("fused" where the call allows it, else the automatic choice)."""
    saved = BACKENDS["chunked"]

    def run(req):
        chosen = engine if engine != "fused" or fused_unsupported(req) is None else None
        return chunked_attention(req, engine=chosen, tiling=SMALL)

    BACKENDS["chunked"] = replace(saved, run=run)
    try:
        yield
    finally:
        BACKENDS["chunked"] = saved
