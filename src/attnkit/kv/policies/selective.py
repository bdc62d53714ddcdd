"""Selective attention's context pruning (Leviathan, Kalman, Matias 2024, "Selective
Attention Improves Transformer", arXiv 2410.02703, Sec. 4) as a cache policy, for models
trained with selective attention and run with ``attnkit.hf.use(model,
mechanism="selective")``.

Each query adds to F, per key, the ReLU of the selector head's logits; a key with a
large F is masked from every later query, so it can go. Queries are visited in order;
whenever the buffer holds more than the budget, the held entry with the highest F as
that query sees it is evicted (never <BOS>, the row's first token). At prefill this is
``attnkit.mechanisms.selective.prune_context`` on the layer's queries and keys (each row
without its padding, as the mechanism treats a left-padded row); while decoding, one
entry at most goes per new token, using the F the switch carries for the layer, and that
F then follows the kept entries. All heads of a row keep the same entries (one F per row).
"""

from __future__ import annotations

import math

import torch

from ...mechanisms.selective import prune_context
from ...mods import causal
from ..model_parts import recompute_queries
from .base import Policy, Step

Tensor = torch.Tensor


class Selective(Policy):
    name = "selective"
    paper = "arXiv:2410.02703"
    params = {}
    decodes = True
    needs_mechanism = "selective"
    recomputes_queries = True
    state_outside = True  # F, in the switch's decode state, follows the kept entries

    def before(self, module, layer, kwargs, phase):
        from ...hf.switch import active_switch

        switch, index = active_switch(module)
        mech = None if switch is None else switch.mechanism
        name = getattr(mech, "name", mech)
        if name != "selective" or not switch.applies_to(index):
            raise ValueError(
                "policy: 'selective' prunes with the selection F of selective attention; run generate inside "
                "attnkit.hf.use(model, mechanism='selective') (for a model trained with it)"
            )
        extra = {"switch": switch, "scale": float(module.scaling)}
        if phase == "prefill":
            extra["q"] = recompute_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"])
        else:
            state, _ = switch.decode_states[index]
            extra["f_before"] = state.to(torch.float64)
        return extra

    def select(self, step: Step) -> Tensor:
        extra = step.extra
        assert extra is not None  # what before gathered for this call
        selector = extra["switch"].mechanisms[step.layer].selector_head
        valid = step.valid[:, 0]  # one set per row: every head keeps the same entries
        held = torch.zeros_like(valid)
        if step.phase == "prefill":
            for b in range(valid.shape[0]):
                real = valid[b].nonzero().flatten()
                # prune_context keeps its bookkeeping on the CPU
                q = extra["q"][b : b + 1, :, real].cpu()
                k = step.keys[b : b + 1, :, real].cpu()
                kept = prune_context(q, k, int(step.capacity[b, 0]), mask=causal(), scale=extra["scale"], selector_head=selector)
                held[b, real] = kept[0].to(held.device)
        else:
            f_before = extra["f_before"].to(valid.device)
            f = torch.nn.functional.pad(f_before, (0, valid.shape[1] - f_before.shape[1]))
            held = valid.clone()
            bos = valid.to(torch.int8).argmax(-1)
            rows = torch.arange(valid.shape[0], device=valid.device)
            while True:
                over = held.sum(-1) > step.capacity[:, 0]
                if not bool(over.any()):
                    break
                score = f.masked_fill(~held, -math.inf)
                score[rows, bos] = -math.inf
                worst = score.argmax(-1)  # the highest F; ties to the earliest entry
                held[rows[over], worst[over]] = False
        return held[:, None, :].expand_as(step.valid)

    def after(self, module, layer, order, extra):
        from ...hf.switch import active_switch

        switch, index = active_switch(module)
        state, _ = switch.decode_states[index]
        row_order = order[:, 0].to(state.device)
        kept = torch.where(layer.valid[:, 0].to(state.device), state.gather(1, row_order), 0.0)
        switch.decode_states[index] = (kept, layer.length)

    def reference(self, weights, keys, held, capacity, state, phase):
        raise NotImplementedError("selective's reference is prune_context on the layer's queries and keys (see the tests)")
