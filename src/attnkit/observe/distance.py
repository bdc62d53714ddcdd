"""Where attention lands by distance: mass by |i - j| in log-spaced bins, and the mean.

Local heads (previous-token, n-gram) put their mass in the first bins, long-range heads
in the last; the profile is the "attention distance" of Vig & Belinkov 2019 (arXiv
1906.04284) and Dosovitskiy et al. 2020 (arXiv 2010.11929), kept as a histogram so two
profiles can be compared (``attnkit.inspection.compare``: KL between them).
"""

from __future__ import annotations

import bisect

import torch

from .base import CallInfo
from .meter import Meter, TileView

# [0, 1), [1, 2), [2, 4), [4, 8), ...: distance 0 (the query's own key) and 1 (its
# neighbour) alone, then octaves. 2^40 stands for "no upper end".
LOG2_EDGES = (0,) + tuple(2**i for i in range(41))
_BIG = 1 << 50


def bin_label(lo: int, hi: int | None) -> str:
    """``0``, ``2-3``, ``64+``: the distances a bin [lo, hi) holds."""
    if hi is None:
        return f"{lo}+"
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def parse_bin_label(label: str) -> tuple[int, int | None]:
    """Inverse of ``bin_label``: (lo, hi) with hi exclusive, None when unbounded."""
    if label.endswith("+"):
        return int(label[:-1]), None
    lo, _, last = label.partition("-")
    return int(lo), int(last or lo) + 1


class DistanceProfile(Meter):
    """Per head: ``distance.<bin>``, the mean mass a query puts on keys at |i - j| in each
    bin, and ``distance.mean``, the mean attention-weighted distance. ``edges`` are the
    bins' lower ends (ints, starting at 0, increasing; the last bin has no upper end);
    the default is 0, 1, 2, 4, 8, ... Bins beyond the largest distance seen are not
    reported."""

    name = "distance"

    def __init__(self, edges=None, **restrict):
        super().__init__(**restrict)
        if edges is None:
            edges = LOG2_EDGES
        edges = tuple(edges)
        if (
            not edges
            or edges[0] != 0
            or any(not isinstance(e, int) or isinstance(e, bool) for e in edges)
            or any(b <= a for a, b in zip(edges, edges[1:]))
        ):
            raise ValueError(f"edges: expected increasing ints starting at 0 (lower ends of the distance bins), got {edges!r}")
        self.edges = edges
        self._his = edges[1:] + (_BIG,)
        self._state: dict = {}
        self._max_distance = 0

    def bin_of(self, d: int) -> int:
        return bisect.bisect_right(self.edges, d) - 1

    def bins(self) -> list[tuple[int, int | None]]:
        """(lo, hi) of the bins reported: up to the one holding the largest distance seen."""
        last = self.bin_of(self._max_distance)
        return [(self.edges[b], None if b + 1 == len(self.edges) else self.edges[b + 1]) for b in range(last + 1)]

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        self._max_distance = max(self._max_distance, call.k_len - 1)
        if call.layer not in self._state:
            self._state[call.layer] = {
                "bins": torch.zeros(len(self.edges), n_heads, dtype=torch.float64),
                "dist": torch.zeros(n_heads, dtype=torch.float64),
            }

    def update_view(self, call: CallInfo, view: TileView) -> None:
        st = self._state[call.layer]
        w = view.w
        rows, span = w.shape[2], w.shape[3]
        p0, p1 = int(view.q_pos[0]), int(view.q_pos[-1])
        k0, k1 = view.k0, view.k0 + span - 1
        one_sided = k1 < p0 or k0 > p1
        d_min = 0 if not one_sided else (k0 - p1 if k0 > p1 else p0 - k1)
        b_lo, b_hi = self.bin_of(d_min), self.bin_of(max(p1 - k0, k1 - p0))
        if one_sided:
            # all keys on one side of all queries: sum w |p - k| = +-(sum_r p_r S_r - sum_k k C_k)
            # from row sums S and column sums C, without a distance matrix
            side = 1.0 if k1 < p0 else -1.0
            by_row = (w.sum(-1).double() * view.q_pos.double()).sum((0, 2))  # float64: the two
            by_key = (w.sum(2).double() * view.k_pos.double()).sum((0, 2))  # terms nearly cancel
            st["dist"] += side * (by_row - by_key)
        else:
            dist = (torch.arange(rows).view(-1, 1) + (p0 - k0) - torch.arange(span).view(1, -1)).abs().to(w.dtype)
            st["dist"] += (w * dist).sum(-1).double().sum((0, 2))  # rows of large terms: float64 across rows
        if b_lo == b_hi:  # the whole tile sits in one bin: common far from the diagonal
            st["bins"][b_lo] += w.sum((0, 2, 3)).double()
            return
        # Per row, the keys of a bin form two contiguous runs (left and right of the
        # query): masses are differences of the row's cumulative sum at the run ends.
        cs = w.cumsum(-1)
        lo = torch.tensor(self.edges[b_lo : b_hi + 1]).view(1, -1)
        hi = torch.tensor(self._his[b_lo : b_hi + 1]).view(1, -1)
        p = view.q_pos.view(-1, 1) - k0
        cuts = torch.cat([p - hi + 1, p - lo + 1, p + lo.clamp_min(1), (p + hi).maximum(p + lo.clamp_min(1))], dim=1).clamp(
            0, span
        )
        # the sum of the first c weights of a row is cs[c - 1], and 0 for c = 0
        g = cs.gather(-1, (cuts - 1).clamp_min(0).expand(*w.shape[:2], *cuts.shape)) * (cuts > 0)
        nb = b_hi - b_lo + 1
        mass = (g[..., nb : 2 * nb] - g[..., :nb]) + (g[..., 3 * nb :] - g[..., 2 * nb : 3 * nb])
        st["bins"][b_lo : b_hi + 1] += mass.sum((0, 2)).double().T

    def rows(self):
        bins = self.bins()
        out = []
        for layer, heads, n_rows in self.measured():
            st = self._state[layer]
            dist, masses = st["dist"].tolist(), st["bins"].T.tolist()
            for j, h in enumerate(heads):
                out.append((layer, h, "distance.mean", dist[j] / n_rows))
                for b, (lo, hi) in enumerate(bins):
                    out.append((layer, h, f"distance.{bin_label(lo, hi)}", masses[j][b] / n_rows))
        return out

    def meta(self) -> dict:
        return {"bins": [bin_label(lo, hi) for lo, hi in self.bins()]}
