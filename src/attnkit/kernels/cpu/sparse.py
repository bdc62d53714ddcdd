"""Python side of sparse.cpp: Native Sparse Attention's inference forward (arXiv
2502.11089) in three C++ passes, float32 CPU tensors."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def nsa_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    gates: Tensor,
    scale: float,
    *,
    compress_block: int,
    compress_stride: int,
    select_block: int,
    width: int,
    initial: int,
    local: int,
    window: int,
    rescale_above: float,
    select_chunk: int,
    tile_rows: int,
    span_rows: int,
    window_block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q (B, Hq, Nq, D) are the last Nq of the Nk positions of k (B, Hkv, Nk, D) and v (B,
    Hkv, Nk, Dv); k_cmp, v_cmp (B, Hkv, Ncmp, D|Dv) the compressed blocks; gates (B, Hq, Nq,
    3) the branch gates. Three passes add into one output: the scoring pass with the
    compression branch (queries in chunks of ``select_chunk``), the selection branch by
    key block (spans of ``span_rows`` (query, head) rows, tiles of ``tile_rows``; a row's
    reference rises only for a block more than ``rescale_above`` above it), the sliding
    window (blocks of ``window_block`` queries). Returns (out (B, Hq, Nq, Dv), chosen
    blocks (B, Hkv, Nq, width) int64 with -1 for empty slots, and the lse (B, Hq, Nq) of
    the compression, selection and window branches)."""
    return torch.ops.attnkit.nsa_forward(
        q,
        k,
        v,
        k_cmp,
        v_cmp,
        gates,
        scale,
        compress_block,
        compress_stride,
        select_block,
        width,
        initial,
        local,
        window,
        rescale_above,
        select_chunk,
        tile_rows,
        span_rows,
        window_block,
    )


def register() -> None:
    """The fake kernel, for torch.compile."""

    @torch.library.register_fake("attnkit::nsa_forward")
    def _(q, k, v, k_cmp, v_cmp, gates, scale, compress_block, compress_stride, select_block, width, *rest):
        rows = q.shape[:3]
        return (
            q.new_empty(*rows, v.shape[-1]),
            q.new_empty(q.shape[0], k.shape[1], q.shape[2], width, dtype=torch.int64),
            q.new_empty(rows),
            q.new_empty(rows),
            q.new_empty(rows),
        )
