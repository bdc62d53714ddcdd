"""``PooledSpanMass``: the attention mass each segment of a document receives from the
query rows an embedding is pooled from, per batch row, layer and head.

An embedding model reads its sentence vector off some rows (all tokens for mean pooling,
the first token for CLS pooling, the last for last-token pooling); the weights those rows
give the keys are how much each part of the document can reach the embedding. The
reflection-bias study of embedding models (permutation-based evaluation; "early tokens
receive more attention" in pooling-token embeddings) reads exactly this mass by segment
position. Fed tile by tile by the kernels: O(B N + B H S) state.
"""

from __future__ import annotations

import torch

from ..observe import CallInfo, Meter, TileView

Tensor = torch.Tensor


class PooledSpanMass(Meter):
    """``row_weights`` (B, N): how much each query row counts (e.g. 1/n on each real
    token for mean pooling, 1 on token 0 for CLS); ``key_segments`` (B, N) long: the
    segment (0 .. ``segments`` - 1) each key belongs to, -1 for keys in none.

    ``per_example()`` -> (B, L, H, S) float64: sum over rows of row weight x the row's
    weight on the segment's keys; layers in the order of ``layers_seen``."""

    name = "pooled"

    def __init__(self, row_weights: Tensor, key_segments: Tensor, segments: int, **restrict):
        super().__init__(**restrict)
        if not isinstance(row_weights, Tensor) or row_weights.dim() != 2 or not row_weights.is_floating_point():
            raise ValueError("row_weights: expected a float tensor (B, N), one weight per query row")
        if (
            not isinstance(key_segments, Tensor)
            or key_segments.shape != row_weights.shape
            or key_segments.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"key_segments: expected an integer tensor of shape {tuple(row_weights.shape)} (one segment per key)"
            )
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments: expected an int >= 1, got {segments!r}")
        if bool((key_segments < -1).any()) or bool((key_segments >= segments).any()):
            raise ValueError(f"key_segments: expected values in [-1, {segments}), -1 for a key in no segment")
        self.row_weights = row_weights.double()
        # Keys outside every segment go to an extra bucket that is dropped at the end.
        self.key_segments = torch.where(key_segments < 0, segments, key_segments).long()
        self.segments = segments
        self._mass: dict = {}  # layer -> (B, H, S + 1)

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        if (call.batch, call.k_len) != tuple(self.row_weights.shape):
            raise ValueError(
                f"row_weights: given for {tuple(self.row_weights.shape)} (B, N), but layer {call.layer}'s call "
                f"has {call.batch} rows of {call.k_len} keys"
            )
        self._mass.setdefault(call.layer, torch.zeros(call.batch, n_heads, self.segments + 1, dtype=torch.float64))

    def update_view(self, call: CallInfo, view: TileView) -> None:
        q0, q1 = int(view.q_pos[0]), int(view.q_pos[-1]) + 1
        rows = self.row_weights[view.batch, q0:q1]  # (Bt, R)
        if not bool((rows != 0).any()):
            return
        columns = torch.einsum("bhrk,br->bhk", view.w.double(), rows)  # (Bt, H, span)
        segment = self.key_segments[view.batch, view.k0 : view.k0 + view.w.shape[3]]  # (Bt, span)
        index = segment.unsqueeze(1).expand(-1, columns.shape[1], -1)
        self._mass[call.layer][view.batch].scatter_add_(2, index, columns)

    @property
    def layers_seen(self) -> list:
        return sorted(self._mass, key=lambda x: -1 if x is None else x)

    def per_example(self) -> Tensor:
        """(B, L, H, S): pooled mass on each segment."""
        return torch.stack([self._mass[layer][..., : self.segments] for layer in self.layers_seen], dim=1)

    def rows(self):
        out = []
        for layer, heads, _ in self.measured():
            mean = self._mass[layer][..., : self.segments].mean(0)  # (H, S)
            for j, h in enumerate(heads):
                out += [(layer, h, f"pooled.segment{s}", float(mean[j, s])) for s in range(self.segments)]
        return out
