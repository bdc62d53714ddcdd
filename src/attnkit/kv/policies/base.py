"""What every KV-cache policy is: a named rule that says which entries of a layer to
keep, a ``reference`` of the same rule written from its paper on dense tensors, and its
capabilities: class attributes the cache routes by (does it read attention weights and of
which query rows, does it evict while decoding, roll a window, keep a score, read only
part of the cache per query, hold its heads packed ...). The cache never asks a policy's
name: a new policy is one file that subclasses ``Policy`` and its registration in
``POLICIES``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class Step:
    """One layer after one attention call, in the cache's layout (L entries per head).

    ``mass`` (B, Hq, L): attention weights summed over the query rows the policy asked
    for (``rows``), from attnkit's observers; None for a policy that reads no weights."""

    layer: int
    num_layers: int
    phase: str  # "prefill" (the call that filled the layer) or "decode"
    keys: Tensor  # (B, Hkv, L, D)
    valid: Tensor  # (B, Hkv, L) bool
    pos: Tensor  # (B, Hkv, L) token positions
    capacity: Tensor  # (B, Hkv) entries to keep
    mass: Tensor | None
    score: Tensor  # (B, Hkv, L) float64, the layer's accumulated score (policies may update it in place)
    seen: int  # tokens fed to the layer so far
    extra: dict | None = None  # what the policy's ``before`` gathered for this call
    #: None when the layout is in position order; else ``pos``, which then orders the
    #: entries (a decoding step's token may fill an evicted entry's slot: ``PolicyLayer.fill``)
    order: Tensor | None = None


class Policy:
    """Base class. Subclasses set ``name``, ``paper``, ``params`` (name -> default) and
    implement ``select`` (fast, on the cache layout) and ``reference`` (literal)."""

    name = "policy"
    paper = ""
    #: parameter name -> default value
    params: dict = {}
    #: reads attention weights (then the model must be one attnkit can switch)
    needs_weights = False
    #: evicts after decoding steps too, not only at prefill
    decodes = False
    #: a decoding step evicts the oldest entry after a fixed prefix (StreamingLLM), so the
    #: evicted slots go round a ring that the cache can follow without calling ``select``
    rolling = False
    #: reads and updates ``Step.score``, an accumulated score per entry (H2O)
    keeps_score = False
    #: the attnkit mechanism the model must run under (``attnkit.hf.use(model,
    #: mechanism=...)``, a model trained with it), or None for any model
    needs_mechanism: str | None = None
    #: a decoding step's rule as the C++ operator runs it (``kernels.cpu.kv.evict_lowest``:
    #: drop the lowest-scoring entry), (mode, recent share); None: only ``select``
    lowest_rule: tuple[int, float] | None = None
    #: holds a layer's heads packed (without padding to the longest head) once the prefill
    #: evicted: for policies that evict nothing after it and read every slot
    packs_heads = False
    #: recomputes a layer's queries from its inputs (``q_proj`` + RoPE): the model's
    #: attention modules must be Llama-style
    recomputes_queries = False
    #: keeps state outside the cache that follows the kept entries (``after``): evictions
    #: gather the layer at once, and a crop cannot roll it back
    state_outside = False
    #: re-rotates the kept keys to positions within the cache after each eviction and
    #: encodes new tokens at the cache's length (StreamingLLM's ``positions="cache"``)
    rerotates_keys = False
    #: while decoding, each query reads only part of the layer (``reads_layer``): the
    #: cache asks the policy for the slots to gather (``read_slots``), or else the mask of
    #: what each query reads (``read_mask``)
    sparse_reads = False
    #: a sparse read can run as one C++ step over the slots where they lie
    #: (``read_in_place``), when every slot holds a kept entry
    sparse_reads_in_place = False

    def __init__(self, **params):
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join(self.params) or "none"
            raise ValueError(f"{unknown[0]}: not a parameter of policy {self.name!r} (its parameters: {known})")
        self.values = {**self.params, **params}
        for key, value in self.values.items():
            setattr(self, key, value)
        self.check()

    def check(self) -> None:
        """Validate ``self.values``; raise ValueError naming the parameter."""

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return f"{self.name}({args})"

    # -- what the cache asks ------------------------------------------------------------

    def rows(self, phase: str, q_len: int) -> tuple[int, int] | None:
        """Query rows (lo, hi) of the call whose weights ``select`` needs, or None."""
        return None

    def evicts(self, phase: str) -> bool:
        return phase == "prefill" or self.decodes

    def capacity(self, tokens: Tensor, layer: int, num_layers: int, held: Tensor | None = None) -> Tensor:
        """Entries each row keeps in ``layer``, (B,), from the budget's ``tokens`` (B,);
        ``held`` (B,): the entries each row's prompt gives the layer."""
        return tokens

    def select(self, step: Step) -> Tensor:
        """Entries to keep, (B, Hkv, L) bool."""
        raise NotImplementedError

    def before(self, module, layer, kwargs: dict, phase: str) -> dict | None:
        """Called before the layer's attention; what it returns reaches ``select`` as
        ``step.extra`` (a policy that needs more than weights, e.g. the queries)."""
        return None

    def after(self, module, layer, order: Tensor, extra: dict | None) -> None:
        """Called after eviction with the gather indices (B, Hkv, L'): state a policy keeps
        outside the cache follows the entries here."""

    # -- sparse reads (policies with ``sparse_reads``) -----------------------------------

    def reads_layer(self, layer: int) -> bool:
        """Whether ``layer``'s decoding calls read only part of the cache."""
        return self.sparse_reads

    def read_slots(self, module, layer, hidden: Tensor, kwargs: dict, budget: tuple[str, float]) -> Tensor | None:
        """A one-token step's slots to gather per query head, (B, Hq, n) (or (B, Hkv, n),
        per KV head), the new token's slot (``layer.length``) last; None when the step
        must take the mask instead (``read_mask``)."""
        return None

    def read_mask(self, module, layer, hidden: Tensor, kwargs: dict, budget: tuple[str, float]) -> Tensor:
        """(B, Hq, Nq, L): the cached entries each query of this call reads."""
        raise NotImplementedError

    def read_in_place(self, layer, budget: tuple[str, float]):
        """Called before the step's token is appended; returns the step's attention,
        ``(q, k, v, scale) -> output``, run after the append on the layer's own storage."""
        raise NotImplementedError

    def reference(self, weights: Tensor | None, keys: Tensor, held: Tensor, capacity: Tensor, state: dict, phase: str) -> Tensor:
        """The paper's rule on dense positions: ``weights`` (B, Hq, Nq, N) are the
        attention weights of the call's query rows over all N positions (eager, 0 where
        hidden), ``keys`` (B, Hkv, N, D), ``held`` (B, Hkv, N) the entries in the cache
        (new ones included), ``capacity`` (B, Hkv); ``state`` carries what the rule
        accumulates across calls. Returns the kept entries (B, Hkv, N)."""
        raise NotImplementedError


def check_int(value, name: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def check_fraction(value, name: str, closed_low: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 <= value <= 1 if closed_low else 0 < value <= 1)
    if not ok:
        raise ValueError(f"{name}: expected a number in {'[0' if closed_low else '(0'}, 1], got {value!r}")
