"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv 2406.10774): nothing is evicted. Each row's entries (its real tokens,
padding left out) are cut into pages of ``page_size`` consecutive entries; each page
keeps the channel-wise minimum and maximum of its keys, which bound any query's logit on
the page from above:

    q . k  <=  sum_d max(q_d * max_d, q_d * min_d)      for every key k of the page.

While decoding, each query head attends only to the pages with the highest bounds, as
many as the token budget allows (``ceil(budget / page_size)``; a fractional budget is
that share of the entries held at the step, so 1.0 reads them all), plus the new tokens; the
first ``dense_layers`` layers and the prefill stay dense, as in the paper. The last page,
while incomplete, is always among them (the tokens being written, whose extremes are
still moving; SGLang's Quest also keeps the most recent pages), so that every head
reads as many entries and a step can gather them instead of masking the whole cache.
``heads="group"`` makes one choice per KV head (pages ranked by the highest bound among
its query heads), for GQA models: a step then gathers each KV head's pages once, not
once per query head (with 4 query heads per KV head at a quarter of the pages, per-query
choices copy as many keys as the whole cache holds). The selection needs the queries,
which the cache recomputes from the layer's inputs (Llama-style ``q_proj`` + RoPE), so
Quest reads no attention weights and also runs under sdpa."""

from __future__ import annotations

import math

import torch

from ...kernels.cpu import kv as native_kv
from .. import budget as budgets
from ..model_parts import recompute_queries, sliding_window
from ..select import top
from .base import Policy, Step, check_int

Tensor = torch.Tensor


def entry_pages(valid: Tensor, page_size: int) -> Tensor:
    """Each slot's page, (B, H, L) long, -1 for an empty slot. Pages are cut over the
    entries each (row, head) holds, in slot order (entry r is in page r // page_size),
    not over slots: a left-padded row holds its prompt, then empty slots where the other
    rows' longer prompts lie, then the tokens decoded; its pages must hold what the same
    prompt alone would hold (37 tokens at page_size 16: pages of 16, 16 and 5 + the
    decoded tokens, not 16, 16, 5 and 3)."""
    rank = valid.to(torch.long).cumsum(-1) - 1
    return torch.where(valid, rank // page_size, -1)


def extremes_of_pages(keys: Tensor, page: Tensor, pages: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per page 0..pages-1 (B, H, pages, D): channel-wise min and max of the keys (B, H,
    L, D) whose slot is in that page (``page`` (B, H, L); slots outside 0..pages-1 are
    left out), and (B, H, pages) whether the page holds any key."""
    B, H, L, D = keys.shape
    inside = (page >= 0) & (page < pages)
    into = torch.where(inside, page, pages)[..., None].expand(B, H, L, D)  # page `pages` collects the rest
    k = keys.to(torch.float64)
    kmin = k.new_full((B, H, pages + 1, D), math.inf).scatter_reduce(2, into, k, "amin")
    kmax = k.new_full((B, H, pages + 1, D), -math.inf).scatter_reduce(2, into, k, "amax")
    has = torch.zeros(B, H, pages + 1, dtype=torch.bool, device=keys.device).scatter_(2, into[..., 0], inside)
    has[:, :, pages] = False
    return kmin[:, :, :pages], kmax[:, :, :pages], has[:, :, :pages]


def page_extremes(keys: Tensor, valid: Tensor, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per page (B, Hkv, P, D), P = ceil(L / page_size): channel-wise min and max over the
    page's keys, and (B, Hkv, P) whether the page holds any; pages cut over each (row,
    head)'s held entries (``entry_pages``), so pages past a head's entries are empty."""
    B, H, L, D = keys.shape
    P = math.ceil(L / page_size)
    if not bool(valid.all()):
        return extremes_of_pages(keys, entry_pages(valid, page_size), P)
    # every slot held: entry j sits in slot j, and the pages are views of the slots
    pad = P * page_size - L
    k = torch.nn.functional.pad(keys.to(torch.float64), (0, 0, 0, pad)).view(B, H, P, page_size, D)
    v = torch.nn.functional.pad(valid, (0, pad)).view(B, H, P, page_size, 1)
    kmin = torch.where(v, k, math.inf).amin(3)
    kmax = torch.where(v, k, -math.inf).amax(3)
    return kmin, kmax, v.any(3).squeeze(-1)


def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest's upper bound of q . k over each page: q (B, Hq, Nq, D), kmin/kmax
    (B, Hkv, P, D) -> (B, Hq, Nq, P), unscaled. ``sum_d max(q_d min_d, q_d max_d)`` is
    ``q+ . max + q- . min`` (q+ and q- the positive and negative parts of q): two small
    products per KV head, its group's queries together."""
    B, Hq, Nq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    qd = q.to(torch.float64).reshape(B, Hkv, (Hq // Hkv) * Nq, D)
    bound = qd.clamp(min=0) @ kmax.transpose(-1, -2) + qd.clamp(max=0) @ kmin.transpose(-1, -2)
    return bound.view(B, Hq, Nq, P)


def layer_extremes(layer, page_size: int, room: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``page_extremes`` of a cache layer's slots, kept in ``layer.memo`` between
    decoding steps: appended tokens only touch the last pages, so only those are
    recomputed (the layer empties the memo whenever existing slots change). They are
    stored with room for more pages; ``room``: return that storage itself, with space for
    at least one page past the slots (Quest's C++ step folds the next key into it),
    instead of the P = ceil(L / page_size) pages."""
    L = layer.length
    P = math.ceil(L / page_size)
    memo = layer.memo.get("quest_pages")
    stored: list[Tensor] | None
    if memo is None or memo[3] != page_size or memo[4] > L:
        stored, p0 = None, 0
    else:
        *stored, _, upto = memo
        p0 = P if upto == L else _first_open_page(layer, upto, page_size)
    tail = None
    if stored is None or p0 < P:
        tail = _pages_from(layer, p0, P, page_size)
    if stored is None or stored[0].shape[2] < P + 1:  # room for the page after the slots, and a few more
        like = tail if stored is None else stored
        assert like is not None  # without stored pages, tail holds them all
        grown = [t.new_empty(*t.shape[:2], P + 1 + P // 16, *t.shape[3:]) for t in like]
        for new, old in zip(grown, stored or ()):
            new[:, :, :p0] = old[:, :, :p0]
        stored = grown
    if tail is not None:
        for into, part in zip(stored, tail):
            into[:, :, p0:P] = part
    layer.memo["quest_pages"] = (*stored, page_size, L)
    kmin, kmax, has = stored
    return (kmin, kmax, has) if room else (kmin[:, :, :P], kmax[:, :, :P], has[:, :, :P])


def _first_open_page(layer, upto: int, page_size: int) -> int:
    """The first page that the slots appended after slot ``upto`` can touch: the page of
    the entry that follows the ``upto`` first slots' entries, in the (row, head) that
    holds the fewest of them."""
    held = upto if layer.full else int(layer.valid[:, :, :upto].sum(-1).min())
    return held // page_size


def _pages_from(layer, p0: int, P: int, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Extremes of a layer's pages p0..P-1, read from the first slot that holds any of
    their entries."""
    if layer.full:  # entry j in slot j: the pages are runs of slots
        s0 = p0 * page_size
        return page_extremes(layer.keys[:, :, s0:], layer.valid[:, :, s0:], page_size)
    page = entry_pages(layer.valid, page_size)  # counted from the first slot: rows differ in their empty slots
    later = page >= p0
    slots = torch.arange(layer.length, device=page.device)
    s0 = int(torch.where(later, slots, layer.length).amin())
    return extremes_of_pages(layer.keys[:, :, s0:], page[:, :, s0:] - p0, P - p0)


def page_choice(
    q: Tensor, valid: Tensor, tokens: Tensor, page_size: int, extremes: tuple[Tensor, Tensor, Tensor], per_group: bool = False
) -> Tensor:
    """Pages each query head attends to, (B, Hq, Nq, P): the incomplete last page of its
    KV head's entries, then the pages with the highest bounds up to
    ``ceil(tokens / page_size)`` pages (tokens (B,)); ties to the earlier page.
    ``per_group``: one choice per KV head, by the highest bound among its query heads,
    (B, Hkv, Nq, P)."""
    kmin, kmax, has = extremes
    if not bool(has.all()):  # an empty page's extremes are +-inf: zeros keep its (unused) bound finite
        kmin, kmax = torch.where(has[..., None], kmin, 0.0), torch.where(has[..., None], kmax, 0.0)
    bound = page_bounds(q, kmin, kmax)
    B, Hq, Nq, P = bound.shape
    Hkv = valid.shape[1]
    g = Hq // Hkv
    if per_group:
        bound, g = bound.view(B, Hkv, g, Nq, P).amax(2), 1
    pages = torch.ceil(tokens.to(torch.float64) / page_size).to(torch.long).view(B, 1, 1)
    candidates = has.repeat_interleave(g, 1)[:, :, None, :].expand_as(bound)
    held = valid.sum(-1)  # entries per (row, KV head): rows of a padded batch hold different counts
    last = torch.where(held % page_size != 0, held // page_size, -1).repeat_interleave(g, 1)  # -1: none incomplete
    recent = (torch.arange(P, device=bound.device) == last[:, :, None, None]) & candidates
    return recent | top(bound, candidates & ~recent, pages - recent.sum(-1))


def page_mask(
    q: Tensor,
    keys: Tensor,
    valid: Tensor,
    tokens: Tensor,
    page_size: int,
    extremes: tuple[Tensor, Tensor, Tensor] | None = None,
    per_group: bool = False,
) -> Tensor:
    """Cached entries each query head attends to, (B, Hq, Nq, L): the entries of its
    ``page_choice``. ``extremes``: the pages' ``page_extremes``, when already known."""
    extremes = page_extremes(keys, valid, page_size) if extremes is None else extremes
    B, Hkv, L = valid.shape
    Hq, Nq = q.shape[1], q.shape[2]
    g = Hq // Hkv
    chosen = page_choice(q, valid, tokens, page_size, extremes, per_group)
    if per_group:
        chosen = chosen.repeat_interleave(g, 1)
    if bool(valid.all()):  # entry j in slot j: each page a run of slots
        return chosen.repeat_interleave(page_size, -1)[..., :L]
    page = entry_pages(valid, page_size).repeat_interleave(g, 1)[:, :, None, :].expand(B, Hq, Nq, L)
    return chosen.gather(-1, page.clamp(min=0)) & (page >= 0)


class Quest(Policy):
    name = "quest"
    paper = "arXiv:2406.10774"
    params = {"page_size": 16, "dense_layers": 2, "heads": "query"}
    page_size: int
    dense_layers: int
    heads: str
    recomputes_queries = True  # the pages are chosen by each step's query
    sparse_reads = True
    sparse_reads_in_place = True  # kernels.cpu.kv.quest_attention

    def check(self) -> None:
        check_int(self.page_size, "page_size", 1)
        check_int(self.dense_layers, "dense_layers", 0)
        if self.heads not in ("query", "group"):
            raise ValueError(
                f"heads: expected 'query' (a choice per query head, the paper's) or 'group' (one per KV head), got {self.heads!r}"
            )

    @property
    def per_group(self) -> bool:
        return self.heads == "group"

    def evicts(self, phase: str) -> bool:
        return phase == "prefill"  # only the padding goes; every real entry stays

    def step_tokens(self, budget_spec: tuple[str, float], held: Tensor) -> Tensor:
        """Tokens each row's query reads while decoding, (B,), from the entries the row
        holds before the step (B,): a count as given; a fraction of the entries held now
        (the prompt and the tokens decoded so far), so that budget 1.0 reads every page
        as the cache grows: the full cache."""
        return budgets.tokens(budget_spec, held)

    def select(self, step: Step) -> Tensor:
        return step.valid

    # -- the cache's sparse reads: the pages each query attends to -----------------------

    def reads_layer(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def _tokens_now(self, layer, budget: tuple[str, float]) -> Tensor:
        """Tokens per row (B,) for a step over the entries the layer holds now."""
        held = layer.valid[:, 0].sum(-1)  # only padding is evicted: every head of a row holds the same entries
        return self.step_tokens(budget, held)

    def read_mask(self, module, layer, hidden, kwargs, budget):
        q = recompute_queries(module, hidden, kwargs["position_embeddings"])
        pages = layer_extremes(layer, self.page_size)
        return page_mask(q, layer.keys, layer.valid, self._tokens_now(layer, budget), self.page_size, pages, self.per_group)

    def read_slots(self, module, layer, hidden, kwargs, budget):
        """The slots of each query head's pages (B, Hq, n) (B, Hkv, n with
        ``heads="group"``) and the new token's, when every row reads as many (else None:
        the mask path). Needs sdpa (which takes one key head per query head as GQA), a
        full layer and no sliding window."""
        if module.config._attn_implementation != "sdpa" or not layer.full or sliding_window(module) is not None:
            return None
        size = self.page_size
        q = recompute_queries(module, hidden, kwargs["position_embeddings"])
        chosen = page_choice(q, layer.valid, self._tokens_now(layer, budget), size, layer_extremes(layer, size), self.per_group)[
            :, :, 0
        ]
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

    def read_in_place(self, layer, budget: tuple[str, float]):
        """The step in C++ (``kernels.cpu.kv.quest_attention``): pages chosen by their
        bounds from the model's own query, attention over them and the new token, the new
        key folded into the pages' extremes (kept in ``layer.memo``, which then covers
        every slot)."""
        size = self.page_size
        pages = layer_extremes(layer, size, room=True)  # of the slots held, before the new token joins them
        cached = layer.length

        def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
            tokens = self.step_tokens(budget, torch.full((q.shape[0],), cached, device=q.device))
            out, _ = native_kv.quest_attention(
                q, layer.keys, layer.values, *pages, tokens, size, cached, self.per_group, scale, True
            )
            layer.memo["quest_pages"] = (*pages, size, cached + 1)
            return out

        return attend

    def reference(self, weights, keys, held, capacity, state, phase):
        return held.clone()

    def reference_pages(self, q: Tensor, keys: Tensor, valid: Tensor, tokens: Tensor) -> Tensor:
        """Page selection of one call, literally: each (row, KV head)'s held entries, in
        slot order, cut into pages of ``page_size`` (padding holds no entry, so a padded
        row's pages are the unpadded prompt's); for every (row, query head, query) the
        incomplete last page, then the pages sorted by their bound (ties to the earlier
        page), the first ones kept up to the page budget."""
        B, Hq, Nq, D = q.shape
        H, L = keys.shape[1], keys.shape[2]
        g, ps = Hq // H, self.page_size
        out = torch.zeros(B, Hq, Nq, L, dtype=torch.bool)

        def bound(b, h, i, members):
            u = 0.0
            for d in range(D):
                qd = float(q[b, h, i, d])
                u += max(
                    qd * max(float(keys[b, h // g, j, d]) for j in members),
                    qd * min(float(keys[b, h // g, j, d]) for j in members),
                )
            return u

        for b in range(B):
            n_pages = math.ceil(int(tokens[b]) / ps)
            for h in range(Hq):
                entries = [j for j in range(L) if valid[b, h // g, j]]
                pages = [entries[s : s + ps] for s in range(0, len(entries), ps)]
                last = len(pages) - 1 if len(entries) % ps else None  # the page still being written
                # heads="group": the page's bound for the KV head is the highest of its query heads'
                ranked_by = range(h - h % g, h - h % g + g) if self.per_group else (h,)
                for i in range(Nq):
                    bounds = [(-max(bound(b, r, i, members) for r in ranked_by), p, members) for p, members in enumerate(pages)]
                    bounds.sort(key=lambda t: (t[1] != last, t[0], t[1]))  # the incomplete last page first
                    for _, _, members in bounds[:n_pages]:
                        out[b, h, i, members] = True
        return out
