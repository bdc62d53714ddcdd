"""Selective attention (Leviathan, Kalman, Matias 2024, "Selective Attention Improves
Transformer", arXiv 2410.02703).

A parameter-free change to softmax attention: one head's logits decide which earlier
tokens later queries no longer need. With ``S = ReLU(logits of the selector head)`` (the
first key, <BOS>, and each query's own key excluded), every query subtracts from all
heads' logits the selection accumulated by the queries before it:

    F_ij = sum_{i' < i} S_i'j,        weights = softmax(logits - F).

The chunked path visits query blocks in order and carries, per key, the column sums of S
of the blocks already done (O(Nk) state, kept in float64); inside a block F is that
carry plus an exclusive cumulative sum over the block's rows. The backward visits blocks
last to first: F is the forward total minus the sums still ahead, and the gradient of F
(``dS_i'j = -sum_{i > i'} sum_h dZ_hij``) is a suffix sum over rows carried the same way.

The first key of a row, <BOS>, is never selected; in a padded batch it is the row's
first key that the padding keeps (``first_keys``). Decoding with a KV cache carries F
over the cached keys (``cache_state``: ``initial_state`` / ``return_state``), which
``attnkit.nn`` and ``attnkit.hf`` keep beside the cache.

Because F only grows, a key with a large F will never matter again: ``prune_context``
applies the paper's context-pruning rule (keep a fixed memory budget, evict the kept
entry with the highest F) and says which KV entries remain.
"""

from __future__ import annotations

import math

import torch

from ..kernels.engine import (
    Block,
    GradBlock,
    OnlineSoftmax,
    Problem,
    SoftmaxKernel,
    dense_softmax,
    fast_exp_,
    observe_kernel,
    run_kernel,
    safe_lse,
    softmax_backward_terms,
)
from ..kernels.mechanism_call import dense_logits, dense_values, request
from ..kernels.request import Request
from .base import Mechanism, register
from .key_masks import split_key_masks

Tensor = torch.Tensor


def _selection(blk: Block, s: Tensor, head: int, k0: int, k1: int, bos: Tensor) -> Tensor:
    """S of one tile: ReLU of the selector head's logits, 0 on <BOS> and on each query's
    own key (hidden pairs are -inf, so ReLU makes them 0 too). (Bt, BQ, span)."""
    sel = torch.relu(s[:, head])
    at_bos = torch.arange(k0, k1, device=sel.device)[None, :] == bos[blk.bs, None]
    sel = sel.masked_fill(at_bos[:, None, :], 0.0)
    first = blk.prob.q_start + blk.q0  # positions as ints: a branch torch.compile can take while tracing
    if first < k1 and first + (blk.q1 - blk.q0) - 1 >= k0:
        own = blk.q_positions[:, None] == torch.arange(k0, k1)[None, :]
        sel = sel.masked_fill(own, 0.0)
    return sel


def _exclusive_rows(x: Tensor) -> Tensor:
    """Sum over the earlier rows of the block (dim -2), excluding the row itself."""
    return x.cumsum(dim=-2) - x


