"""Attention of a few query tokens onto a long cached context, without N x N.

Attention-based re-ranking (ICR, Chen et al. 2024, arXiv 2410.02642; attention
sorting, Peysakhovich & Lerer 2023, arXiv 2310.01427) reads only the rows of the query
tokens. So the context (instructions and documents) is prefilled once, with
``use_cache=True``, and each query is then one call of its Nq tokens against the Nk
cached keys: an Nq x Nk attention, observed tile by tile by ``QueryKeyMass``. ICR's
two passes (the content-free query "N/A", then the real one) share the context's cache:
each pass runs on its own copy, so neither sees the other's tokens.
"""

from __future__ import annotations

import copy
import inspect

import torch

from ..observe import CallInfo, Meter, TileView

Tensor = torch.Tensor


class QueryKeyMass(Meter):
    """Per batch row and key: the attention the query rows at positions >= ``q_lo`` put
    on each key, averaged over those rows and summed over the observed layers and heads
    (ICR's per-token score). ``per_key()`` -> (B, Nk) float64.

    Every observed layer must see the same keys (a sliding-window layer whose cache holds
    fewer keys is refused: its key indices are not the context's positions)."""

    name = "querykey"

    def __init__(self, q_lo: int, **restrict):
        super().__init__(queries=(q_lo, None), **restrict)
        self._mass: dict = {}  # layer -> (B, Nk) summed over heads and rows
        self._shape: tuple[int, int] | None = None

    def begin_call(self, call: CallInfo, n_heads: int, row_lo: int, row_hi: int) -> None:
        shape = (call.batch, call.k_len)
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            raise ValueError(
                f"layers: layer {call.layer}'s call has {call.k_len} keys for {call.batch} rows where another layer had "
                f"{self._shape[1]} for {self._shape[0]} (a sliding-window layer keeps only its window in the cache); "
                "restrict layers= to full-attention layers"
            )
        self._mass.setdefault(call.layer, torch.zeros(shape, dtype=torch.float64))

    def update_view(self, call: CallInfo, view: TileView) -> None:
        span = view.w.shape[3]
        self._mass[call.layer][view.batch, view.k0 : view.k0 + span] += view.w.double().sum((1, 2))

    def per_key(self) -> Tensor:
        """(B, Nk): sum over layers and heads of the mean weight of the query rows on each key."""
        shape = self._shape  # set by the first observed call
        if not self._mass or shape is None:
            raise ValueError("layers: no attention call was observed (no layer selected, or no query row)")
        total = torch.zeros(shape, dtype=torch.float64)
        for layer, mass in self._mass.items():
            total += mass / (self._rows_seen[layer] / shape[0])
        return total

    def rows(self):
        return []


def _accepts(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def prefill(model, ids: list[int]):
    """The KV cache of ``ids`` (one sequence) after one forward through attnkit's kernels."""
    from .. import hf

    accepted = _accepts(model)
    kwargs = {"input_ids": torch.tensor([ids]), "use_cache": True}
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1  # the N x vocab logits of the context are never read
    with torch.no_grad(), hf.use(model):
        out = model(**kwargs)
    # transformers >= 5.2x names it ``cache`` (reading ``past_key_values`` warns)
    cache = out["cache"] if "cache" in out else getattr(out, "past_key_values", None)
    if cache is None:
        raise ValueError(f"model: {type(model).__name__} returned no KV cache; re-ranking needs a causal LM that caches keys")
    return cache


def query_key_mass(
    model,
    cache,
    context_len: int,
    query_ids: list[int],
    *,
    layers=None,
    heads=None,
    last_only: bool = False,
    keep_cache: bool = False,
) -> Tensor:
    """(Nk,) float64: ICR's per-key score of ``query_ids`` read against ``cache`` (the
    cache of ``context_len`` context tokens): the query rows' weights, averaged over rows
    (only the last one with ``last_only``: attention sorting's decoding step) and summed
    over ``layers`` and ``heads`` (default all). Keys are the context and the query
    tokens themselves. The cache is copied first unless ``keep_cache`` (the caller's
    last use of it), so it still holds only the context afterwards."""
    from .. import hf

    if not query_ids:
        raise ValueError("query: it has no tokens")
    accepted = _accepts(model)
    past = cache if keep_cache else copy.deepcopy(cache)
    q_lo = context_len + len(query_ids) - 1 if last_only else context_len
    meter = QueryKeyMass(q_lo, layers=layers, heads=heads)
    kwargs = {
        "input_ids": torch.tensor([query_ids]),
        "use_cache": True,
        ("cache" if "cache" in accepted else "past_key_values"): past,
    }
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad(), hf.use(model, observers=[meter]):
        model(**kwargs)
    mass = meter.per_key()[0]
    if mass.shape[0] != context_len + len(query_ids):
        raise ValueError(
            f"layers: the observed calls read {mass.shape[0]} cached keys, not the {context_len + len(query_ids)} "
            "tokens of the context and query (sliding-window layers keep only their window); restrict "
            "layers= to full-attention layers"
        )
    return mass
