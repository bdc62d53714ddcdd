"""Meters that probes need per example: attention mass from the answer's query rows
onto a span of each prompt, and each decoding row's top key per head.

``observe.SpanMass`` averages over the batch; a needle grid needs one value per prompt
(each prompt has its needle somewhere else), so these keep the batch dimension. Both
are fed by the kernels tile by tile (O(N) memory) like every attnkit meter, and take
query positions from ``q_lo`` on (in a left-padded batch: the last prompt row and
every generated row).
"""

from __future__ import annotations

import math

import torch

from ..observe import CallInfo, Meter, TileView

Tensor = torch.Tensor


class RowSpanMass(Meter):
    """Per batch row, layer and head: the mean mass that query rows at positions >=
    ``q_lo`` put on each named span, where every batch row has its own (start, end) key
    range: ``spans = {"needle": [(s0, e0), (s1, e1), ...]}``, one range per batch row.

    ``per_example(name)`` -> (B, L, H) float64, layers in the order of ``layers_seen``."""

    name = "rowspan"

    def __init__(self, spans: dict[str, list[tuple[int, int]]], q_lo: int, **restrict):
        super().__init__(queries=(q_lo, None), **restrict)
        if not isinstance(spans, dict) or not spans:
            raise ValueError(f"spans: expected {{name: [(start, end) per batch row]}}, got {spans!r}")
        widths = {len(v) for v in spans.values()}
        if len(widths) != 1:
            raise ValueError("spans: every span needs one (start, end) per batch row")
        for name, ranges in spans.items():
            for a, b in ranges:
                if not 0 <= a < b:
                    raise ValueError(f"spans: {name!r} has an empty or negative range ({a}, {b})")
        self.spans = {k: [(int(a), int(b)) for a, b in v] for k, v in spans.items()}
        self.batch = widths.pop()
        self._mass: dict = {}  # layer -> (S, B, H) summed over rows
        self._count: dict = {}  # layer -> (B,) query rows counted per batch row
        # Batch rows still answering: a row that has finished (its end-of-sequence token is
        # out) keeps being decoded while the rest of its batch answers, and those rows are
        # not part of its answer, so they are not counted (its mass does not depend on the
        # prompts it was batched with).
        self.active = torch.ones(self.batch, dtype=torch.bool)

    def set_active(self, active) -> None:
        """Count only the batch rows where ``active`` (B bools) is true from the next call on
        (``greedy_generate`` calls it when rows reach their end-of-sequence token)."""
        active = torch.as_tensor(active, dtype=torch.bool).flatten()
        if active.shape[0] != self.batch:
            raise ValueError(f"active: expected {self.batch} flags (one per batch row), got {active.shape[0]}")
        self.active = active.clone()

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        if call.batch != self.batch:
            raise ValueError(f"spans: ranges for {self.batch} batch rows, but layer {call.layer}'s call has {call.batch}")
        self._mass.setdefault(call.layer, torch.zeros(len(self.spans), call.batch, n_heads, dtype=torch.float64))
        count = self._count.setdefault(call.layer, torch.zeros(call.batch, dtype=torch.float64))
        count += self.active.double() * (row_hi - row_lo)

    def update_view(self, call: CallInfo, view: TileView) -> None:
        mass = self._mass[call.layer]
        k0, width = view.k0, view.w.shape[3]
        rows = range(view.batch.start, view.batch.stop)
        for i, ranges in enumerate(self.spans.values()):
            for j, b in enumerate(rows):
                if not self.active[b]:
                    continue
                a, e = ranges[b]
                lo, hi = max(a - k0, 0), min(e - k0, width)
                if lo < hi:
                    mass[i, b] += view.w[j, :, :, lo:hi].sum((1, 2)).double()

    def rows_per_layer(self, layer) -> torch.Tensor:
        """(B,): the query rows counted for each batch row at ``layer``."""
        return self._count[layer]

    @property
    def layers_seen(self) -> list:
        return sorted(self._mass, key=lambda x: -1 if x is None else x)

    def per_example(self, name: str) -> Tensor:
        """(B, L, H): mean over the observed query rows of the mass on span ``name``."""
        i = list(self.spans).index(name)
        return torch.stack(
            [self._mass[layer][i] / self.rows_per_layer(layer).clamp_min(1)[:, None] for layer in self.layers_seen], dim=1
        )

    def rows(self):
        out = []
        for layer, heads, _ in self.measured():
            n = self.rows_per_layer(layer).clamp_min(1)[:, None]
            for i, name in enumerate(self.spans):
                mean = (self._mass[layer][i] / n).mean(0).tolist()
                out += [(layer, h, f"rowspan.{name}", mean[j]) for j, h in enumerate(heads)]
        return out


class StepTopKey(Meter):
    """For every observed query row (positions >= ``q_lo``), the key each head attends to
    most: ``top_keys(layer)`` -> (B, H, R) key positions (-1 where a row saw no key), rows in
    position order over all calls (a prefill row, then one per decoding step)."""

    name = "steptop"

    def __init__(self, q_lo: int, **restrict):
        super().__init__(queries=(q_lo, None), **restrict)
        self._calls: dict = {}  # layer -> list of (B, H, R) index tensors

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        shape = (call.batch, n_heads, row_hi - row_lo)
        self._best = torch.full(shape, -math.inf, dtype=torch.float64)
        self._where = torch.full(shape, -1, dtype=torch.long)

    def update_view(self, call: CallInfo, view: TileView) -> None:
        value, index = view.w.max(dim=-1)
        at = (view.batch, slice(None), view.rows)
        better = (value.double() > self._best[at]) & (value > 0)
        self._best[at] = torch.where(better, value.double(), self._best[at])
        self._where[at] = torch.where(better, index + view.k0, self._where[at])

    def end_call(self, call: CallInfo) -> None:
        self._calls.setdefault(call.layer, []).append(self._where)
        del self._best, self._where

    def top_keys(self, layer) -> Tensor:
        return torch.cat(self._calls[layer], dim=2)

    @property
    def layers_seen(self) -> list:
        return sorted(self._calls, key=lambda x: -1 if x is None else x)

    def rows(self):
        return []
