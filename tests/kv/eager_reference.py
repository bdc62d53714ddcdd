"""Independent references for the KV-policy tests, from transformers' eager attention:
weights from ``output_attentions``, keys as projected (before RoPE), a plain
``DynamicCache`` that keeps everything, and each layer's own dense mask installed by a
pre-hook (which entries of the reference's kept set a query may see). The policies' ``reference`` rules run on these weights, and
the kept sets they produce are carried from step to step here, not by attnkit."""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache


def padded_batch(seed: int = 0, n: int = 12, pads=(0, 3, 5), vocab: int = 97):
    """(ids, attention_mask): a left-padded batch, one row per entry of ``pads``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(pads), n), generator=g)
    mask = torch.ones(len(pads), n, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def positions(mask):
    """generate's position ids: count real tokens, padding at 1."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def layer_window(module):
    """The model's sliding window for this layer (Mistral: config; Qwen2: per layer)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def attention_layers(model):
    return [layer.self_attn for layer in model.model.layers]


class LayerMasks:
    """Pre-hooks giving every attention layer its own 4-D mask (eager: additive float)."""

    def __init__(self, model):
        self.masks = {}
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in attention_layers(model)]

    def _hook(self, module, args, kwargs):
        mask = self.masks.get(module.layer_idx)
        if mask is not None:
            dtype = kwargs["hidden_states"].dtype
            zero, low = torch.zeros((), dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
            kwargs["attention_mask"] = torch.where(mask, zero, low)
        return args, kwargs

    def remove(self):
        for h in self.handles:
            h.remove()


class ProjectedKeys:
    """Forward hooks recording each layer's keys as ``k_proj`` makes them, (B, Hkv, N, D):
    before RoPE, which preserves norms exactly, whereas rounding the rotated keys does not
    (equal keys at two positions would get norms differing in their last bits)."""

    def __init__(self, model):
        self.keys = {}
        self.handles = [m.k_proj.register_forward_hook(self._hook(m)) for m in attention_layers(model)]

    def _hook(self, module):
        def record(_, args, out):
            B, N = out.shape[:2]
            self.keys[module.layer_idx] = out.view(B, N, -1, module.head_dim).transpose(1, 2)

        return record

    def remove(self):
        for h in self.handles:
            h.remove()


def visible(kept, q_pos: int, window):
    """(B, Hkv, N) entries a query at padded position ``q_pos`` sees, model window applied."""
    if window is None:
        return kept
    j = torch.arange(kept.shape[-1])
    return kept & (q_pos - j < window)


@torch.no_grad()
def simulate(model, policy, ids, mask, capacity, steps):
    """The policy's reference rule driven on eager weights: prefill ``ids``, then one token
    per entry of ``steps`` (B, S). ``capacity(layer, real_lengths) -> (B,)``. Returns the
    kept sets (B, Hkv, seen) per layer after the prefill and after every step."""
    layers = attention_layers(model)
    cache = DynamicCache()  # plain layers, nothing dropped
    real = mask.bool()
    B, N = ids.shape
    Hkv = model.config.num_key_value_heads
    masks = LayerMasks(model)
    try:
        # transformers' eager softmax runs in float32, where a float64 model's fully masked
        # (padded) rows turn to NaN; here a padded query sees itself instead (its output is unused)
        j = torch.arange(N)
        for layer in attention_layers(model):
            see = (j[:, None] >= j[None, :])[None] & real[:, None, :]
            w = layer_window(layer)
            if w is not None:
                see = see & (j[:, None] - j[None, :] < w)
            masks.masks[layer.layer_idx] = (see | torch.eye(N, dtype=torch.bool))[:, None]
        projected = ProjectedKeys(model)
        try:
            out = model(
                ids, attention_mask=mask, position_ids=positions(mask), cache=cache, output_attentions=True, use_cache=True
            )
        finally:
            projected.remove()
    finally:
        masks.remove()
    kept, caps, states = {}, {}, {}
    for i, _layer in enumerate(layers):
        w = torch.where(real[:, None, :, None], out.attentions[i].to(torch.float64), 0.0)  # padded query rows: no weight
        held = real[:, None, :].expand(B, Hkv, N).clone()
        caps[i] = capacity(i, real.sum(-1))[:, None].expand(B, Hkv)
        states[i] = {}
        kept[i] = policy.reference(w, projected.keys[i], held, caps[i], states[i], "prefill")
    history = [dict(kept)]
    masks = LayerMasks(model)
    try:
        full = mask
        for s in range(steps.shape[1]):
            full = torch.cat([full, torch.ones(B, 1, dtype=full.dtype)], dim=1)
            q_pos = full.shape[1] - 1
            for i, layer in enumerate(layers):
                held = torch.cat([kept[i], torch.ones(B, Hkv, 1, dtype=torch.bool)], dim=-1)
                see = visible(held, q_pos, layer_window(layer))
                g = model.config.num_attention_heads // Hkv
                masks.masks[i] = see.repeat_interleave(g, 1)[:, :, None, :]
            out = model(
                steps[:, s : s + 1],
                attention_mask=full,
                position_ids=positions(full)[:, -1:],
                cache=cache,
                output_attentions=True,
                use_cache=True,
            )
            for i in range(len(layers)):
                held = torch.cat([kept[i], torch.ones(B, Hkv, 1, dtype=torch.bool)], dim=-1)
                if policy.decodes:
                    kept[i] = policy.reference(
                        out.attentions[i].to(torch.float64), cache.layers[i].keys, held, caps[i], states[i], "decode"
                    )
                else:
                    kept[i] = held
            history.append(dict(kept))
    finally:
        masks.remove()
    return history


def fraction_capacity(f):
    """floor(f * n) entries of an n-token prompt, at least one."""
    return lambda layer, real: torch.tensor([max(1, math.floor(f * int(n))) for n in real])


@torch.no_grad()
def greedy(model, ids, mask, cache, steps: int):
    """Greedy decoding as ``generate`` runs it (positions from the padding mask), but with
    the logits in the model's own dtype (``generate`` hands them out in float32): the
    new tokens (B, steps) and every step's last logits (B, steps, V)."""
    out = model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True).logits[:, -1]
    full, tokens, logits = mask, [], []
    for _ in range(steps):
        logits.append(out)
        tokens.append(out.argmax(-1, keepdim=True))
        full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
        out = model(tokens[-1], attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache, use_cache=True).logits[
            :, -1
        ]
    return torch.cat(tokens, 1), torch.stack(logits, 1)


