"""What every KV-cache policy is: a named rule that says which entries of a layer to
keep, a ``reference`` of the same rule written from its paper on dense tensors, and the
facts the cache needs (does it read attention weights, which query rows, does it evict
while decoding)."""

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
