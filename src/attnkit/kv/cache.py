"""``PolicyCache``: a transformers ``Cache`` whose layers a KV policy prunes.

transformers gives a cache only keys and values (``update``), while a policy needs more:
which tokens are padding, the attention weights of some queries, and a mask that hides
evicted entries per head. So ``policy_cache`` also installs hooks on the model
(``hooks.py``; they do nothing unless the forward's cache is a ``PolicyCache``), and the
cache routes each attention call by what its policy declares (``Policy``'s capabilities,
never its name):

* before each attention call: the RoPE positions of the new tokens (re-rotating policies
  encode them at the cache's length), the weights the policy reads (computed by the
  cache, by a C++ step, or observed through ``attnkit.hf.use``), and how the call reads
  the layer (``Read``): every slot, the hole the last step left, the kept entries
  gathered, the slots a sparse-reading policy picks, or a C++ step (``steps.py``) over
  the layer where it lies; else a mask (``masks.py``);
* after each attention call: evicts (prefill, and decoding steps for the policies that
  evict then) and gathers the kept entries into smaller tensors.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from . import budget as budgets
from . import masks, steps
from .hooks import HookedCache, detach, install_hooks, observe, outer_switch
from .layer import PolicyLayer
from .model_parts import (
    attention_modules,
    recompute_queries,
    rotary_module,
    rotate,
    sliding_window,
)
from .policies.base import Policy, Step
from .ring import Ring
from .scores import ReceivedMass
from .step_attention import StepCall
from .weights import direct_ok, received_mass

__all__ = ["PolicyCache", "Read", "detach", "install_hooks"]

Tensor = torch.Tensor
# While decoding, evicted entries are masked at once and the layer is gathered when more
# than max(MIN, length // DIV) of its slots are holes: the copy is amortised over that
# many tokens, at the price of holding up to 1/DIV more slots than the budget.
DECODE_SLACK_MIN, DECODE_SLACK_DIV = 16, 16


class Read(enum.Enum):
    """How a call's update appends its tokens and what it hands the attention."""

    #: append after the slots held; attention over every slot (masked if need be)
    ALL_SLOTS = enum.auto()
    #: the token takes the slot the last step evicted (one hole per head): no mask
    FILL_HOLE = enum.auto()
    #: append, then gather the kept entries alone (every head keeps as many): no mask
    KEPT_ONLY = enum.auto()
    #: append, then gather the slots the policy's sparse read picked, per query head
    SPARSE_SLOTS = enum.auto()
    #: append into the packed rows; a C++ step reads them where they lie
    PACKED_IN_PLACE = enum.auto()
    #: append; the policy's C++ sparse step reads the slots where they lie
    SPARSE_IN_PLACE = enum.auto()


@dataclass
class Call:
    """What ``before_attention`` prepared for one layer's call, used by ``update`` and
    ``after_attention``."""

    rope: Tensor | None  # (B, Nq) the RoPE positions of the call's tokens (None once update took them)
    read: Read = Read.ALL_SLOTS
    slots: Tensor | None = None  # Read.SPARSE_SLOTS: the slots to gather
    step: StepCall | None = None  # the call runs in step_attention
    weighed: bool = False  # the policy reads this call's attention weights
    queries: tuple[Tensor, Tensor] | None = None  # (queries of the weighed rows, their positions), computed here
    extra: dict | None = None  # what the policy's ``before`` gathered
    attend_after_append: object = None  # Read.SPARSE_IN_PLACE: the policy's step, from ``read_in_place``


