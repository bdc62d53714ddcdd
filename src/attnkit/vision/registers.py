"""Test-time registers for vision transformers (Jiang et al. 2025, "Vision Transformers
Don't Need Trained Registers", arXiv 2506.08010; the registers of Darcet et al. 2023,
arXiv 2309.16588).

Inside ``with test_time_registers(tower, neurons):`` the tower's sequence gets ``count``
extra tokens after its embeddings (zero vectors: an untrained token), and in every layer
l of ``neurons`` ({layer: [MLP hidden units]}, from ``highnorm.register_neurons``) each
named unit's activation is moved off the image's tokens onto the registers: the registers
take the unit's largest activation over the image's tokens, the image's tokens get 0.
The outputs drop the registers again (``last_hidden_state`` and ``hidden_states`` keep
the original tokens; the pooled output reads the class token as before). The hooks come
off on exit, also after an error.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .highnorm import vit_parts


def _check(neurons, outs) -> dict[int, list[int]]:
    if not isinstance(neurons, dict):
        raise ValueError(f"neurons: expected {{layer: [hidden units]}}, got {type(neurons).__name__}")
    out = {}
    for layer, units in neurons.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(outs):
            raise ValueError(f"neurons: layer {layer!r} is not one of the tower's {len(outs)} layers")
        width = outs[layer].in_features
        units = list(units)
        if not units or any(isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < width for u in units):
            raise ValueError(f"neurons: layer {layer} names {units!r}; expected a non-empty list of hidden units below {width}")
        out[layer] = units
    return out


@contextmanager
def test_time_registers(model, neurons: dict, count: int = 1):
    """Run ``model`` (a ViT tower) with ``count`` test-time registers taking the
    activations of ``neurons`` (see the module docstring)."""
    emb, _, outs = vit_parts(model)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    neurons = _check(neurons, outs)
    state = {}

    def append(mod, args, out):
        x = out[0] if isinstance(out, tuple) else out
        state["n"] = x.shape[1]
        x = torch.cat([x, x.new_zeros(x.shape[0], count, x.shape[2])], 1)
        return (x,) + tuple(out[1:]) if isinstance(out, tuple) else x

    def move(units):
        idx = torch.tensor(units)

        def hook(mod, args):
            a = args[0]
            n = state["n"]
            peak = a[:, :n, idx].amax(1, keepdim=True)  # (B, 1, units)
            a = a.clone()
            a[:, :n, idx] = 0.0
            a[:, n:, idx] = peak.expand(-1, a.shape[1] - n, -1)
            return (a,) + tuple(args[1:])

        return hook

    def drop(mod, args, out):
        n = state.get("n")
        if n is None:
            return out
        if getattr(out, "last_hidden_state", None) is not None:
            out.last_hidden_state = out.last_hidden_state[:, :n]
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h[:, :n] for h in out.hidden_states)
        return out

    handles = [emb.register_forward_hook(append), model.register_forward_hook(drop)]
    try:
        handles += [outs[layer].register_forward_pre_hook(move(units)) for layer, units in neurons.items()]
        yield model
    finally:
        for h in handles:
            h.remove()