class SelectiveKernel(SoftmaxKernel):
    reverse_queries_backward = True

    def __init__(self, head: int, initial: Tensor | None, bos: Tensor):
        self.head = head
        self.initial = initial
        self.bos = bos  # (B,) position of <BOS> per batch row
        self.total: Tensor | None = None  # F as the next query would see it, (B, Nk) float64

    def begin(self, prob: Problem, phase: str) -> None:
        B, Nk = prob.req.batch, prob.req.k_len
        start = (
            torch.zeros(B, Nk, dtype=torch.float64) if self.initial is None else self.initial.detach().to(torch.float64).clone()
        )
        if phase == "backward":
            self.ahead_s = torch.zeros(B, Nk, dtype=torch.float64)  # column sums of S of the blocks still ahead
            self.ahead_g = torch.zeros(B, Nk, dtype=torch.float64)  # column sums of sum_h dZ of those blocks
        else:
            self.carry = start
            if phase == "forward":
                self.total = start  # filled in place by the forward

    def _forward_tiles(self, blk: Block):
        for kind, k0, k1 in blk.tiles():
            s = blk.logits(kind, k0, k1)
            sel = _selection(blk, s, self.head, k0, k1, self.bos)
            cols = (blk.bs, slice(k0, k1))
            f = self.carry[cols].to(s.dtype).unsqueeze(1) + _exclusive_rows(sel)
            self.carry[cols] += sel.sum(dim=-2).to(torch.float64)
            yield k0, k1, s - f.unsqueeze(1)

    def forward_block(self, blk: Block):
        acc = OnlineSoftmax(blk, blk.prob.v.shape[-1])
        for k0, k1, z in self._forward_tiles(blk):
            acc.add(blk, z, k0, k1)
        out, lse = acc.result()
        return out, {"lse": lse}

    def observe_block(self, blk: Block, stats):
        lse = safe_lse(stats["lse"])
        for k0, k1, z in self._forward_tiles(blk):
            yield k0, k1, torch.exp(z - lse), z

    def backward_block(self, blk: GradBlock, stats, delta, grad_stats):
        lse, d = softmax_backward_terms(stats, delta, grad_stats)
        for kind, k0, k1 in blk.tiles():
            s, tracked = blk.tracked_logits(kind, k0, k1)
            sd = s.detach()
            sel = _selection(blk, sd, self.head, k0, k1, self.bos)
            cols = (blk.bs, slice(k0, k1))
            col_sel = sel.sum(dim=-2)
            assert self.total is not None  # the forward ran first
            before = self.total[cols] - self.ahead_s[cols] - col_sel.to(torch.float64)  # F at this block's first row
            f = before.to(sd.dtype).unsqueeze(1) + _exclusive_rows(sel)
            p = fast_exp_(sd - f.unsqueeze(1) - lse)
            dz = p * (blk.dw(k0, k1) - d)
            g = dz.sum(dim=1)  # every head subtracts the same F
            col_g = g.sum(dim=-2)
            later = self.ahead_g[cols].to(sd.dtype).unsqueeze(1) + (col_g.unsqueeze(1) - g.cumsum(dim=-2))
            ds = dz.clone()
            # S_i'j feeds F of every later row i: dS = -sum_{i > i'} g_ij; ReLU passes it where S > 0
            ds[:, self.head] -= later * (sel > 0)
            blk.add(k0, k1, ds, p, (s, tracked))
            self.ahead_s[cols] += col_sel.to(torch.float64)
            self.ahead_g[cols] += col_g.to(torch.float64)
        return []