class PolicyCache(Cache, HookedCache):
    """A cache for ``model.generate(..., past_key_values=cache)`` (or ``cache=``) that keeps
    what ``policy`` selects within ``budget``. Build it with ``attnkit.kv.policy_cache``."""

    layers: list[PolicyLayer]  # type: ignore[assignment]  # it holds PolicyLayers only; Cache's list type is invariant

    def __init__(self, model, policy: Policy, budget_spec: tuple[str, float], num_layers: int):
        super().__init__(layers=[PolicyLayer() for _ in range(num_layers)])
        optional = (("rope",) if policy.rerotates_keys else ()) + (("score",) if policy.keeps_score else ())
        for layer in self.layers:
            # a rollback (crop) restores a layer exactly only if no entry was evicted after the
            # prefill: transformers' assisted decoding asks for that
            layer.is_croppable = not policy.decodes
            layer.optional = optional
        self.policy = policy
        self.budget = budget_spec
        self.num_layers = num_layers
        self.scorer = ReceivedMass() if policy.needs_weights else None
        self._model = weakref.ref(model)
        self._padding: Tensor | None = None  # the 2-D mask of the forward in progress
        self._calls: dict[int, Call] = {}  # layer -> its call in progress
        self._rings: dict[int, Ring] = {}  # layer -> a rolling window's ring (while its layout holds)
        self._switch = steps.StepSwitch()  # a call routed to step_attention, until it ends
        # Evicting while decoding by masking, not gathering: nothing outside the cache follows
        # the layout (re-rotated keys are turned every step anyway). Such a layer's next
        # token may also take the evicted slot.
        self._masks_evictions = policy.decodes and not policy.state_outside and not policy.rerotates_keys
        # undoes the observing switch of a forward whose weights attnkit observes
        self._unobserve: Callable[[], object] | None = None
        # the weights a policy reads are computed by the cache itself (weights.py) when the
        # model allows it; the forward then stays on the model's own attention
        modules = attention_modules(model)
        self._first_module = modules[0] if modules else None
        self.plain = direct_ok(modules)  # plain scaled softmax, Llama-style queries
        self.direct = policy.needs_weights and self.plain
        #: this forward's one-token steps may run in step_attention (no enclosing attnkit.hf.use)
        self._may_step = False
        #: this forward's weights are computed by the cache (else observed)
        self._computes_weights = False
        rot = rotary_module(model)
        self._rotary = rot
        self._inv_freq = None if rot is None else rot.inv_freq

    # ------------------------------------------------------------------ transformers API

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        call = self._calls.get(layer_idx)
        if call is None or call.rope is None:
            raise ValueError(
                "cache: this policy cache was used with a model that policy_cache did not prepare (its attention "
                "layers have no attnkit.kv hooks); build the cache with attnkit.kv.policy_cache(model, ...) for this model"
            )
        rope, call.rope = call.rope, None
        layer = self.layers[layer_idx]
        B, _, N, _ = key_states.shape
        read = call.read
        if read is Read.FILL_HOLE:
            ring = self._ring(layer_idx)
            return layer.fill(key_states, value_states, rope, None if ring is None else ring.hole)
        attend = self.policy.read_in_place(layer, self.budget) if read is Read.SPARSE_IN_PLACE else None
        out = layer.append(
            key_states,
            value_states,
            self._real(layer.seen, N, B, key_states.device),
            rope,
            kept_only=read is Read.KEPT_ONLY,
            slots=call.slots,
            materialise=read is not Read.PACKED_IN_PLACE,
        )
        step = call.step
        if read is Read.PACKED_IN_PLACE:
            assert step is not None  # _route entered step_attention for it
            step.attend = steps.packed_attend(layer._packed)
        elif read is Read.SPARSE_IN_PLACE:
            assert step is not None  # _route entered step_attention for it
            step.attend = attend
        elif step is not None and step.attend is None and not layer.full:
            assert layer.valid is not None  # appended to above
            step.hide = ~layer.valid  # step_attention reads every slot: the empty ones are hidden there
        return out

    def _ring(self, idx: int) -> Ring | None:
        ring = self._rings.get(idx)
        return ring if ring is not None and ring.holds(self.layers[idx]) else None

    def rolling_ring(self, layer: int) -> tuple[int, int, int] | None:
        """(start, size, hole) of the ring a rolling window's slots go round in ``layer``
        (``ring.Ring``), or None while there is none."""
        ring = self._ring(layer)
        return None if ring is None else ring.as_tuple()

    def _real(self, seen: int, n: int, batch: int, device) -> Tensor:
        pad = self._padding
        if pad is None or pad.shape[-1] < seen + n:
            return torch.ones(batch, n, dtype=torch.bool, device=device)
        return pad[:, seen : seen + n].to(device=device, dtype=torch.bool)

    def _all_real(self, seen: int, n: int) -> bool:
        """No padding among the forward's tokens seen.. seen + n - 1."""
        pad = self._padding
        return pad is None or pad.shape[-1] < seen + n or bool(pad[:, seen : seen + n].all())

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens in every layer (see ``PolicyLayer.crop``)."""
        if self.policy.state_outside and any(layer.seen for layer in self.layers):
            raise ValueError(f"cache: policy {self.policy.name!r} keeps state beside the cache that a crop cannot roll back")
        super().crop(tokens_to_remove)

    # ------------------------------------------------------------------ what it holds

    def nbytes(self) -> int:
        """Bytes actually allocated by every layer (keys, values and bookkeeping)."""
        return sum(layer.nbytes() for layer in self.layers)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def lengths(self, layer: int) -> Tensor:
        """Entries kept per (row, KV head) in ``layer``, (B, Hkv)."""
        return self.layers[layer].lengths()

    def kept_positions(self, layer: int) -> list[list[list[int]]]:
        """Token positions (indices in the padded sequence) kept by each row and KV head."""
        lay = self.layers[layer]
        assert lay.pos is not None and lay.valid is not None  # a layer that has been filled
        return [
            [sorted(lay.pos[b, h][lay.valid[b, h]].tolist()) for h in range(lay.pos.shape[1])] for b in range(lay.pos.shape[0])
        ]

    def kept_mask(self, layer: int, length: int | None = None) -> Tensor:
        """(B, Hkv, length) bool: which positions ``layer`` holds (length: tokens seen)."""
        lay = self.layers[layer]
        assert lay.pos is not None and lay.valid is not None  # a layer that has been filled
        n = lay.seen if length is None else length
        out = torch.zeros(*lay.pos.shape[:2], n + 1, dtype=torch.bool)
        out.scatter_(2, torch.where(lay.valid, lay.pos, n).cpu(), True)
        return out[..., :n]

    # ------------------------------------------------------------------ hooks

    def begin_forward(self, model, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        self._padding = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        outer = outer_switch(self._first_module)
        # a one-token step that needs a mask may run in step_attention (a plain softmax, and
        # no enclosing attnkit.hf.use block, whose attention it would replace)
        self._may_step = self.plain and self.layers[0].calls > 0 and outer is None
        # weights are read at prefill, and while decoding only by policies that evict then
        if self.scorer is not None and (self.layers[0].calls == 0 or self.policy.decodes):
            # inside an enclosing attnkit.hf.use block the attention may not be the model's
            # softmax: the scorer then joins that switch and sees the weights really used
            self._computes_weights = self.direct and outer is None
            if not self._computes_weights:
                self._unobserve = observe(model, self.scorer)

    def end_forward(self) -> None:
        self._padding = None
        self._calls.clear()
        self._switch.leave()
        self._computes_weights = False
        if self.scorer is not None:
            self.scorer.wanted.clear()
            self.scorer.mass.clear()
        if self._unobserve is not None:
            undo, self._unobserve = self._unobserve, None
            undo()

    def before_attention(self, module, args: tuple, kwargs: dict) -> tuple:
        """Prepare one layer's attention call: the new tokens' RoPE positions, the weights
        the policy reads (``_ask_for_weights``), what the policy's ``before`` gathers, and,
        for a call after the prefill, how it reads the layer (``_route``). Rewrites
        ``kwargs`` (the mask, the position embeddings) and returns ``(args, kwargs)``."""
        idx = module.layer_idx
        layer = self.layers[idx]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        phase = "prefill" if layer.calls == 0 else "decode"
        call = self._calls[idx] = Call(rope=self._positions(layer, hidden, kwargs))
        if self.policy.evicts(phase):
            if self.scorer is not None:
                self._ask_for_weights(module, layer, hidden, kwargs, call, phase)
            call.extra = self.policy.before(module, layer, kwargs, phase)
        if layer.calls > 0:
            self._route(module, layer, hidden, kwargs, call)
        return args, kwargs

    def _positions(self, layer: PolicyLayer, hidden: Tensor, kwargs: dict) -> Tensor:
        """(B, Nq) the RoPE positions of the call's tokens: the model's, or for a policy
        that re-rotates its keys (after the prefill), right after the entries held, with
        the call's position embeddings replaced to match."""
        B, Nq = hidden.shape[:2]
        rope = kwargs.get("position_ids")
        rope = (torch.arange(layer.seen, layer.seen + Nq, device=hidden.device)[None] if rope is None else rope).expand(B, Nq)
        if self.policy.rerotates_keys and layer.calls > 0:
            rope = layer.lengths()[:, :1] + torch.arange(Nq, device=hidden.device)[None]
            kwargs["position_embeddings"] = self._rotary(hidden, rope)
        return rope

    def _ask_for_weights(self, module, layer: PolicyLayer, hidden: Tensor, kwargs: dict, call: Call, phase: str) -> None:
        """Arrange for the weights of the rows the policy asks for: from a one-token step's
        own softmax (step_attention), from a fused C++ prefill, recomputed after the call
        (weights.py), or observed through attnkit's switch."""
        Nq = hidden.shape[1]
        rows = self.policy.rows(phase, Nq)
        if rows is None:
            return
        call.weighed = True
        if not self._computes_weights:
            assert self.scorer is not None  # asked only for a policy that reads weights
            self.scorer.wanted[module.layer_idx] = rows
        elif phase == "decode" and steps.runs_in_step_attention(module, Nq, self._all_real(layer.seen, 1)):
            call.step = self._switch.enter(module, kwargs)  # the step's own softmax gives its weights
        elif rows == (0, Nq) and (start := steps.fused_prefill_start(module, layer.seen, hidden, self._padding)) is not None:
            # every prompt query's weights: the attention and the mass in one C++ pass
            call.step = self._switch.enter(module, kwargs)
            call.step.attend = steps.prefill_attend(call.step, start)
        else:
            lo, hi = rows
            cos, sin = kwargs["position_embeddings"]
            q = recompute_queries(module, hidden[:, lo:hi], (cos[:, lo:hi], sin[:, lo:hi]))
            call.queries = (q, layer.seen + torch.arange(lo, hi, device=hidden.device))

    def _route(self, module, layer: PolicyLayer, hidden: Tensor, kwargs: dict, call: Call) -> None:
        """How a call after the prefill reads the layer (``call.read``), cheapest first: a
        sparse read's C++ step over the slots where they lie; the slots it picks,
        gathered; no mask at all for one query that sees every kept entry (every slot, the
        hole the last step left, or the kept entries gathered); step_attention, which
        hides the empty slots itself (heads of different lengths); else a mask."""
        idx = module.layer_idx
        Nq = hidden.shape[1]
        sparse = self._reads_sparsely(idx, layer)
        one_step = self._may_step and steps.runs_in_step_attention(module, Nq, self._all_real(layer.seen, 1))
        if sparse and self.policy.sparse_reads_in_place and layer.full and one_step and steps.native_ok(hidden):
            call.step = self._switch.enter(module, kwargs)
            call.read = Read.SPARSE_IN_PLACE
            return
        slots = self.policy.read_slots(module, layer, hidden, kwargs, self.budget) if sparse and Nq == 1 else None
        fills = (
            not layer.full
            and self._masks_evictions
            and not hidden.requires_grad
            and layer.one_hole_each()
            and self._all_real(layer.seen, 1)
        )
        # an observer sums this call's weights onto the keys it is given: gathering the kept
        # entries would hand it fewer keys than the layer has slots, in gathered order
        observed = self.scorer is not None and idx in self.scorer.wanted
        if slots is not None:
            # one query per head over its slots, gathered per head: no mask (attention reads
            # those entries only, not the whole cache masked)
            kwargs["attention_mask"] = None
            call.read, call.slots = Read.SPARSE_SLOTS, slots
        elif call.step is not None or (
            Nq == 1 and not sparse and sliding_window(module) is None and (layer.full or fills or (layer.even() and not observed))
        ):
            # one query that sees every kept entry: no mask (the path transformers takes for a
            # full cache, no O(L) mask). The slot the last step evicted takes the new token;
            # other holes are left out by gathering the kept entries, or hidden by
            # step_attention itself.
            kwargs["attention_mask"] = None
            if fills:
                call.read = Read.FILL_HOLE
            elif not layer.full and call.step is None:
                call.read = Read.KEPT_ONLY
        elif not sparse and one_step:
            # heads of different lengths (rows of different budgets, heads sharing a layer's
            # budget): the step runs in step_attention, which hides the empty slots itself; a
            # packed layer's rows are read where they lie when the C++ step runs
            call.step = self._switch.enter(module, kwargs)
            if layer._packed is not None and not call.weighed and steps.native_ok(hidden):
                call.read = Read.PACKED_IN_PLACE
        else:
            kwargs["attention_mask"] = self._mask(module, layer, hidden, kwargs, Nq)

    def _reads_sparsely(self, idx: int, layer: PolicyLayer) -> bool:
        """The policy reads only part of this layer per query while decoding."""
        return self.policy.sparse_reads and self.policy.reads_layer(idx) and layer.length > 0

    def _mask(self, module, layer: PolicyLayer, hidden: Tensor, kwargs: dict, n_new: int) -> Tensor:
        """The layer's mask for this call (``masks.layer_mask``), with the policy's sparse
        reads when it has them."""
        read = None
        if self._reads_sparsely(module.layer_idx, layer):

            def read():
                return self.policy.read_mask(module, layer, hidden, kwargs, self.budget)

        real = self._real(layer.seen, n_new, hidden.shape[0], hidden.device)
        return masks.layer_mask(module, layer, hidden, n_new, real, read)

    def after_attention(self, module) -> None:
        """After one layer's attention call: fix the layer's capacity at the prefill, then
        evict (for the phases the policy evicts in) by the policy's ``select``, a rolling
        window's ring, or a C++ step, and gather or mask what went."""
        self._switch.leave()
        idx = module.layer_idx
        layer = self.layers[idx]
        call = self._calls.pop(idx, None)
        phase = "prefill" if layer.calls == 0 else "decode"
        layer.calls += 1
        B, Hkv = layer.valid.shape[:2]
        if phase == "prefill":
            real = layer.valid[:, 0].sum(-1)  # the prompt's real tokens, per row
            cap = self.policy.capacity(budgets.tokens(self.budget, real), idx, self.num_layers, real)
            layer.capacity = cap[:, None].expand(B, Hkv).clone()
        if not self.policy.evicts(phase):
            return
        ring = self._ring(idx) if phase == "decode" else None
        if ring is not None and layer.full:
            ring.roll(layer)  # a rolling window's steady state: the ring says which entry goes
            return
        mass = self._mass(module, layer, call, phase) if call is not None and call.weighed else None
        extra = None if call is None else call.extra
        slack = max(DECODE_SLACK_MIN, layer.length // DECODE_SLACK_DIV)
        if phase == "decode" and self._masks_evictions and steps.evict_lowest(self.policy.lowest_rule, layer, mass, slack):
            return
        step = Step(
            idx,
            self.num_layers,
            phase,
            layer.keys,
            layer.valid,
            layer.pos,
            layer.capacity,
            mass,
            layer.score,
            layer.seen,
            extra,
            None if layer.ordered else layer.pos,
        )
        keep = self.policy.select(step)
        if phase == "decode" and self._masks_evictions:
            layer.drop(keep, slack)
            if self.policy.rolling and self._ring(idx) is None:
                ring = Ring.find(layer)
                if ring is not None:
                    self._rings[idx] = ring
        else:
            order = layer.compact(keep)
            self.policy.after(module, layer, order, extra)
            if phase == "prefill" and self.policy.packs_heads:
                layer.pack()  # nothing is evicted from here on: hold the kept entries without padding
        if self.policy.rerotates_keys:
            assert self._inv_freq is not None  # policy_cache refuses a re-rotating policy for a model without RoPE
            target = torch.where(layer.valid, layer.valid.cumsum(-1) - 1, layer.rope)
            layer.keys = rotate(layer.keys, target - layer.rope, self._inv_freq)
            layer.rope = torch.where(layer.valid, target, -1)

    def _mass(self, module, layer: PolicyLayer, call: Call, phase: str) -> Tensor:
        """(B, Hq, L) the weights of the call's requested rows summed onto the layer's slots:
        from step_attention or the fused prefill, computed here, or observed."""
        idx = module.layer_idx
        if call.step is not None:
            mass = call.step.mass
        elif call.queries is not None:
            q, q_pos = call.queries
            keys, valid, pos = layer.keys, layer.valid, layer.pos
            assert keys is not None and valid is not None and pos is not None  # the call appended to the layer
            mass = received_mass(
                q,
                q_pos,
                keys,
                valid,
                pos,
                float(module.scaling),
                sliding_window(module),
                phase == "prefill",
                all_valid=layer.full or None,
                appended=phase == "decode",
            )
        else:
            assert self.scorer is not None  # weighed calls are those of a policy that reads weights
            mass = self.scorer.mass.pop(idx, None)
        if mass is None:
            raise ValueError(
                f"model: policy {self.policy.name!r} reads attention weights, but none arrived from layer {idx}; the "
                "model must run its attention through attnkit (pass the cache as a keyword: cache= or past_key_values=)"
            )
        return mass.to(layer.device)
