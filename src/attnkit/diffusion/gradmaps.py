"""Differentiable per-token cross-attention maps, for losses on attention.

``TokenMaps`` measures maps with no graph, in O(N) state, from the kernels' tiles.
Attend-and-Excite (arXiv 2301.13826), InitNO (arXiv 2404.04650) and attention
regulation (arXiv 2403.06381) need the maps *with* their graph, so that a loss on them
reaches the latents. ``record_maps`` gets them from the q and k that the model's own
processors hand to attnkit (an ``EDITS`` entry on each chosen layer): per call it forms
only the image-query x text-key block of the attention weights,

    P[b, h, i, t] = exp(s[b, h, i, t] - lse[b, h, i]),   s = q_i . k_t * scale (+ score mods),

where ``lse`` is the log-normaliser of the whole row. For cross-attention the keys are
the text, so the block is the whole row and ``lse`` comes from it; for joint attention
(SD3, Flux) the row also holds every image key, and ``lse`` comes from attnkit's kernel
(``attention(..., return_lse=True)``, differentiable, O(N) memory): no N_image x N_image
matrix is formed. Self-attention rows at a few query positions (InitNO's conflict score)
are formed for those rows only.

The logit scale is SDPA's default 1/sqrt(head_dim), which is what every diffusers
processor that routes through attnkit uses (they either pass no scale or
``attn.scale`` = head_dim**-0.5). Score mods of edits already on a layer (``EDITS``)
are part of the maps; ``use(score=...)`` and attention masks are not.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch

from ..api import attention
from ..mods import as_score
from .edits import DiffusionEdit, edits_on
from .layers import AttentionLayer, CallLayout, index_tuple, select_layers
from .switch import denoiser, use
from .tokenmaps import mean_over_grids

Tensor = torch.Tensor


def check_scale(layer: AttentionLayer, head_dim: int) -> None:
    """The maps assume SDPA's default logit scale 1/sqrt(head_dim); a module that declares
    another (diffusers' ``Attention(scale_qk=False)`` or a custom ``scale``) is refused
    rather than mapped with the wrong one."""
    declared = getattr(layer.module, "scale", None)
    if isinstance(declared, (int, float)) and abs(float(declared) * math.sqrt(head_dim) - 1.0) > 1e-6:
        raise ValueError(
            f"layers: {layer.name} declares the logit scale {declared}, not 1/sqrt({head_dim}); attention maps "
            "and losses on them assume the default scale"
        )


def _index_grids(b, h, nq, nk, q_pos: Tensor, kv_pos: Tensor, device):
    """Broadcast index tensors for evaluating score mods on a block: q positions are
    counted among the keys (query i of the call sits at Nk - Nq + i)."""
    return (
        torch.arange(b, device=device).view(-1, 1, 1, 1),
        torch.arange(h, device=device).view(1, -1, 1, 1),
        (q_pos + (nk - nq)).view(1, 1, -1, 1),
        kv_pos.view(1, 1, 1, -1),
    )


def block_logits(query: Tensor, key: Tensor, rows: Tensor, cols: Tensor, mods, scale: float) -> Tensor:
    """Logits (B, H, len(rows), len(cols)) of queries ``rows`` against keys ``cols``,
    with ``mods`` (score mods, bound to the call's sizes) applied, in float32 or wider."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query[:, :, rows].to(dtype)
    k = key[:, :, cols].to(dtype)
    if k.shape[1] != q.shape[1]:  # GQA: query head h reads key head h // group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mods is not None:
        b, h, nq, nk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        s = mods(s, *_index_grids(b, h, nq, nk, rows, cols, query.device))
    return s


def row_lse(query: Tensor, key: Tensor, mods, scale: float) -> Tensor:
    """(B, H, Nq) log-normaliser of every row over all keys, through attnkit's kernel
    (differentiable, O(N) memory; the values are a zero column, unused)."""
    value = query.new_zeros(key.shape[0], key.shape[1], key.shape[2], 1)
    _, lse = attention(query, key, value, score=mods, scale=scale, return_lse=True)
    return lse


def text_block(layout: CallLayout, query: Tensor, key: Tensor, mods=None) -> Tensor:
    """(B, H, N_image, T) attention weights from the image queries to the text keys of
    one call, differentiable w.r.t. ``query``, ``key`` and the mods' parameters."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    b, h, nq, nk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    bound = None if not mods else as_score(list(mods)).bind(b, h, nq, nk)
    i_lo, i_hi = layout.image_queries
    assert layout.text_keys is not None  # a cross or joint call (MapRecorder._record checks)
    t_lo, t_hi = layout.text_keys
    dev = query.device
    rows, cols = torch.arange(i_lo, i_hi, device=dev), torch.arange(t_lo, t_hi, device=dev)
    s = block_logits(query, key, rows, cols, bound, scale)
    if (t_lo, t_hi) == (0, nk):  # the text is every key: the block is the whole row
        return torch.softmax(s, dim=-1)
    lse = row_lse(query, key, bound, scale)[:, :, i_lo:i_hi].to(s.dtype)
    return torch.exp(s - lse.unsqueeze(-1))


def image_rows(layout: CallLayout, query: Tensor, key: Tensor, positions: Tensor, mods=None) -> Tensor:
    """(B, H, K, N_image) attention weights from the image queries at ``positions``
    ((B, K) indices among the image tokens) to the image keys, normalised over the
    call's whole row (for joint attention the text keys take their share)."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    b, h, nq, nk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    bound = None if not mods else as_score(list(mods)).bind(b, h, nq, nk)
    i_lo, i_hi = layout.image_queries
    dtype = torch.promote_types(query.dtype, torch.float32)
    k = key.to(dtype)
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
    idx = (positions + i_lo).to(query.device)  # (B, K) rows of the call
    q = torch.gather(query.to(dtype), 2, idx[:, None, :, None].expand(b, h, idx.shape[1], query.shape[-1]))
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, K, Nk): K rows only
    if bound is not None:
        bi = torch.arange(b, device=s.device).view(-1, 1, 1, 1)
        hi = torch.arange(h, device=s.device).view(1, -1, 1, 1)
        s = bound(s, bi, hi, (idx + (nk - nq))[:, None, :, None], torch.arange(nk, device=s.device).view(1, 1, 1, -1))
    p = torch.softmax(s, dim=-1)
    # image keys sit where the image queries do in self- and joint attention
    return p[..., i_lo:i_hi]


class _LayerEdit(DiffusionEdit):
    """The ``EDITS`` entry ``record_maps`` puts on one layer: records the call's q and k
    (with any edit already there running first, its score mods kept in the maps)."""

    def __init__(self, recorder: MapRecorder, layer: AttentionLayer, previous):
        super().__init__(previous)
        self.recorder, self.layer = recorder, layer

    def scores(self, layout, query, key):
        mods = super().scores(layout, query, key)
        self.recorder._record(self.layer, layout, query, key, mods)
        return mods


class MapRecorder:
    """What ``record_maps`` yields: ``maps()`` (B, T, h, w) and ``self_maps(positions)``
    from the calls run inside the block, both carrying the graph."""

    def __init__(self, cross: list[AttentionLayer], selfs: list[AttentionLayer], heads, grid=None):
        self.cross = {layer.module: layer for layer in cross}
        self.selfs = {layer.module: layer for layer in selfs}
        self.heads = heads
        self.grid = grid
        self._sums: dict[tuple[int, int], Tensor] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._self_calls: list[tuple[CallLayout, tuple[int, int], Tensor, Tensor, list]] = []  # (layout, its grid, ...)

    def clear(self) -> None:
        """Forget what was recorded (and the graph it holds)."""
        self._sums, self._counts, self._self_calls = {}, {}, []

    def _heads_of(self, t: Tensor, name: str) -> Tensor:
        if self.heads is None:
            return t
        if self.heads[-1] >= t.shape[1]:
            raise ValueError(f"heads: index {self.heads[-1]} out of range for {name}, which has {t.shape[1]} heads")
        return t[:, list(self.heads)]

    def _record(self, layer: AttentionLayer, layout: CallLayout, query: Tensor, key: Tensor, mods: list) -> None:
        check_scale(layer, query.shape[-1])
        if layer.module in self.selfs and layout.grid is not None:
            self._self_calls.append((layout, layout.grid, query, key, mods))
        if layer.module not in self.cross or layout.text_keys is None:
            return
        if self.grid is not None and layout.grid is not None and tuple(layout.grid) != self.grid:
            return
        if layout.grid is None:
            raise ValueError(
                f"grid: cannot tell the latent grid of {layout.name}; pass a model input of shape (B, C, H, W) or a square latent"
            )
        p = self._heads_of(text_block(layout, query, key, mods), layout.name)  # (B, H', N, T)
        part = p.sum(1).transpose(1, 2)  # (B, T, N)
        held = self._sums.get(layout.grid)
        if held is not None and held.shape != part.shape:
            raise ValueError(
                f"calls: {layout.name} has batch and text sizes {tuple(part.shape[:2])}, but earlier calls had "
                f"{tuple(held.shape[:2])}; record one prompt batch per block (or call clear())"
            )
        self._sums[layout.grid] = part if held is None else held + part
        self._counts[layout.grid] = self._counts.get(layout.grid, 0) + p.shape[1]

    @property
    def grids(self) -> list[tuple[int, int]]:
        return sorted(self._sums)

    def maps(self, size: tuple[int, int] | None = None) -> Tensor:
        """(B, T, h, w): per batch row and text token, the mean attention weight at each
        image position over the recorded layers, heads and calls. Coarser grids are
        resized (bilinear) to ``size`` (default: the finest grid recorded) before the
        mean, each weighted by its number of head-calls, as ``TokenMaps.maps`` does."""
        if not self._sums:
            where = "" if self.grid is None else f" at the grid {self.grid}"
            raise ValueError(
                f"maps: no cross or joint attention call{where} was recorded; run the denoiser inside "
                "record_maps with layers that attend to text"
            )
        return mean_over_grids(self._sums, self._counts, size)

    def self_maps(self, positions: Tensor, size: tuple[int, int]) -> Tensor:
        """(B, K, h, w): for each batch row and each of its K query positions (flat
        indices into the (h, w) grid ``size``), the self-attention map of that query —
        its weights on every image key — averaged over the recorded self(-or-joint)
        layers whose grid is ``size`` and their heads."""
        if positions.dim() != 2:
            raise ValueError(f"positions: expected (B, K) flat indices into the grid, got shape {tuple(positions.shape)}")
        total, count = None, 0
        for layout, grid, query, key, mods in self._self_calls:
            if tuple(grid) != tuple(size):
                continue
            rows = self._heads_of(image_rows(layout, query, key, positions, mods), layout.name)  # (B, H', K, N)
            part = rows.sum(1)
            total = part if total is None else total + part
            count += rows.shape[1]
        if total is None:
            raise ValueError(
                f"self_layers: no self- or joint attention call at the grid {tuple(size)} was recorded; "
                f"choose self_layers that run at that grid (recorded grids: "
                f"{sorted({tuple(c[1]) for c in self._self_calls})})"
            )
        return (total / count).reshape(positions.shape[0], positions.shape[1], *size)


@contextmanager
def record_maps(model_or_pipeline, layers=None, heads=None, self_layers=(), grid=None):
    """Record differentiable attention maps of the denoiser's calls inside the block.

    Args:
        model_or_pipeline: a diffusers model or a pipeline (its unet / transformer).
        layers: module paths (exact) of the cross- or joint-attention layers whose
            per-token maps are recorded; default: every cross and joint layer.
        heads: head indices averaged (default: all).
        self_layers: module paths of self- or joint-attention layers whose rows
            ``self_maps`` reads (default: none); None: every self and joint layer.
        grid: (h, w): only calls at this latent grid count towards ``maps`` (the
            papers' choice for Stable Diffusion: the 16 x 16 layers); default: all.

    Yields a ``MapRecorder``. The model runs on attnkit inside (``use``) and is restored
    on exit, also after an exception::

        with record_maps(unet) as rec:
            unet(latents, t, encoder_hidden_states=text)
            loss = 1 - rec.maps()[:, 2].amax((-2, -1))
    """
    model = denoiser(model_or_pipeline)
    cross = select_layers(model, layers, ("cross", "joint"))
    selfs = [] if self_layers == () else select_layers(model, self_layers, ("self", "joint"), "self_layers")
    recorder = MapRecorder(cross, selfs, index_tuple(heads, "heads"), _grid(grid))
    chosen = sorted({layer.index: layer for layer in cross + selfs}.values(), key=lambda layer: layer.index)
    with use(model, layers=[layer.name for layer in chosen]):
        with edits_on(chosen, lambda layer, previous: _LayerEdit(recorder, layer, previous)):
            yield recorder


def _grid(grid) -> tuple[int, int] | None:
    if grid is None:
        return None
    if not isinstance(grid, (tuple, list)) or len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
        raise ValueError(f"grid: expected None or (h, w) positive ints, got {grid!r}")
    return tuple(grid)


def denoise(model, latents: Tensor, t, prompt_embeds: Tensor, model_kwargs: dict | None = None) -> Tensor:
    """One denoiser call: ``sample=`` for a UNet, ``hidden_states=`` for a transformer."""
    params = inspect.signature(model.forward).parameters
    first = "sample" if "sample" in params else "hidden_states"
    kwargs = dict(model_kwargs or {})
    kwargs.update({first: latents, "timestep": t, "encoder_hidden_states": prompt_embeds, "return_dict": False})
    return model(**kwargs)[0]


__all__ = ["MapRecorder", "check_scale", "denoise", "record_maps"]