@register("selective")
class Selective(Mechanism):
    """Softmax over ``logits - F`` with F the accumulated ReLU selection of one head."""

    paper = "arXiv:2410.02703"
    # F of earlier queries travels beside the KV cache (initial_state / return_state).
    cache_state = True
    #: ``initial_state`` (B, Nk): F accumulated by queries before this call (e.g. while
    #: decoding with a KV cache; a constant). ``return_state=True`` also returns the F the
    #: next query will see, (B, Nk) float64.
    call_keywords = ("initial_state", "return_state")

    def __init__(self, selector_head: int = 0):
        super().__init__()
        if isinstance(selector_head, bool) or not isinstance(selector_head, int) or selector_head < 0:
            raise ValueError(f"selective(selector_head): expected an int >= 0, got {selector_head!r}")
        self.selector_head = selector_head

    def extra_repr(self) -> str:
        return super().extra_repr() + f", selector_head={self.selector_head}"

    def initial_state_for(self, state, new_tokens: int):
        """F over the cached keys, extended with zeros for the call's new keys."""
        return None if state is None else torch.nn.functional.pad(state, (0, new_tokens))

    def _check(self, req: Request, initial_state) -> None:
        if self.selector_head >= req.heads:
            raise ValueError(
                f"selective(selector_head): head {self.selector_head} does not exist; the call has Hq={req.heads} heads"
            )
        if initial_state is not None:
            if (
                not isinstance(initial_state, Tensor)
                or initial_state.shape != (req.batch, req.k_len)
                or not initial_state.is_floating_point()
            ):
                raise ValueError(
                    f"initial_state: expected a float tensor (B, Nk) = ({req.batch}, {req.k_len}) of the selection accumulated "
                    f"by earlier queries, got {getattr(initial_state, 'shape', initial_state)!r}"
                )

    def call_request(self, q, k, v, *, mask=None, score=None, scale=None, sinks=None, initial_state=None, **_):
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req, initial_state)
        return req

    def reference_result(self, req, q, k, v, *, initial_state=None, **_):
        return self._dense(req, initial_state)

    def fast_path(self, req, backend, initial_state=None, **_):
        """(out, lse, F the next query will see)."""
        if torch.compiler.is_compiling():
            # Compiled: the dense form. The tiled kernel keeps F in its own attributes from
            # block to block and from the forward to the backward, state that Dynamo refuses
            # to let an autograd.Function mutate.
            return self._dense(req, initial_state)
        kernel = SelectiveKernel(self.selector_head, initial_state, first_keys(req))
        out, stats = run_kernel(req, kernel)
        return out, stats["lse"], kernel.total if kernel.total is not None else _initial(req, initial_state)

    def observe_call(self, req, lse, observers, layer, state=None, initial_state=None, **_):
        kernel = SelectiveKernel(self.selector_head, initial_state, first_keys(req))
        observe_kernel(req, kernel, {"lse": lse}, observers, layer, self.name)

    def call_result(self, req, out, lse, return_lse, state=None, return_state=False, **_):
        result = (out, lse) if return_lse else (out,)
        if return_state:
            result += (state,)
        return result if len(result) > 1 else out

    def reference(self, q, k, v, *, mask=None, score=None, scale=None, return_lse=False, initial_state=None, **_):
        req = request(q, k, v, mask=mask, score=score, scale=scale)
        self._check(req, initial_state)
        out, lse, _ = self._dense(req, initial_state)
        return (out, lse) if return_lse else out

    def _dense(self, req: Request, initial_state):
        """The paper's listing, literally: S = ReLU(head's logits); S[:, 0] = 0; S *= 1 - I;
        F = cumsum(roll(S, 1 row), rows) with the first row zeroed; softmax(logits - F)."""
        logits = dense_logits(req)
        S = torch.relu(logits[:, self.selector_head])
        bos = torch.arange(req.k_len)[None, :] == first_keys(req)[:, None]
        S = S.masked_fill(bos[:, None, :], 0.0)  # do not mask <BOS>
        own = torch.arange(req.q_len)[:, None] + req.q_start == torch.arange(req.k_len)[None, :]
        S = S.masked_fill(own, 0.0)  # do not mask self
        state = _initial(req, initial_state) + S.detach().sum(dim=-2).to(torch.float64)  # F of the next query
        S = torch.roll(S, 1, dims=-2).masked_fill(
            torch.arange(req.q_len)[:, None] == 0, 0.0
        )  # only strictly earlier queries mask
        F = torch.cumsum(S, dim=-2)
        if initial_state is not None:
            F = F + initial_state.to(F.dtype).unsqueeze(1)
        p, lse = dense_softmax(logits - F.unsqueeze(1))
        out = torch.matmul(p, dense_values(req)).to(req.q.dtype)
        return out, lse, state

    def prune(self, q, k, budget: int, *, mask=None, score=None, scale=None) -> Tensor:
        """See ``prune_context``."""
        return prune_context(q, k, budget, mask=mask, score=score, scale=scale, selector_head=self.selector_head)


def first_keys(req: Request) -> Tensor:
    """Where <BOS> sits in each batch row, (B,): the first key that the key-only parts of
    the mask (padding) keep, 0 without them. A left-padded row starts after its padding,
    so it computes what the same row without padding computes."""
    _, keep = split_key_masks(req.mask, req.batch, req.heads, req.q_len, req.k_len)
    if keep is None:
        return torch.zeros(req.batch, dtype=torch.long)
    return torch.where(keep.any(-1), keep.to(torch.int8).argmax(-1), 0)


