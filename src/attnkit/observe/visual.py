"""Attention on image tokens: how much, how concentrated, onto which tokens, per step.

The image tokens are given as key positions, a (B, N0) bool mask over the prompt (keys
past N0, the generated tokens, are text): this meter knows nothing of models, and
``attnkit.vision.image_spans`` finds the mask from a model's own placeholders.

Per query row i with weights w over its visible keys, I the image keys:

- share ``v_i = Σ_{j∈I} w_ij / Σ_j w_ij`` — the visual attention share (the "visual
  attention score" of the cold-start study in the reading lists; too little of it is the
  hallucination cause named by PAI, Liu et al. 2024, arXiv 2407.21771);
- uniform share ``|I ∩ visible_i| / |visible_i|``, what a uniform head would give;
- visual entropy ``H_i = log S1 − S2 / S1`` of the weights renormalised over I (S1 =
  Σ_I w, S2 = Σ_I w log w), and ``H_i / log |I ∩ visible_i|``;
- top-k concentration: the share of a row's visual mass on its k largest image keys;
- received mass per image key, summed over rows: the "blind" tokens that soak up
  visual attention (AVC, Woo et al. 2024, arXiv 2405.17820; the visual attention sink
  of VAR, Kang et al. 2025, arXiv 2503.03321) are the keys with the most of it;
- per generated step: the share of the query row at position N0 − 1 + t, whose output
  predicts generated token t, kept per layer × head × batch row (``arrays()``), and its
  drift, the least-squares slope per step ("text inertia": visual attention draining
  towards the text as generation goes on).

Rows that see no key (padding) are left out of every mean. State is O(B·H·N0) per layer
(received mass) plus O(B·H·T) for T steps. The rows of a call wait to be folded in with
those of up to 255 other calls: as sums, O(B·H·R·k), or, for a decoding step (one tile
of a few rows), as its weights on the prompt, O(B·H·R·N0), at most 16 MB of them.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from .base import CallInfo
from .meter import Meter, TileView

Tensor = torch.Tensor


def key_mask(keys, name: str = "keys") -> Tensor:
    """(B, N0) bool from a bool tensor, or from per-row lists of (start, end) spans."""
    if isinstance(keys, Tensor):
        if keys.dtype != torch.bool or keys.dim() != 2 or keys.shape[1] == 0:
            raise ValueError(f"{name}: expected a (batch, tokens) bool mask of image keys, got {keys.dtype} {tuple(keys.shape)}")
        return keys.detach().cpu()
    if isinstance(keys, (list, tuple)) and keys and all(isinstance(r, (list, tuple)) for r in keys):
        ends = [e for row in keys for _, e in row] or [1]
        out = torch.zeros(len(keys), max(ends), dtype=torch.bool)
        for b, row in enumerate(keys):
            for span in row:
                if (
                    len(span) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in span)
                    or not 0 <= span[0] < span[1]
                ):
                    raise ValueError(f"{name}: expected (start, end) spans with 0 <= start < end, got {span!r} in row {b}")
                out[b, span[0] : span[1]] = True
        return out
    raise ValueError(
        f"{name}: expected a (batch, tokens) bool mask or one list of (start, end) spans per batch row, got {type(keys).__name__}"
    )


#: what ``_finish`` adds up per head, in order
_SUMS = ("rows", "share", "uniform", "visual_rows", "entropy", "entropy_norm", "norm_rows", "topk")
#: calls whose rows wait to be folded into the sums (a few KB each for a decoding step) ...
_PENDING_CALLS = 256
#: ... and weights kept from whole-row calls, at most (elements; 16 MB in float32)
_PENDING_WEIGHTS = 1 << 22
#: a call whose single tile holds at most this many query rows keeps its prompt weights
#: for ``_finish`` instead of reducing them at once
_WHOLE_ROWS = 16


class _Summed(NamedTuple):
    """A call reduced tile by tile: its rows' sums (5, B, H, R) and their top-k image
    weights, (B, H, R, k) while the call runs and summed over k, (B, H, R), once it ends."""

    layer: int | None
    q0: int  # position of the first query row
    sums: Tensor
    top_mass: Tensor


class _Kept(NamedTuple):
    """A whole-row call kept for ``_finish``: its weights on the prompt (B, H, R, N0), the
    whole rows' sums (B, H, R; None for softmax rows that see every key, which sum to 1),
    and the visible keys and visible image keys per row (a float when every key is
    visible, broadcastable tensors otherwise)."""

    layer: int | None
    q0: int
    prompt: Tensor
    total: Tensor | None
    visible: float | Tensor
    visible_image: Tensor


class VisualAttention(Meter):
    """Per head: ``visual.share``, ``visual.share.uniform``, ``visual.entropy``,
    ``visual.entropy.norm``, ``visual.topk`` (k = ``top_k``), ``visual.blind`` (share of
    the received visual mass on the ``top_k`` most-attended image keys, per batch row,
    averaged) and, over two steps or more, ``visual.drift``. ``arrays()`` gives
    ``visual_share`` per step and ``visual_received`` per image key."""

    name = "visual"

    def __init__(self, keys, top_k: int = 4, **restrict):
        super().__init__(**restrict)
        self.keys = key_mask(keys)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
        if not self.keys.any():
            raise ValueError("keys: the mask marks no image key")
        self.top_k = top_k
        self.prompt_len = self.keys.shape[1]
        columns = self.keys.any(0).nonzero().view(-1)
        self._image_range = (int(columns[0]), int(columns[-1]) + 1)  # every row's image keys lie here
        self._range_all_image = bool(self.keys[:, self._image_range[0] : self._image_range[1]].all())  # one image, no gaps
        self._image_count = self.keys.sum(-1, dtype=torch.float64).view(-1, 1, 1)  # (B | 1, 1, 1)
        self._state: dict = {}
        self._steps: dict = {}  # layer -> (B, H, T) share per step, NaN where not seen
        self._img_full: Tensor | None = None
        self._pending: list[_Summed | _Kept] = []  # calls not yet folded in, in order
        self._pending_weights = 0
        self._call: _Summed | _Kept | None = None  # the current call's entry, once a tile gave one

    def _img(self, call: CallInfo) -> Tensor:
        """(B, Nk) image keys of a call: the prompt's mask, then text (a zero tail grown
        by doubling, so a decoding step slices instead of concatenating)."""
        full = self._img_full
        if full is None or full.shape[0] != call.batch or full.shape[1] < call.k_len:
            n = max(call.k_len, 2 * (full.shape[1] if full is not None else 0), self.prompt_len)
            full = torch.zeros(call.batch, n, dtype=torch.bool)
            full[:, : self.prompt_len] = self.keys
            self._img_full = full
        return full[:, : call.k_len]

    def key_range(self, call: CallInfo) -> tuple[int, int]:
        return self._image_range

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        if self.keys.shape[0] not in (1, call.batch):
            raise ValueError(f"keys: a mask for {self.keys.shape[0]} batch rows, but layer {call.layer}'s call has {call.batch}")
        self._shape = (call.batch, n_heads, row_hi - row_lo)
        self._q0 = call.q_start + row_lo
        self._call = None
        if call.layer not in self._state:
            self._state[call.layer] = {
                "sums": torch.zeros(len(_SUMS), n_heads, dtype=torch.float64),
                "received": torch.zeros(call.batch, n_heads, self.prompt_len, dtype=torch.float64),
            }
        elif self._state[call.layer]["received"].shape[0] != call.batch:
            raise ValueError(
                f"layer {call.layer}: calls with batch {self._state[call.layer]['received'].shape[0]} then {call.batch} cannot share one meter"
            )

    def update_view(self, call: CallInfo, view: TileView) -> None:
        w = view.w
        whole = (
            self._call is None
            and view.k0 == 0
            and w.shape[3] == call.k_len >= self.prompt_len
            and w.shape[0] == call.batch
            and tuple(w.shape[1:3]) == self._shape[1:]
            and w.shape[2] <= _WHOLE_ROWS
        )
        if whole:
            self._keep(call, view)
        else:
            self._add_tile(call, view)

    def _keep(self, call: CallInfo, view: TileView) -> None:
        """A call that is one tile of a few rows (a decoding step): keep its prompt weights
        and row sums, and reduce them with those of other calls in ``_finish``. A step then
        costs a copy and a sum instead of some thirty small ops."""
        w = view.w
        prompt = w[..., : self.prompt_len].clone()  # the kernel may reuse its buffer
        vis = view.visible()
        n_vis: float | Tensor
        if vis is None or bool(vis.all()):  # (the prefill's last row sees every key too)
            n_vis, n_img = float(w.shape[3]), self._image_count
        else:
            n_vis = vis.sum(-1, dtype=torch.float64)
            n_img = (vis[..., : self.prompt_len] & self.keys.view(-1, 1, 1, self.prompt_len)).sum(-1, dtype=torch.float64)
        total = None if vis is None and view.log_norm is not None else w.sum(-1)  # softmax rows over every key: 1
        self._call = _Kept(call.layer, self._q0, prompt, total, n_vis, n_img)
        self._pending_weights += prompt.numel()

    def _add_tile(self, call: CallInfo, view: TileView) -> None:
        """Reduce one tile at once (prefill rows, tiled calls); sums in the weights' dtype
        per tile (as the other meters), accumulated in float64. Only the tile's columns in
        the image keys' range are read past the rows' totals: a tile cut to that range
        (``key_range``) gives those totals from its softmax normaliser and counts."""
        if self._call is None:
            sums = torch.zeros((5,) + self._shape, dtype=torch.float64)
            self._call = _Summed(call.layer, self._q0, sums, torch.zeros(self._shape + (self.top_k,), dtype=torch.float64))
        elif not isinstance(self._call, _Summed):
            raise RuntimeError("meter: another tile for a call whose first tile held all of its rows and keys")
        sums, top_k = self._call.sums, self._call.top_mass  # the top-k values until end_call sums them
        at = (slice(None), view.batch, slice(None), view.rows)
        w, k0 = view.w, view.k0
        total: Tensor
        if view.row_visible is None:
            total, n_vis = w.sum(-1), view.visible_per_row()
        else:  # softmax rows: weights sum to 1 over the visible keys (0 for a row with none)
            if view.log_norm is None:
                raise RuntimeError("meter: a tile cut to a key range carries no log-normaliser")
            total, n_vis = torch.isfinite(view.log_norm).to(w.dtype), view.row_visible
        lo, hi = self._image_range
        c0, c1 = min(max(lo - k0, 0), w.shape[3]), min(max(hi - k0, 0), w.shape[3])
        img = self._img(call)[view.batch, k0 + c0 : k0 + c1]  # (Bt, c1 - c0) bool
        imgw = img.to(w.dtype).view(w.shape[0], 1, 1, c1 - c0)
        vis = view.visible()
        if vis is not None and vis.shape[-1] != 1:
            vis = vis[..., c0:c1]
        n_img = imgw.sum(-1) if vis is None else (vis & img.view(imgw.shape)).sum(-1)
        wi = w[..., c0:c1] if self._range_all_image else w[..., c0:c1] * imgw
        s1 = wi.sum(-1)
        if view.s is not None and view.log_norm is not None:
            # softmax weights: log w = s - log_norm, so sum w log w is a dot product (entr,
            # x log x, costs several times more); text keys have w = 0, hidden ones s = -inf
            s_img = view.s[..., c0:c1] if vis is None else torch.where(vis, view.s[..., c0:c1], 0.0)
            dot = torch.linalg.vecdot(wi, s_img)
            if bool(torch.isnan(dot).any()):  # 0 · -inf: a score mod hid a key that no mask marks
                s2 = -torch.special.entr(wi).sum(-1)
            else:
                s2 = torch.where(s1 > 0, dot - view.log_norm * s1, 0.0)
        else:
            s2 = -torch.special.entr(wi).sum(-1)
        sums[at] += _row_sums(total, s1, s2, n_vis, n_img)
        if c0 == c1:
            return
        top = wi.topk(min(self.top_k, c1 - c0), dim=-1).values.double()
        rows = at[1:]
        if k0 + c0 == lo and top.shape[-1] == self.top_k:  # the row block's first image tile: nothing to merge yet
            top_k[rows] = top
        else:
            top_k[rows] = torch.cat([top_k[rows], top], -1).topk(self.top_k, dim=-1).values
        self._state[call.layer]["received"][view.batch, :, k0 + c0 : k0 + c1] += wi.sum(2)

    def end_call(self, call: CallInfo) -> None:
        # The per-row statistics wait for a batch of calls (``_finish``): a decoding step is
        # one row per call, and some thirty small ops per call cost more than the step's
        # attention on a small model; batched, they are paid once per many calls.
        entry, self._call = self._call, None
        if entry is None:  # no tile reached the meter (no row of its range was computed)
            return
        if isinstance(entry, _Summed):
            entry = entry._replace(top_mass=entry.top_mass.sum(-1))
        self._pending.append(entry)
        if len(self._pending) >= _PENDING_CALLS or self._pending_weights >= _PENDING_WEIGHTS:
            self._finish()

    def _finish(self) -> None:
        """Fold the pending calls' rows into the per-layer sums and per-step shares. Rows
        are independent, so the layers' rows (grouped by layer, each layer's in call
        order) go through one pass, and only the sums per layer are taken apart: a
        decoding step of every layer is then a few ops, not a few ops per layer."""
        pending, self._pending, self._pending_weights = self._pending, [], 0
        rank = {layer: i for i, layer in enumerate(dict.fromkeys(entry.layer for entry in pending))}
        by_heads: dict[int, list] = {}  # layers with as many measured heads share a pass
        for entry in sorted(pending, key=lambda e: rank[e.layer]):
            heads = entry.top_mass.shape[1] if isinstance(entry, _Summed) else entry.prompt.shape[1]
            by_heads.setdefault(heads, []).append(entry)
        for entries in by_heads.values():
            segments, chunks = self._chunks(entries)
            positions = torch.cat([c[0] for c in chunks])
            s_all, s_img, s2, n_vis, n_img = torch.cat([c[1] for c in chunks], dim=3)
            top_mass = torch.cat([c[2] for c in chunks], dim=2)
            live = s_all > 0
            share = torch.where(live, s_img / s_all.clamp_min(1e-300), 0.0)
            uniform = torch.where(n_vis > 0, n_img / n_vis.clamp_min(1), 0.0)
            seen = s_img > 0
            s1 = torch.where(seen, s_img, 1.0)
            h = torch.where(seen, torch.log(s1) - s2 / s1, 0.0).clamp_min(0.0)
            multi = seen & (n_img >= 2)
            norm = torch.where(multi, h / torch.log(torch.where(multi, n_img, 2.0)), 0.0)
            top = torch.where(seen, top_mass / s1, 0.0)
            # one stack, one reduction per layer: the per-head sums of _SUMS, in that order
            stats = torch.stack([live.double(), share, uniform * live, seen.double(), h, norm, multi.double(), top]).sum(1)
            step_share = torch.where(live, share, float("nan"))
            for layer, a, b in segments:
                self._state[layer]["sums"] += stats[..., a:b].sum(-1)
                self._record_steps(layer, positions[a:b], step_share[..., a:b])

    def _chunks(self, entries: list) -> tuple[list[tuple], list[tuple[Tensor, Tensor, Tensor]]]:
        """The rows of ``entries`` (grouped by layer): ((layer, first row, end row) of each
        layer, the chunks (query positions (R,), sums (5, B, H, R), top-k mass (B, H, R))
        in order), each run of kept calls reduced in one pass."""
        chunks: list[tuple[Tensor, Tensor, Tensor]] = []
        for kind, run in itertools.groupby(entries, key=_kind):
            if kind == "summed":
                chunks.extend((torch.arange(e.q0, e.q0 + e.sums.shape[3]), e.sums, e.top_mass) for e in run)
            else:
                chunks.append(self._reduce_kept(list(run)))
        segments: list[tuple] = []
        row = 0
        for e in entries:
            n = e.sums.shape[3] if isinstance(e, _Summed) else e.prompt.shape[2]
            if segments and segments[-1][0] == e.layer:
                segments[-1] = (e.layer, segments[-1][1], row + n)
            else:
                segments.append((e.layer, row, row + n))
            row += n
        return segments, chunks

    def _reduce_kept(self, run: list[_Kept]) -> tuple[Tensor, Tensor, Tensor]:
        """The kept calls' rows in one pass (of one layer or several, grouped by layer):
        their image weights, received mass and top-k."""
        w = torch.cat([e.prompt for e in run], dim=2)  # (B, H, R, N0): every kept row
        positions = torch.tensor([e.q0 + i for e in run for i in range(e.prompt.shape[2])])
        total = torch.ones(w.shape[:3], dtype=w.dtype)  # softmax rows over every key (total None) sum to 1
        row = 0
        for e in run:
            if e.total is not None:
                total[:, :, row : row + e.prompt.shape[2]] = e.total
            row += e.prompt.shape[2]
        n_vis: Tensor
        if _kind(run[0]) == "kept, all visible":  # one count per row, every image key visible
            n_vis = torch.tensor([e.visible for e in run for _ in range(e.prompt.shape[2])], dtype=torch.float64)
            n_img = self._image_count
        else:
            n_vis = torch.cat([torch.as_tensor(e.visible).expand(e.prompt.shape[:3]) for e in run], dim=2)
            n_img = torch.cat([e.visible_image.expand(e.prompt.shape[:3]) for e in run], dim=2)
        wi = w * self.keys.to(w.dtype).view(-1, 1, 1, self.prompt_len)
        row = 0
        for layer, group in itertools.groupby(run, key=lambda e: e.layer):
            n = sum(e.prompt.shape[2] for e in group)
            self._state[layer]["received"] += wi[:, :, row : row + n].sum(2).double()
            row += n
        top_mass = wi.topk(min(self.top_k, self.prompt_len), dim=-1).values.double().sum(-1)
        return positions, _row_sums(total, wi.sum(-1), -torch.special.entr(wi).sum(-1), n_vis, n_img), top_mass

    def _record_steps(self, layer, positions: Tensor, share: Tensor) -> None:
        """Keep ``share`` (B, H, R) of the rows at query ``positions`` (R,) that predict a
        generated token (position N0 - 1 + t for step t); a later row of a step replaces
        an earlier one, as a second generation with the same meter would."""
        t = positions - (self.prompt_len - 1)
        keep = t >= 0
        if not bool(keep.any()):
            return
        t, share = t[keep], share[..., keep]
        if len(t) > 1 and len(torch.unique(t)) != len(t):  # the last row of each step wins
            last = {int(step): i for i, step in enumerate(t.tolist())}
            where = torch.tensor(list(last.values()))
            t, share = t[where], share[..., where]
        steps = self._steps.get(layer)
        length = int(t.max()) + 1
        if steps is None or steps.shape[2] < length:
            grown = torch.full(share.shape[:2] + (length,), float("nan"), dtype=torch.float64)
            if steps is not None:
                grown[..., : steps.shape[2]] = steps
            steps = grown
        steps[..., t] = share
        self._steps[layer] = steps

    def rows(self):
        self._finish()
        out = []
        for layer, heads, _ in self.measured():
            st = dict(zip(_SUMS, self._state[layer]["sums"].tolist()))  # plain floats: one conversion per layer
            steps = self._steps.get(layer)
            drift = _slope(steps).tolist() if steps is not None else None
            blind = _blind(self._state[layer]["received"], self.top_k)
            blind_list = blind.tolist() if blind is not None else None
            for j, hd in enumerate(heads):
                n = st["rows"][j]
                if not n:
                    continue
                out.append((layer, hd, "visual.share", st["share"][j] / n))
                out.append((layer, hd, "visual.share.uniform", st["uniform"][j] / n))
                nv = st["visual_rows"][j]
                if nv:
                    out.append((layer, hd, "visual.entropy", st["entropy"][j] / nv))
                    out.append((layer, hd, f"visual.top{self.top_k}", st["topk"][j] / nv))
                if st["norm_rows"][j]:
                    out.append((layer, hd, "visual.entropy.norm", st["entropy_norm"][j] / st["norm_rows"][j]))
                if blind_list is not None and math.isfinite(blind_list[j]):
                    out.append((layer, hd, "visual.blind", blind_list[j]))
                if drift is not None and math.isfinite(drift[j]):
                    out.append((layer, hd, "visual.drift", drift[j]))
        return out

    def arrays(self) -> dict:
        """``visual_share``: {(layer, head): {"step_start": N0 - 1, "values": (B, T)}}
        (NaN for a step or row not observed); ``visual_received``: {(layer, head): (B, N0)}
        mass each key received (0 off the image)."""
        self._finish()
        shares, received = {}, {}
        for layer, heads, _ in self.measured():
            steps = self._steps.get(layer)
            for j, hd in enumerate(heads):
                if steps is not None:
                    shares[(layer, hd)] = {"step_start": self.prompt_len - 1, "values": steps[:, j].float()}
                received[(layer, hd)] = self._state[layer]["received"][:, j].float()
        return {"visual_share": shares, "visual_received": received}

    def meta(self) -> dict:
        return {"top_k": self.top_k, "prompt_len": self.prompt_len, "image_tokens": int(self.keys.sum())}


def _slope(steps: Tensor) -> Tensor:
    """(H,) least-squares slope of share per step, averaged over batch rows (NaN: < 2 steps)."""
    B, H, T = steps.shape
    t = torch.arange(T, dtype=torch.float64).expand(B, H, T)
    ok = torch.isfinite(steps)
    n = ok.sum(-1).double()
    y = torch.where(ok, steps, 0.0)
    tm = torch.where(ok, t, 0.0).sum(-1) / n.clamp_min(1)
    ym = y.sum(-1) / n.clamp_min(1)
    dt = torch.where(ok, t - tm.unsqueeze(-1), 0.0)
    var = (dt * dt).sum(-1)
    slope = torch.where((n >= 2) & (var > 0), (dt * (y - ym.unsqueeze(-1))).sum(-1) / var.clamp_min(1e-300), float("nan"))
    good = torch.isfinite(slope)
    return torch.where(good.any(0), torch.where(good, slope, 0.0).sum(0) / good.sum(0).clamp_min(1), float("nan"))


def _blind(received: Tensor, k: int) -> Tensor | None:
    """(H,) mean over batch rows of the share of received visual mass on the k keys that
    received most of it."""
    total = received.sum(-1)  # (B, H)
    top = received.topk(min(k, received.shape[-1]), dim=-1).values.sum(-1)
    ok = total > 0
    if not bool(ok.any()):
        return None
    share = torch.where(ok, top / total.clamp_min(1e-300), 0.0)
    return torch.where(ok.any(0), share.sum(0) / ok.sum(0).clamp_min(1), float("nan"))


def _kind(entry: _Summed | _Kept) -> str:
    """Pending calls of one kind are folded in together."""
    if isinstance(entry, _Summed):
        return "summed"
    return "kept, all visible" if isinstance(entry.visible, float) else "kept, masked"


def _row_sums(total: Tensor, s1: Tensor, s2: Tensor, n_vis, n_img: Tensor) -> Tensor:
    """(5, ...) float64 per-row sums, in ``_finish``'s order: all weights (``total``),
    image weights ``s1`` and ``s2`` = Σ w log w over them, visible keys, visible image keys."""
    parts = (total, s1, s2, torch.as_tensor(n_vis), n_img)
    return torch.stack(torch.broadcast_tensors(*(x.double() for x in parts)))
