"""``PolicyCache``: a transformers ``Cache`` whose layers a KV policy prunes.

transformers gives a cache only keys and values (``update``), while a policy needs more:
which tokens are padding, the attention weights of some queries, and a mask that hides
evicted entries per head. So ``policy_cache`` also installs hooks on the model (once;
they do nothing unless the forward's cache is a ``PolicyCache``):

* on the model: records the 2-D padding mask of the forward and, for policies that read
  attention weights, runs the forward under ``attnkit.hf.use`` with an observer
  (``ReceivedMass``) on the query rows the policy asks for;
* before each attention module: replaces the mask transformers built (sized for a full
  cache) with the layer's own — causal over positions, the model's sliding window, each
  head's kept entries, Quest's pages — and, for StreamingLLM's cache positions, the RoPE
  tables;
* after each attention module: evicts (prefill, and decoding steps for the policies that
  say so) and gathers the kept entries into smaller tensors.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..kernels.cpu import kv as native_kv
from . import budget as budgets
from .layer import PolicyLayer
from .model_parts import attention_modules, recompute_queries, rotary_module, rotate, sliding_window
from .policies.base import Policy, Step
from .policies.quest import layer_extremes, page_choice, page_mask
from .scores import ReceivedMass
from .step_attention import NAME as STEP_NAME
from .step_attention import StepCall
from .step_attention import register as register_step_attention
from .weights import direct_ok, received_mass

Tensor = torch.Tensor
HOOKS_ATTR = "_attnkit_kv_hooks"
# While decoding, evicted entries are masked at once and the layer is gathered when more
# than max(MIN, length // DIV) of its slots are holes: the copy is amortised over that
# many tokens, at the price of holding up to 1/DIV more slots than the budget.
DECODE_SLACK_MIN, DECODE_SLACK_DIV = 16, 16


class PolicyCache(Cache):
    """A cache for ``model.generate(..., past_key_values=cache)`` (or ``cache=``) that keeps
    what ``policy`` selects within ``budget``. Build it with ``attnkit.kv.policy_cache``."""

    def __init__(self, model, policy, budget_spec: tuple[str, float], num_layers: int):
        super().__init__(layers=[PolicyLayer() for _ in range(num_layers)])
        optional = (("rope",) if getattr(policy, "positions", None) == "cache" else ()) + (("score",) if policy.keeps_score else ())
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
        self._armed: dict[int, Tensor] = {}  # layer -> RoPE positions of its pending update
        # layer -> how its pending update returns keys and values other than appending them all:
        # "fill" (the token takes the slot the last step evicted), "kept" (the kept entries
        # alone, gathered), a tensor of slots to gather per query head (Quest's pages), or for a
        # call that runs a C++ step of kernels.cpu.kv, "packed" (a packed layer's rows read in
        # place) or "quest" (pages chosen and read in place)
        self._update_as: dict[int, str | Tensor] = {}
        self._steps: dict[int, StepCall] = {}  # layer -> its step's attention runs in step_attention
        self._switched = None  # (config, its attention implementation) while a step runs in step_attention
        # Evicting while decoding by masking, not gathering: nothing outside the cache follows
        # the layout (Selective's state does; StreamingLLM's cache positions turn every kept key
        # each step anyway). Such a layer's next token may also take the evicted slot.
        self._masks_evictions = (policy.decodes and type(policy).after is Policy.after
                                 and getattr(policy, "positions", None) != "cache")
        self._weighed: dict[int, bool] = {}  # layer -> its call was asked for attention weights
        self._extra: dict[int, dict | None] = {}  # layer -> what the policy's `before` gathered
        self._switch = None
        # the weights a policy reads are computed by the cache itself (weights.py) when the
        # model allows it; the forward then stays on the model's own attention
        modules = attention_modules(model)
        self._first_module = modules[0] if modules else None
        self.plain = direct_ok(modules)  # plain scaled softmax, Llama-style queries
        self.direct = policy.needs_weights and self.plain
        self._plain_now = False
        self._direct_now = False
        self._queries: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> (queries of its rows, their positions)
        rot = rotary_module(model)
        self._rotary = rot
        self._inv_freq = None if rot is None else rot.inv_freq

    # ------------------------------------------------------------------ transformers API

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        rope = self._armed.pop(layer_idx, None)
        if rope is None:
            raise ValueError(
                "cache: this policy cache was used with a model that policy_cache did not prepare (its attention "
                "layers have no attnkit.kv hooks); build the cache with attnkit.kv.policy_cache(model, ...) for this model"
            )
        layer = self.layers[layer_idx]
        B, _, N, _ = key_states.shape
        how = self._update_as.pop(layer_idx, None)
        slots = how if isinstance(how, Tensor) else None  # Quest's pages, gathered
        how = None if slots is not None else how
        call = self._steps.get(layer_idx)
        if how == "fill":
            return layer.fill(key_states, value_states, rope)
        if how == "quest":
            # the pages' extremes of the slots held, before the new token joins them
            pages = layer_extremes(layer, self.policy.page_size, room=True)
            cached = layer.length
        out = layer.append(key_states, value_states, self._real(layer.seen, N, B, key_states.device), rope,
                           kept_only=how == "kept", slots=slots, materialise=how != "packed")
        if how == "packed":
            packed = layer._packed
            call.attend = lambda q, k, v, scale: native_kv.packed_attention(q, packed.k, packed.v, packed.source,
                                                                            packed.empty_row, scale)
        elif how == "quest":
            call.attend = lambda q, k, v, scale: self._quest_step(layer, q, scale, pages, cached)
        elif call is not None and call.attend is None and not layer.full:
            call.hide = ~layer.valid  # step_attention reads every slot: the empty ones are hidden there
        return out

    def _quest_step(self, layer: PolicyLayer, q: Tensor, scale: float, pages: tuple, cached: int) -> Tensor:
        """Quest's step in C++ (``kernels.cpu.kv.quest_attention``): pages chosen by their
        bounds, attention over them and the new token, the new key folded into the pages'
        extremes (kept in ``layer.memo``, which then covers every slot)."""
        size = self.policy.page_size
        tokens = self.policy.step_tokens(self.budget, torch.full((q.shape[0],), cached, device=q.device))
        out, _ = native_kv.quest_attention(q, layer.keys, layer.values, *pages, tokens, size, cached,
                                           self.policy.per_group, scale, True)
        layer.memo["quest_pages"] = (*pages, size, cached + 1)
        return out

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
        if type(self.policy).after is not Policy.after and any(layer.seen for layer in self.layers):
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
        return [[sorted(lay.pos[b, h][lay.valid[b, h]].tolist()) for h in range(lay.pos.shape[1])] for b in range(lay.pos.shape[0])]

    def kept_mask(self, layer: int, length: int | None = None) -> Tensor:
        """(B, Hkv, length) bool: which positions ``layer`` holds (length: tokens seen)."""
        lay = self.layers[layer]
        n = lay.seen if length is None else length
        out = torch.zeros(*lay.pos.shape[:2], n + 1, dtype=torch.bool)
        out.scatter_(2, torch.where(lay.valid, lay.pos, n).cpu(), True)
        return out[..., :n]

    # ------------------------------------------------------------------ hooks

    def begin_forward(self, model, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        self._padding = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        # a one-token step that needs a mask may run in step_attention (a plain softmax, and
        # no enclosing attnkit.hf.use block, whose attention it would replace)
        self._plain_now = self.plain and self.layers[0].calls > 0 and _outer_switch(self._first_module) is None
        # weights are read at prefill, and while decoding only by policies that evict then
        if self.scorer is not None and (self.layers[0].calls == 0 or self.policy.decodes):
            # inside an enclosing attnkit.hf.use block the attention may not be the model's
            # softmax: the scorer then joins that switch and sees the weights really used
            self._direct_now = self.direct and _outer_switch(self._first_module) is None
            if not self._direct_now:
                self._switch = _observe(model, self.scorer)

    def end_forward(self) -> None:
        self._padding = None
        self._armed.clear()
        self._update_as.clear()
        self._steps.clear()
        self._unswitch()
        self._weighed.clear()
        self._extra.clear()
        self._queries.clear()
        self._direct_now = False
        if self.scorer is not None:
            self.scorer.wanted.clear()
            self.scorer.mass.clear()
        if self._switch is not None:
            switch, self._switch = self._switch, None
            switch()

    def before_attention(self, module, args, kwargs) -> tuple:
        idx = module.layer_idx
        layer = self.layers[idx]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        B, Nq = hidden.shape[:2]
        phase = "prefill" if layer.calls == 0 else "decode"
        seen = layer.seen
        rope = kwargs.get("position_ids")
        rope = (torch.arange(seen, seen + Nq, device=hidden.device)[None] if rope is None else rope).expand(B, Nq)
        if getattr(self.policy, "positions", None) == "cache" and layer.calls > 0:
            # StreamingLLM: the new tokens sit right after the entries held
            rope = layer.lengths()[:, :1] + torch.arange(Nq, device=hidden.device)[None]
            kwargs["position_embeddings"] = self._rotary(hidden, rope)
        self._armed[idx] = rope
        if self.scorer is not None and self.policy.evicts(phase):
            rows = self.policy.rows(phase, Nq)
            if rows is not None:
                self._weighed[idx] = True
                if self._direct_now and phase == "decode" and self._steps_here(module, layer, hidden, Nq):
                    self._run_step_attention(module, idx, kwargs)  # the step's own softmax gives its weights
                elif (self._direct_now and rows == (0, Nq)
                        and (start := self._fused_prefill(module, layer, hidden)) is not None):
                    # every prompt query's weights (H2O): the attention and the mass in one C++ pass
                    self._run_step_attention(module, idx, kwargs)
                    call = self._steps[idx]
                    call.attend = lambda q, k, v, scale: _prefill_step(call, q, k, v, scale, start)
                elif self._direct_now:
                    lo, hi = rows
                    cos, sin = kwargs["position_embeddings"]
                    q = recompute_queries(module, hidden[:, lo:hi], (cos[:, lo:hi], sin[:, lo:hi]))
                    self._queries[idx] = (q, seen + torch.arange(lo, hi, device=hidden.device))
                else:
                    self.scorer.wanted[idx] = rows
        if self.policy.evicts(phase):
            self._extra[idx] = self.policy.before(module, layer, kwargs, phase)
        if layer.calls > 0:
            paged = self._paged(idx, layer)
            if (paged and layer.full and self._plain_now and self._native_step(hidden)
                    and self._steps_here(module, layer, hidden, Nq)):
                # Quest's step in one C++ pass over the pages where they lie: no recomputed query,
                # no gathered copy
                self._run_step_attention(module, idx, kwargs)
                self._update_as[idx] = "quest"
                return args, kwargs
            slots = self._page_slots(module, layer, hidden, kwargs) if paged and Nq == 1 else None
            fills = (not layer.full and self._masks_evictions and not hidden.requires_grad
                     and layer.one_hole_each() and self._all_real(layer.seen, 1))
            # an observer sums this call's weights onto the keys it is given: gathering the kept
            # entries would hand it fewer keys than the layer has slots, in gathered order
            observed = self.scorer is not None and idx in self.scorer.wanted
            if slots is not None:
                # one query per head over its pages: the pages' entries gathered per head,
                # no mask (attention reads those entries only, not the whole cache masked)
                kwargs["attention_mask"] = None
                self._update_as[idx] = slots
            elif idx in self._steps or (Nq == 1 and not paged and sliding_window(module) is None
                                        and (layer.full or fills or (layer.even() and not observed))):
                # one query that sees every kept entry: no mask (the path transformers takes
                # for a full cache, no O(L) mask). The slot the last step evicted takes the
                # new token; other holes are left out by gathering the kept entries, or
                # hidden by step_attention itself.
                kwargs["attention_mask"] = None
                if fills:
                    self._update_as[idx] = "fill"
                elif not layer.full and idx not in self._steps:
                    self._update_as[idx] = "kept"
            elif self._plain_now and not paged and self._steps_here(module, layer, hidden, Nq):
                # heads of different lengths (AdaKV, rows of different budgets): the step runs in
                # step_attention, which hides the empty slots itself (no mask to build or apply);
                # a packed layer's rows are read where they lie when the C++ step runs
                self._run_step_attention(module, idx, kwargs)
                if layer._packed is not None and idx not in self._weighed and self._native_step(hidden):
                    self._update_as[idx] = "packed"
            else:
                kwargs["attention_mask"] = self._mask(module, layer, hidden, kwargs, Nq)
        return args, kwargs

    def _evict_natively(self, layer: PolicyLayer, mass: Tensor | None, slack: int) -> bool:
        """A decoding step's eviction in one C++ pass (``kernels.cpu.kv``) for the policies
        that drop their lowest-scoring entry (H2O, TOVA), instead of ``select`` and ``drop``:
        the same kept sets. False (nothing done) without the operators, or when some head
        must drop more than one entry."""
        rule = self.policy.lowest_rule
        if rule is None or mass is None or mass.dtype not in (torch.float32, torch.float64) or not native_kv.available():
            return False
        slot, fewest, most = native_kv.evict_lowest(mass.contiguous(), layer.valid, layer.pos, layer.capacity,
                                                    layer.score, *rule)
        if slot is None:
            return False
        layer.settle(slack, (fewest, most))
        return True

    def _paged(self, idx: int, layer: PolicyLayer) -> bool:
        """Quest reads this layer's cache by pages (past its dense layers)."""
        return self.policy.name == "quest" and idx >= self.policy.dense_layers and layer.length > 0

    def _steps_here(self, module, layer: PolicyLayer, hidden: Tensor, Nq: int) -> bool:
        """Whether this one-token step's attention can run in ``step_attention``: a real
        token, a plain softmax on sdpa or eager (``direct``), no sliding window, no
        dropout."""
        return (Nq == 1 and module.config._attn_implementation in ("sdpa", "eager") and sliding_window(module) is None
                and not (module.training and getattr(module, "attention_dropout", 0.0))
                and self._all_real(layer.seen, 1))

    def _fused_prefill(self, module, layer: PolicyLayer, hidden: Tensor) -> Tensor | None:
        """Each row's first real token (B,) when this prefill's attention can run in C++ with
        the mass each key receives (``kernels.cpu.kv.prefill_attention``): a fresh layer,
        rows without padding or left-padded, a causal plain softmax on sdpa or eager, no
        sliding window or dropout, float32/float64, no autograd; else None."""
        if not (layer.seen == 0 and getattr(module, "is_causal", True) and module.config._attn_implementation in ("sdpa", "eager")
                and sliding_window(module) is None and not (module.training and getattr(module, "attention_dropout", 0.0))
                and self._native_step(hidden)):
            return None
        return self._prefill_start(hidden.shape[1], hidden.shape[0], hidden.device)

    @staticmethod
    def _native_step(hidden: Tensor) -> bool:
        """The C++ steps can take this call: float32/float64 (bf16 and fp16 take the PyTorch
        path) and no autograd (the operators have no backward)."""
        return hidden.dtype in (torch.float32, torch.float64) and not hidden.requires_grad and native_kv.available()

    def _prefill_start(self, n: int, batch: int, device) -> Tensor | None:
        """(B,) each row's first real token when the forward's first ``n`` tokens are
        left-padded (or not padded at all), else None."""
        pad = self._padding
        if pad is None or pad.shape[-1] < n:
            return torch.zeros(batch, dtype=torch.long, device=device)
        real = pad[:, :n].to(device=device, dtype=torch.bool)
        if not bool((real[:, 1:] >= real[:, :-1]).all()):
            return None  # a real token before a padded one: not left padding
        return n - real.sum(-1)

    def _run_step_attention(self, module, idx: int, kwargs: dict) -> None:
        """Route this layer's call to step_attention (until ``_unswitch``)."""
        self._steps[idx] = kwargs["attnkit_kv_step"] = StepCall()
        kwargs["attention_mask"] = None
        self._switched = (module.config, module.config._attn_implementation_internal)
        module.config._attn_implementation_internal = STEP_NAME

    def _unswitch(self) -> None:
        if self._switched is not None:
            config, impl = self._switched
            config._attn_implementation_internal = impl
            self._switched = None

    def _page_slots(self, module, layer: PolicyLayer, hidden: Tensor, kwargs: dict) -> Tensor | None:
        """Quest's step as slots to gather: (B, Hq, n) the slots of each query head's pages
        (B, Hkv, n with ``heads="group"``) and the new token's, when every row reads as
        many (else None: the mask path). Needs sdpa (which takes one key head per query
        head as GQA), a full layer and no sliding window."""
        if module.config._attn_implementation != "sdpa" or not layer.full or sliding_window(module) is not None:
            return None
        size = self.policy.page_size
        q = recompute_queries(module, hidden, kwargs["position_embeddings"])
        chosen = page_choice(q, layer.valid, self._page_tokens(layer), size, layer_extremes(layer, size),
                             self.policy.per_group)[:, :, 0]
        counts = chosen.sum(-1)
        if not bool((counts == counts.view(-1)[:1]).all()):
            return None  # rows with different budgets
        B, H, P = chosen.shape
        L = layer.length
        pages = chosen.nonzero()[:, 2].view(B, H, -1, 1)
        read = (pages * size + torch.arange(size, device=pages.device)).view(B, H, -1)
        # the incomplete last page, read by every head, comes last: its slots past L go
        read = read[..., : read.shape[-1] - (P * size - L)]
        return torch.cat([read, torch.full((B, H, 1), L, dtype=read.dtype, device=read.device)], -1)

    def _page_tokens(self, layer: PolicyLayer) -> Tensor:
        """Quest's tokens per row (B,) for a step over the entries the layer holds now."""
        held = layer.valid[:, 0].sum(-1)  # Quest evicts only padding: every head of a row holds the same entries
        return self.policy.step_tokens(self.budget, held)

    def _mask(self, module, layer: PolicyLayer, hidden: Tensor, kwargs: dict, n_new: int) -> Tensor:
        """The layer's mask for this call: cached entries then the call's own tokens."""
        dev = hidden.device
        B, Hkv, L = layer.valid.shape
        Hq = module.config.num_attention_heads
        g = Hq // Hkv
        window = sliding_window(module)
        policy = self.policy
        paged = self._paged(module.layer_idx, layer)
        if n_new == 1 and window is None and not paged:
            return self._as_impl(module, hidden, _step_mask(layer, g))
        q_pos = layer.seen + torch.arange(n_new, device=dev)
        old = layer.valid[:, :, None, :].expand(B, Hkv, n_new, L)
        if window is not None:
            old = old & (q_pos[None, None, :, None] - layer.pos[:, :, None, :] < window)
        old = old.repeat_interleave(g, 1)
        if paged:
            q = recompute_queries(module, hidden, kwargs["position_embeddings"])
            pages = layer_extremes(layer, policy.page_size)
            old = old & page_mask(q, layer.keys, layer.valid, self._page_tokens(layer), policy.page_size, pages,
                                  policy.per_group)
        j = torch.arange(n_new, device=dev)
        new = (j[None, :] <= j[:, None])[None, None]
        if window is not None:
            new = new & (j[:, None] - j[None, :] < window)
        real = self._real(layer.seen, n_new, B, dev)
        new = (new & real[:, None, None, :]) | torch.eye(n_new, dtype=torch.bool, device=dev)  # a padded query sees itself
        return self._as_impl(module, hidden, torch.cat([old, new.expand(B, Hq, n_new, n_new)], dim=-1))

    @staticmethod
    def _as_impl(module, hidden: Tensor, mask: Tensor) -> Tensor:
        """A boolean mask in the form the module's attention implementation takes."""
        impl = module.config._attn_implementation
        if impl == "eager":
            dtype = hidden.dtype
            return torch.where(mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
        if impl in ("sdpa", "attnkit"):
            return mask
        raise ValueError(f"model: attn_implementation {impl!r} cannot take a policy cache's per-head masks; use 'sdpa', 'eager' or attnkit")

    def after_attention(self, module) -> None:
        self._unswitch()
        idx = module.layer_idx
        layer = self.layers[idx]
        phase = "prefill" if layer.calls == 0 else "decode"
        layer.calls += 1
        B, Hkv = layer.valid.shape[:2]
        if phase == "prefill":
            real = layer.valid[:, 0].sum(-1)  # the prompt's real tokens, per row
            cap = self.policy.capacity(budgets.tokens(self.budget, real), idx, self.num_layers, real)
            layer.capacity = cap[:, None].expand(B, Hkv).clone()
        if not self.policy.evicts(phase):
            return
        if phase == "decode" and layer.ring is not None and layer.full:
            layer.roll()  # StreamingLLM's steady state: the ring says which entry goes
            return
        mass = None
        if self._weighed.pop(idx, False):
            if idx in self._steps:
                mass = self._steps.pop(idx).mass
            elif idx in self._queries:
                q, q_pos = self._queries.pop(idx)
                mass = received_mass(q, q_pos, layer.keys, layer.valid, layer.pos, float(module.scaling),
                                     sliding_window(module), phase == "prefill", all_valid=layer.full or None,
                                     appended=phase == "decode")
            else:
                mass = self.scorer.mass.pop(idx, None)
            if mass is not None:
                mass = mass.to(layer.device)
            else:
                raise ValueError(
                    f"model: policy {self.policy.name!r} reads attention weights, but none arrived from layer {idx}; the "
                    "model must run its attention through attnkit (pass the cache as a keyword: cache= or past_key_values=)"
                )
        extra = self._extra.pop(idx, None)
        slack = max(DECODE_SLACK_MIN, layer.length // DECODE_SLACK_DIV)
        if phase == "decode" and self._masks_evictions and self._evict_natively(layer, mass, slack):
            return
        step = Step(idx, self.num_layers, phase, layer.keys, layer.valid, layer.pos, layer.capacity, mass, layer.score,
                    layer.seen, extra, None if layer.ordered else layer.pos)
        keep = self.policy.select(step)
        if phase == "decode" and self._masks_evictions:
            layer.drop(keep, slack)
            if self.policy.rolling and layer.ring is None:
                layer.start_ring()
        else:
            order = layer.compact(keep)
            self.policy.after(module, layer, order, extra)
            if phase == "prefill" and not self.policy.decodes and self.policy.name != "quest":
                # nothing is evicted from here on: hold the kept entries without padding
                # (Quest reads its keys every step, to extend its pages)
                layer.pack()
        if getattr(self.policy, "positions", None) == "cache":
            target = torch.where(layer.valid, layer.valid.cumsum(-1) - 1, layer.rope)
            layer.keys = rotate(layer.keys, target - layer.rope, self._inv_freq)
            layer.rope = torch.where(layer.valid, target, -1)


def _prefill_step(call: StepCall, q: Tensor, k: Tensor, v: Tensor, scale: float, start: Tensor) -> Tensor:
    """A prefill's causal attention in C++, its mass (every real query's weights summed per
    key) left in ``call.mass`` for the policy."""
    out, call.mass = native_kv.prefill_attention(q, k, v, scale, start)
    return out


def _step_mask(layer: PolicyLayer, g: int) -> Tensor:
    """A one-token step's mask, (B, Hq, 1, L + 1): each query head sees its KV head's kept
    entries, and the token itself. Kept in ``layer.memo`` (emptied whenever existing slots
    change) and extended by the slots appended since, so that a step writes a column or
    two instead of building the mask again."""
    B, Hkv, L = layer.valid.shape
    storage, done = layer.memo.get("step_mask", (None, 0))
    if storage is None or storage.shape[-1] < L + 1:
        grown = torch.empty(B, Hkv * g, 1, L + 1 + max(1, (L + 1) // 16), dtype=torch.bool, device=layer.valid.device)
        if storage is not None:
            grown[..., :done] = storage[..., :done]
        storage = grown
    storage[..., done:L] = layer.valid[:, :, None, done:L].repeat_interleave(g, 1)
    storage[..., L] = True  # a query sees itself, padded or not
    layer.memo["step_mask"] = (storage, L)  # its own column is rewritten from ``valid`` next time
    return storage[..., : L + 1]


def _outer_switch(module):
    from ..hf.switch import active_switch

    return active_switch(module)[0]


def _observe(model, scorer) -> callable:
    """Run the model's attention through attnkit with ``scorer`` watching; returns the
    function that undoes it. Inside an ``attnkit.hf.use`` block the scorer joins it."""
    from ..hf.switch import active_switch, use

    modules = attention_modules(model)
    outer, _ = active_switch(modules[0])
    if outer is not None:
        before = outer.observers
        outer.observers = list(before or []) + [scorer]

        def undo():
            outer.observers = before

        return undo
    ctx = use(model, observers=[scorer])
    ctx.__enter__()
    return lambda: ctx.__exit__(None, None, None)


# ---------------------------------------------------------------------- hook installation


def _cache_of(kwargs: dict):
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    return cache if isinstance(cache, PolicyCache) else None


def _model_pre(model, args, kwargs):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.begin_forward(model, kwargs)


def _model_post(model, args, kwargs, output):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.end_forward()


def _attn_pre(module, args, kwargs):
    cache = _cache_of(kwargs)
    if cache is not None:
        return cache.before_attention(module, args, kwargs)
    return None


def _attn_post(module, args, kwargs, output):
    cache = _cache_of(kwargs)
    if cache is not None:
        cache.after_attention(module)


def install_hooks(model) -> None:
    """Hook ``model`` once; the hooks act only on forwards whose cache is a PolicyCache."""
    register_step_attention()
    if getattr(model, HOOKS_ATTR, None):
        return
    handles = [
        model.register_forward_pre_hook(_model_pre, with_kwargs=True),
        model.register_forward_hook(_model_post, with_kwargs=True, always_call=True),
    ]
    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(_attn_pre, with_kwargs=True))
        handles.append(m.register_forward_hook(_attn_post, with_kwargs=True))
    object.__setattr__(model, HOOKS_ATTR, handles)


def detach(model) -> None:
    """Remove the hooks ``policy_cache`` installed on ``model`` (policy caches then stop
    working with it)."""
    for handle in getattr(model, HOOKS_ATTR, None) or ():
        handle.remove()
    if hasattr(model, HOOKS_ATTR):
        object.__delattr__(model, HOOKS_ATTR)