def pyramid_budgets(k: int, n: int, num_layers: int, beta: float) -> list[int]:
    """PyramidKV's layer budgets (arXiv 2406.02069) for a mean of ``k`` over an ``n``-token
    prompt, written out: the arithmetic sequence from 2k - k/beta down to k/beta; a layer
    holds at most n, the others raised by one common amount (found by bisection) until the
    layers hold num_layers * k; then integers of that total, at least one each: the
    largest fractional parts round up (ties to the lower layer), and where raising a layer
    to one overshoots, the smallest fractional parts round down (ties to the deeper layer)."""
    if k >= n:
        return [n] * num_layers
    k_min, k_max = k / beta, 2 * k - k / beta
    want = [k_max - (k_max - k_min) * i / max(num_layers - 1, 1) for i in range(num_layers)]
    lo, hi = 0.0, float(n)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(min(n, w + mid) for w in want) < k * num_layers else (lo, mid)
    exact = [round(min(n, w + hi), 9) for w in want]
    kept = [max(1, math.floor(x)) for x in exact]
    short = k * num_layers - sum(kept)
    while short > 0:
        i = max((i for i in range(num_layers) if kept[i] < n), key=lambda i: (exact[i] - kept[i], -i))
        kept[i] += 1
        short -= 1
    while short < 0:
        i = min((i for i in range(num_layers) if kept[i] > 1), key=lambda i: (exact[i] - kept[i], -i))
        kept[i] -= 1
        short += 1
    return kept
