"""``TargetMass``: per layer and head, the mean weight each query row puts on its own
small set of target keys, fed tile by tile by the kernels (O(B N T) state, no N x N).

The head detectors of TransformerLens (previous-token, duplicate-token, induction; the
induction pattern of Olsson et al. 2022, arXiv 2209.11895) all read one number per
query row: the attention it pays to a few keys chosen by the row's position and the
tokens around it. Those keys are given here as an index tensor per name,
``targets[name]`` of shape (B, N, T): for batch row b and query position q, up to T key
positions (-1 for an unused slot). A tile of keys [k0, k0 + span) contributes the
weights of the targets that fall inside it, gathered from the tile, so the meter never
needs a column outside the tile it is handed.
"""

from __future__ import annotations

import torch

from ..observe import CallInfo, Meter, TileView

Tensor = torch.Tensor


def _check_targets(targets) -> dict[str, Tensor]:
    if not isinstance(targets, dict) or not targets:
        raise ValueError(
            f"targets: expected {{name: (B, N, T) tensor of key positions, -1 for none}}, got {type(targets).__name__}"
        )
    shapes = set()
    out = {}
    for name, t in targets.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"targets: names must be non-empty strings, got {name!r}")
        if not isinstance(t, Tensor) or t.dim() != 3 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"targets: {name!r} must be an integer tensor (B, N, T) of key positions, got "
                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            )
        if bool((t < -1).any()):
            raise ValueError(f"targets: {name!r} holds positions below -1 (-1 marks an unused slot)")
        # A target key after its query is never visible to a causal model and is a mistake.
        q = torch.arange(t.shape[1]).view(1, -1, 1)
        if bool(((t > q) & (t >= 0)).any()):
            raise ValueError(f"targets: {name!r} names a key after its query (targets must be at or before the query)")
        shapes.add(tuple(t.shape[:2]))
        out[name] = t.long()
    if len(shapes) != 1:
        raise ValueError(f"targets: every name needs the same (B, N), got {sorted(shapes)}")
    return out


class TargetMass(Meter):
    """Per layer, head and name: the mean, over the query rows that have at least one
    target, of the total weight the row puts on its targets. ``targets`` is
    ``{name: (B, N, T) long tensor}`` indexed by absolute query position (keys are
    positions of the same sequence); rows whose slots are all -1 are not counted.

    ``score(name)`` -> (L, H) float64, layers in the order of ``layers_seen``."""

    name = "target"

    def __init__(self, targets: dict[str, Tensor], **restrict):
        super().__init__(**restrict)
        self.targets = _check_targets(targets)
        first = next(iter(self.targets.values()))
        self.batch, self.length = first.shape[0], first.shape[1]
        self._mass: dict = {}  # layer -> (names, H) summed weight on targets
        self._count: dict = {}  # layer -> (names,) rows with a target, summed over calls

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        if call.batch != self.batch or call.k_len > self.length:
            raise ValueError(
                f"targets: given for {self.batch} rows of {self.length} positions, but layer {call.layer}'s "
                f"call has {call.batch} rows of {call.k_len} keys"
            )
        if call.layer not in self._mass:
            self._mass[call.layer] = torch.zeros(len(self.targets), n_heads, dtype=torch.float64)
            self._count[call.layer] = torch.zeros(len(self.targets), dtype=torch.float64)
        lo, hi = call.q_start + row_lo, call.q_start + row_hi
        for i, t in enumerate(self.targets.values()):
            self._count[call.layer][i] += float((t[:, lo:hi] >= 0).any(-1).sum())

    def update_view(self, call: CallInfo, view: TileView) -> None:
        mass = self._mass[call.layer]
        w = view.w  # (Bt, H, R, span)
        span = w.shape[3]
        q0, q1 = int(view.q_pos[0]), int(view.q_pos[-1]) + 1
        for i, t in enumerate(self.targets.values()):
            local = t[view.batch, q0:q1] - view.k0  # (Bt, R, T) column inside this tile
            inside = (t[view.batch, q0:q1] >= 0) & (local >= 0) & (local < span)
            if not bool(inside.any()):
                continue
            index = local.clamp(0, span - 1).unsqueeze(1).expand(-1, w.shape[1], -1, -1)
            picked = w.gather(3, index) * inside.unsqueeze(1)
            mass[i] += picked.sum((0, 2, 3)).double()

    @property
    def layers_seen(self) -> list:
        return sorted(self._mass, key=lambda x: -1 if x is None else x)

    def score(self, name: str) -> Tensor:
        """(L, H): mean weight on ``name``'s targets per row that has one (NaN when no
        observed row has one)."""
        if name not in self.targets:
            raise ValueError(f"name: expected one of {', '.join(self.targets)}, got {name!r}")
        i = list(self.targets).index(name)
        return torch.stack(
            [
                self._mass[layer][i] / self._count[layer][i]
                if self._count[layer][i] > 0
                else torch.full_like(self._mass[layer][i], float("nan"))
                for layer in self.layers_seen
            ]
        )

    def rows(self):
        out = []
        for layer, heads, _ in self.measured():
            for i, name in enumerate(self.targets):
                count = float(self._count[layer][i])
                if count == 0:
                    continue
                values = (self._mass[layer][i] / count).tolist()
                out += [(layer, h, f"target.{name}", values[j]) for j, h in enumerate(heads)]
        return out