def _initial(req: Request, initial_state) -> Tensor:
    if initial_state is None:
        return torch.zeros(req.batch, req.k_len, dtype=torch.float64)
    return initial_state.detach().to(torch.float64)


def prune_context(q, k, budget: int, *, mask=None, score=None, scale=None, selector_head: int = 0, q_block: int = 128) -> Tensor:
    """Which KV entries selective attention can drop under a memory budget (arXiv 2410.02703, Sec. 4).

    Queries are visited in order, as when decoding. Key positions up to the current
    query's are in the context buffer; whenever the buffer holds more than ``budget``
    entries, the entry with the highest accumulated selection ``F`` (as this query sees
    it) is evicted for good (ties go to the earliest position; <BOS> is never evicted,
    its F is always 0). Returns a (B, Nk) bool tensor: True for entries still held after
    the last query. ``v`` is not needed: F depends on queries and keys only.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: expected an int >= 1 (KV entries to keep), got {budget!r}")
    v = k[..., :1]  # any value tensor of the right shape: only the logits are needed
    req = request(q, k, v, mask=mask, score=score, scale=scale)
    if selector_head >= req.heads or selector_head < 0:
        raise ValueError(f"selector_head: head {selector_head} does not exist; the call has Hq={req.heads} heads")
    B, Nq, Nk = req.batch, req.q_len, req.k_len
    held = torch.zeros(B, Nk, dtype=torch.bool)
    with torch.no_grad():
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        carry = torch.zeros(B, Nk, dtype=torch.float64)
        keys = req.k[:, selector_head // (req.heads // req.kv_heads)].to(cd)
        positions = torch.arange(Nk)
        for q0 in range(0, Nq, q_block):
            q1 = min(q0 + q_block, Nq)
            s = (torch.matmul(req.q[:, selector_head, q0:q1].to(cd), keys.transpose(-1, -2)) * req.scale).unsqueeze(1)
            b, h, qi, ki = _head_index(req, selector_head, q0, q1)
            if req.score is not None:
                s = req.score(s, b, h, qi, ki).to(cd)
            if req.mask is not None:
                s = s.masked_fill(~torch.as_tensor(req.mask(b, h, qi, ki), dtype=torch.bool), -math.inf)
            sel = torch.relu(s.squeeze(1))
            sel[..., 0] = 0.0
            q_pos = positions[req.q_start + q0 : req.q_start + q1]
            sel = sel.masked_fill(q_pos[:, None] == positions[None, :], 0.0)
            f = carry.unsqueeze(1) + _exclusive_rows(sel).to(torch.float64)
            carry += sel.sum(dim=-2).to(torch.float64)
            for r, pos in enumerate(q_pos.tolist()):
                if q0 + r == 0:
                    held[:, : pos + 1] = True  # the context before the call, and the first query's own key
                else:
                    held[:, pos] = True
                _evict(held, f[:, r], budget)
    return held


def _head_index(req: Request, head: int, q0: int, q1: int):
    b = torch.arange(req.batch).view(-1, 1, 1, 1)
    h = torch.tensor([head]).view(1, 1, 1, 1)
    qi = torch.arange(req.q_start + q0, req.q_start + q1).view(1, 1, -1, 1)
    ki = torch.arange(req.k_len).view(1, 1, 1, -1)
    return b, h, qi, ki


def _evict(held: Tensor, f: Tensor, budget: int) -> None:
    """Evict the held entries with the highest F (never position 0) until ``budget`` remain."""
    while True:
        over = held.sum(dim=-1) > budget
        if not bool(over.any()):
            return
        score = f.masked_fill(~held, -math.inf)
        score[:, 0] = -math.inf
        # ties go to the earliest position: argmax returns the first maximum
        worst = score.argmax(dim=-1)
        rows = over.nonzero().squeeze(-1)
        held[rows, worst[rows]] = False
