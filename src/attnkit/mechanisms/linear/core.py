"""The generalised linear-attention recurrence that every form computes.

    sum rule:    S_t = G_t ⊙ S_{t-1} + φ(k_t) v_tᵀ
    delta rule:  S̃_t = G_t ⊙ S_{t-1};   S_t = S̃_t + β_t φ(k_t) (v_t - S̃_tᵀ φ(k_t))ᵀ
    output:      o_t = scale · φ(q_t)ᵀ S_t,   or φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps) when normalised

G_t = exp(g_t) is a decay per token: a scalar per head (RetNet, Lightning, Gated
DeltaNet) or a vector over the D_f feature rows of S (GLA). The delta rule corrects the
*decayed* state, as the gated delta rule does (Yang et al. 2024, arXiv 2412.06464, eq. 10:
S_t = S_{t-1} α_t (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ); without gates the two readings agree.
The normaliser z_t follows the same rule with v_t = 1, which is how the augmented forms
compute it: one extra value column of ones, whose output is the denominator.

Gates are handled in log space, as cumulative sums b_i = Σ_{t<=i} g_t within a chunk,
taken in float64 once they pass -FACTOR_LIMIT. While they stay small enough, decays factor
through them (in the chunked form every factor stays within e^{±MIDPOINT_LIMIT}, see
``ChunkDecay``); beyond that they are only exponentiated as differences b_i - b_j with
j <= i, so every exponent is <= 0: a gate near 0 underflows to an exact 0 instead of
overflowing, and a gate near 1 keeps its precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import torch

from .feature_maps import FeatureMap

Tensor = torch.Tensor

#: chunks factor their decays about their midpoint (``ChunkDecay``) while every factor stays
#: within e^{±MIDPOINT_LIMIT} ≈ 2e17^{±1}: x·e^{-40} is still a normal float32 for any
#: |x| > 3e-21, and two factors multiply to at most e^80 ≈ 6e34 < 3e38, float32's largest
MIDPOINT_LIMIT = 40.0
#: size of the sub-blocks inside which strong diagonal (GLA) gates are applied pairwise
DIAG_SUB_BLOCK = 16
#: decays factor as e^{b_i}·e^{-b_j} while the cumulative decay b stays above -FACTOR_LIMIT
#: (e^20 ≈ 5e8 keeps every factor far from float32 overflow) in ``decayed_scores``, and
#: beyond it b is summed in float64
FACTOR_LIMIT = 20.0
#: chunks whose states the sum rule computes in one product
SCAN_BLOCK = 16
#: the delta rule's chunk-local triangular inverses start from blocks of this many rows
INVERSE_LEAF = 16


@dataclass(frozen=True)
class Recurrence:
    """Everything about a call's recurrence except the tensors."""

    feature_map: FeatureMap
    rule: str  # "sum" or "delta"
    normalize: bool
    scale: float
    eps: float
    #: False keeps the normaliser's column undivided (observers take num and den apart)
    divide: bool = True

    @property
    def delta(self) -> bool:
        return self.rule == "delta"

    def keys(self, k: Tensor, start: int) -> Tensor:
        if self.feature_map.approximates_exp:
            k = k * math.sqrt(self.scale)
        return self.feature_map(k, start)

    def queries(self, q: Tensor, start: int) -> Tensor:
        """φ(q) with the scale applied: inside the map for maps that approximate
        exp(scale·q·k), on the readout for unnormalised mechanisms, and not at all for
        other normalised ones, where it cancels between numerator and denominator.
        Rows may be rescaled when the output is normalised."""
        if self.feature_map.approximates_exp:
            return self.feature_map(q * math.sqrt(self.scale), start, rescale_rows=self.normalize)
        if self.normalize:
            return self.feature_map(q, start, rescale_rows=True)
        return self.feature_map(q, start) * self.scale

    def values(self, v: Tensor) -> Tensor:
        """v with a column of ones appended when normalised (its state column is z)."""
        return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1) if self.normalize else v

    def finish(self, out: Tensor) -> Tensor:
        """Divide by the denominator column when normalised."""
        if not (self.normalize and self.divide):
            return out
        return out[..., :-1] / (out[..., -1:] + self.eps)


@overload
def skip_keys(t: Tensor, keep: Tensor | None) -> Tensor: ...
@overload
def skip_keys(t: None, keep: Tensor | None) -> None: ...
@overload
def skip_keys(t: Tensor | None, keep: Tensor | None) -> Tensor | None: ...
def skip_keys(t: Tensor | None, keep: Tensor | None) -> Tensor | None:
    """Zero the rows (B, H, N, ...) of keys that ``keep`` (B, N) leaves out: a key with zero
    features and value writes nothing (sum and delta rule alike) and a zero log-gate
    decays nothing, so the recurrence passes over it as if it were absent. (``where``, not
    a product: whatever sits in a padded slot, even NaN, stays out.)"""
    if t is None or keep is None:
        return t
    mask = keep.view(keep.shape[0], 1, keep.shape[1], *([1] * (t.dim() - 3)))
    return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


@overload
def log_gates(g: Tensor) -> Tensor: ...
@overload
def log_gates(g: None) -> None: ...
@overload
def log_gates(g: Tensor | None) -> Tensor | None: ...
def log_gates(g: Tensor | None) -> Tensor | None:
    """Gates as (B, H, N, Dg): Dg = 1 for scalar gates, D_f for diagonal ones."""
    if g is None:
        return None
    return g.unsqueeze(-1) if g.dim() == 3 else g


def cumulative_gates(g: Tensor, dtype: torch.dtype) -> Tensor:
    """b = cumsum of log-gates g (..., L, Dg) along L. In the compute dtype when the total
    decay stays above e^-FACTOR_LIMIT (b is then small and exact to rounding), else in
    float64, which keeps the differences b_i - b_j exact when b itself is large."""
    if dtype != torch.float64 and torch.compiler.is_compiling():
        return g.to(torch.float64).cumsum(-2)  # a compiled graph cannot branch on the decay: the choice exact for any
    b = g.to(dtype).cumsum(-2)
    if dtype != torch.float64 and float(b[..., -1, :].detach().min()) < -FACTOR_LIMIT:
        b = g.to(torch.float64).cumsum(-2)
    return b


def decayed_scores(x: Tensor, k: Tensor, b: Tensor | None, strict: bool) -> Tensor:
    """A_ij = Σ_d x_id k_jd exp(b_id - b_jd) for j <= i (j < i when ``strict``), else 0.

    x, k: (..., L, D_f); b: cumulative log-gates (..., L, Dg), non-increasing along L, or
    None for no decay; Dg = 1 decays the whole score, Dg = D_f every feature separately.

    While the total decay stays above e^-FACTOR_LIMIT, e^{b_i - b_j} factors into
    (x_i e^{b_i})·(k_j e^{-b_j}), one matmul with every factor finite. Beyond it, scalar
    gates take the pairwise differences (C x C exponentials); diagonal gates take them
    exactly within sub-blocks of DIAG_SUB_BLOCK rows and, across sub-blocks, factor
    through the cumulative gate r of the row before the query's sub-block,
    x_i e^{b_i - r} · k_j e^{r - b_j}, where j <= r < i makes both exponents <= 0 (the
    secondary chunking of GLA, arXiv 2312.06635, Sec. 4.3).
    """
    L = x.shape[-2]
    visible = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    if b is None:
        return (x @ k.transpose(-1, -2)).masked_fill(~visible, 0)
    # compiled graphs cannot branch on the decay: they take the pairwise paths, exact for any
    if not torch.compiler.is_compiling() and float(b[..., -1, :].detach().min()) >= -FACTOR_LIMIT:
        bx = b.to(x.dtype)
        return ((x * torch.exp(bx)) @ (k * torch.exp(-bx)).transpose(-1, -2)).masked_fill(~visible, 0)
    if b.shape[-1] == 1:
        # -inf above the diagonal, where the exponent is > 0 (exp's output must stay
        # untouched: its backward reads it)
        exponent = (b[..., :, None, 0] - b[..., None, :, 0]).to(x.dtype).masked_fill_(~visible, -math.inf)
        return (x @ k.transpose(-1, -2)) * torch.exp(exponent)
    rows = []
    for s0 in range(0, L, DIAG_SUB_BLOCK):
        s1 = min(s0 + DIAG_SUB_BLOCK, L)
        bi = b[..., s0:s1, :]
        diff = (bi[..., :, None, :] - bi[..., None, :, :]).masked_fill(~visible[s0:s1, s0:s1, None], -math.inf)
        pair = torch.exp(diff.to(x.dtype)) * k[..., None, s0:s1, :]
        block = (pair @ x[..., s0:s1, :, None]).squeeze(-1)
        parts = []
        if s0 > 0:
            r = b[..., s0 - 1 : s0, :]
            xs = x[..., s0:s1, :] * torch.exp((bi - r).to(x.dtype))
            ks = k[..., :s0, :] * torch.exp((r - b[..., :s0, :]).to(x.dtype))
            parts.append(xs @ ks.transpose(-1, -2))
        parts.append(block)
        if s1 < L:
            parts.append(x.new_zeros(*x.shape[:-2], s1 - s0, L - s1))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def delta_solve(kf: Tensor, b: Tensor | None, beta: Tensor, rhs: Tensor) -> Tensor:
    """(I + diag(β) A)^{-1} diag(β) rhs with A the strictly lower decayed key scores: the
    UT transform that turns a block of delta-rule updates into one triangular solve
    (DeltaNet, Yang et al. 2024, arXiv 2406.06484, Sec. 3.2)."""
    lower = decayed_scores(kf, kf, b, strict=True) * beta.unsqueeze(-1)
    return torch.linalg.solve_triangular(lower, beta.unsqueeze(-1) * rhs, upper=False, unitriangular=True)


def unit_lower_inverse(n: Tensor) -> Tensor:
    """(I + N)^{-1} for strictly lower triangular N (..., m, m): DeltaNet's UT transform
    T = (I + diag(β)A)^{-1} (arXiv 2406.06484, Sec. 3.2) as a matrix, so that applying it
    to both right-hand sides of every chunk is one batched product.

    Built by halves, [[A, 0], [C, D]]^{-1} = [[A^{-1}, 0], [-D^{-1} C A^{-1}, D^{-1}]], with
    both halves inverted together in one batch, down to blocks of INVERSE_LEAF rows. On
    CPU, forming T and multiplying took about 60% of the time of a batched triangular
    solve of the same systems (2048 chunks of 64, 128 right-hand sides, one thread),
    which runs one small matrix at a time.
    """
    m = n.shape[-1]
    if m <= INVERSE_LEAF:
        return _nilpotent_inverse(n)
    if m % 2:  # one more row and column of the identity, so that the halves stack
        return unit_lower_inverse(torch.nn.functional.pad(n, (0, 1, 0, 1)))[..., :m, :m]
    h = m // 2
    a_inv, d_inv = unit_lower_inverse(torch.stack([n[..., :h, :h], n[..., h:, h:]])).unbind(0)
    lower_left = -(d_inv @ n[..., h:, :h]) @ a_inv
    return torch.cat([torch.cat([a_inv, torch.zeros_like(a_inv)], dim=-1), torch.cat([lower_left, d_inv], dim=-1)], dim=-2)


def _nilpotent_inverse(n: Tensor) -> Tensor:
    """(I + N)^{-1} = Σ_{k<m} (-N)^k, exactly, since N^m = 0 for strictly lower triangular
    N (..., m, m); as the product (I - N)(I + N²)(I + N⁴)... it takes 2·⌈log2 m⌉ - 2
    matmuls."""
    m = n.shape[-1]
    result, power, p = torch.eye(m, dtype=n.dtype, device=n.device) - n, n, 2
    while p < m:  # result = Σ_{k<p} (-N)^k; times (I + N^p) doubles p ((-N)^p = N^p, p even)
        power = power @ power
        result = result + result @ power
        p *= 2
    return result


class ChunkDecay:
    """The decay factors of chunk-local cumulative log-gates b (..., C, Dg), chunk total b_C:
    e^{b_i} from position i back to the chunk start, e^{b_C - b_j} from key j to the chunk
    end, e^{b_C} across the whole chunk, and the decayed scores inside it.

    Scores factor as e^{b_i - b_j} = e^{b_i}·e^{-b_j} while every b_C >= -MIDPOINT_LIMIT (the
    row factor is then e^{b}, the queries' decay to the chunk start, computed anyway), and
    beyond that about the chunk's midpoint m = b_C / 2, e^{b_i - m}·e^{m - b_j}, which keeps
    every exponent within ±|b_C|/2: chunks decaying down to e^{-2·MIDPOINT_LIMIT} still take
    one matmul. Gated DeltaNet's initial Mamba-2 decays reach e^-36 over a chunk of 32
    tokens (e^-72 over 64) in the last of 8 heads; only chunks decaying beyond
    e^{-2·MIDPOINT_LIMIT} take the pairwise path.
    """

    def __init__(self, g: Tensor, dtype: torch.dtype):
        b = cumulative_gates(g, dtype)
        total = b[..., -1:, :]  # (..., 1, Dg)
        self.b = b
        # compiled graphs cannot branch on the decay: unfactored (pairwise), exact for any
        strongest = -math.inf if torch.compiler.is_compiling() else float(total.detach().min())
        self.factored = strongest >= -2 * MIDPOINT_LIMIT
        self.midpoint = self.factored and strongest < -MIDPOINT_LIMIT
        self.across = torch.exp(total).to(dtype)
        # exponentiated before rounding to the compute dtype, where b is float64
        if self.midpoint:
            self.rows = torch.exp(b - total / 2).to(dtype)
            self.cols = torch.exp(total / 2 - b).to(dtype)
            half = torch.exp(total / 2).to(dtype)
            self.to_start, self.to_end = self.rows * half, self.cols * half  # products, not two more exps
        elif self.factored:
            self.to_start = self.rows = torch.exp(b).to(dtype)
            self.cols = torch.exp(-b).to(dtype)
            self.to_end = self.cols * self.across
        else:
            self.to_start, self.to_end = torch.exp(b).to(dtype), torch.exp(total - b).to(dtype)

    def key_columns(self, kf: Tensor) -> Tensor:
        """Keys as ``scores`` takes them (times the column factor when factored), computed
        once for the key and the query scores."""
        return kf * self.cols if self.factored else kf

    def scores(self, x: Tensor, x_start: Tensor, k_cols: Tensor, strict: bool) -> Tensor:
        """decayed_scores(x, kf, b), given x_start = x ⊙ e^b and k_cols = key_columns(kf)."""
        if not self.factored:
            return decayed_scores(x, k_cols, self.b, strict)
        rows = x * self.rows if self.midpoint else x_start
        # in place: matmul's backward reads its inputs, not its output
        return (rows @ k_cols.transpose(-1, -2)).tril_(-1 if strict else 0)


def chunk_forward(
    qf: Tensor | None, kf: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, memory: Tensor, chunk: int, delta: bool
) -> tuple[Tensor | None, Tensor]:
    """Chunkwise-parallel form over L positions: quadratic inside chunks of ``chunk``
    tokens, the state passed from chunk to chunk (Lightning Attention-2, arXiv 2401.04658;
    GLA, arXiv 2312.06635; DeltaNet's WY/UT form, arXiv 2406.06484).

    qf (B, H, L, D_f) query features (None: only the final state), kf (B, H, L, D_f),
    v (B, H, L, Dv'), g (B, H, L, Dg) log-gates or None, beta (B, H, L) or None (sum rule),
    memory (B, H, D_f, Dv') the state before the first position. Returns the raw
    (un-normalised) outputs (B, H, L, Dv') and the state after the last position.

    Per chunk with start state S, chunk-local cumulative gates b, chunk length C:
        sum:   δ = V
        delta: δ = (I + diag(β)A_kk)^{-1} diag(β) (V - (K ⊙ e^b) S)
        O = (Q ⊙ e^b) S + A_qk δ,      S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C - b})ᵀ δ
    Only the state recurrence runs chunk after chunk; everything else is batched.
    """
    B, H, L, Df = kf.shape
    pad = (-L) % chunk
    if pad:
        # Zero features, values and β with g = 0 leave the state untouched.
        kf, v = _pad(kf, pad), _pad(v, pad)
        qf = None if qf is None else _pad(qf, pad)
        g = None if g is None else _pad(g, pad)
        beta = None if beta is None else _pad(beta.unsqueeze(-1), pad).squeeze(-1)
    n = (L + pad) // chunk

    def split(t):
        return t.reshape(B, H, n, chunk, *t.shape[3:])

    kf, v = split(kf), split(v)
    decay = None if g is None else ChunkDecay(split(g), kf.dtype)
    k_end_t = (kf if decay is None else kf * decay.to_end).transpose(-1, -2)
    k_cols = kf if decay is None else decay.key_columns(kf)

    if delta:
        # One UT transform T gives both parts of δ = U - W S for whatever start state S the
        # chunk gets: U = T diag(β) V from the values, W = T diag(β) K_start from the keys
        # decayed to the chunk start.
        k_start = kf if decay is None else kf * decay.to_start
        beta = split(beta).unsqueeze(-1)
        lower = (kf @ kf.transpose(-1, -2)).tril_(-1) if decay is None else decay.scores(kf, k_start, k_cols, strict=True)
        transform = unit_lower_inverse(lower * beta) * beta.transpose(-1, -2)  # T diag(β)
        across = None if decay is None else decay.across.transpose(-1, -2)
        values, starts, state = delta_scan(transform @ v, transform @ k_start, k_end_t, across, memory)
    else:
        chunk_log_decay = None if decay is None else decay.b[..., -1, :]
        starts, state = sum_scan(k_end_t @ v, chunk_log_decay, memory)
        values = v

    if qf is None:
        return None, state
    qf = split(qf)
    if decay is None:
        q_start, scores = qf, (qf @ kf.transpose(-1, -2)).tril_()
    else:
        q_start = qf * decay.to_start
        scores = decay.scores(qf, q_start, k_cols, strict=False)
    out = torch.baddbmm(_flat(q_start @ starts), _flat(scores), _flat(values))  # one GEMM adds the intra-chunk part
    return out.view(B, H, n * chunk, -1)[:, :, :L], state


def sum_scan(updates: Tensor, chunk_log_decay: Tensor | None, memory: Tensor) -> tuple[Tensor, Tensor]:
    """The sum rule's state at every chunk start, and after the last chunk.

    S_{c+1} = e^{a_c} ⊙ S_c + U_c unrolls to S_c = e^{A_c} S_0 + Σ_{c'<c} e^{A_c - A_{c'+1}} U_{c'}
    with A_c = Σ_{c''<c} a_{c''}: one product per block of SCAN_BLOCK chunks, every
    exponent <= 0, instead of one small kernel launch per chunk (each launch is a
    thread-pool barrier); blocks keep the product's n² cost from growing with the span.

    updates (B, H, n, D_f, Dv'); chunk_log_decay a (B, H, n, Dg) or None; memory S_0
    (B, H, D_f, Dv'). Returns (starts (B, H, n, D_f, Dv'), final (B, H, D_f, Dv')).
    """
    n = updates.shape[2]
    if chunk_log_decay is None:
        states = torch.cat([memory.unsqueeze(2), memory.unsqueeze(2) + updates.cumsum(2)], dim=2)
        return states[:, :, :n], states[:, :, n]
    starts, state = [], memory
    for c0 in range(0, n, SCAN_BLOCK):
        states = _scan_block(updates[:, :, c0 : c0 + SCAN_BLOCK], chunk_log_decay[:, :, c0 : c0 + SCAN_BLOCK], state)
        starts.append(states[:, :, :-1])
        state = states[:, :, -1]
    return torch.cat(starts, dim=2), state


def _scan_block(updates: Tensor, chunk_log_decay: Tensor, memory: Tensor) -> Tensor:
    """States (B, H, m+1, D_f, Dv') at the m chunk starts of a block and after it."""
    B, H, m, Df, Dv = updates.shape
    A = torch.nn.functional.pad(chunk_log_decay.to(torch.float64).cumsum(2), (0, 0, 1, 0))  # (B, H, m+1, Dg)
    reachable = torch.ones(m + 1, m, dtype=torch.bool, device=updates.device).tril(-1)  # c' < c
    exponent = (A[:, :, :, None, :] - A[:, :, None, 1:, :]).masked_fill(~reachable[..., None], -math.inf)
    weights = torch.exp(exponent.to(updates.dtype))  # (B, H, m+1, m, Dg)
    from_start = torch.exp(A.to(updates.dtype)).unsqueeze(-1) * memory.unsqueeze(2)  # (B, H, m+1, D_f, Dv')
    if weights.shape[-1] == 1:
        states = (weights[..., 0] @ updates.reshape(B, H, m, Df * Dv)).view(B, H, m + 1, Df, Dv)
    else:  # one decay per feature row: one product per row
        states = (weights.permute(0, 1, 4, 2, 3) @ updates.transpose(2, 3)).transpose(2, 3)
    return states + from_start


def delta_scan(u: Tensor, w: Tensor, k_end_t: Tensor, across: Tensor | None, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The delta rule's chunk-to-chunk pass (DeltaNet's chunkwise form, arXiv 2406.06484;
    with gates, arXiv 2412.06464): per chunk c with start state S_c,
        δ_c = U_c - W_c S_c,      S_{c+1} = diag(e^{b_C}) S_c + K_endᵀ δ_c,
    two small products of (B·H) matrices each. (Forming the transition
    diag(e^{b_C}) - K_endᵀ W as a matrix first would cost two more batched products of
    the same size, one for it and one for W S at every chunk start.)

    u (B, H, n, C, Dv'), w (B, H, n, C, D_f), k_end_t (B, H, n, D_f, C), across
    (B, H, n, Dg, 1) the decay over each chunk or None, memory (B, H, D_f, Dv').
    Returns (δ (B, H, n, C, Dv'), starts (B, H, n, D_f, Dv'), final (B, H, D_f, Dv')).
    """
    B, H, n, C, Dv = u.shape
    Df = w.shape[-1]

    def chunk_major(t):  # (B·H, ...) views of chunk c: no copies, bmm takes the batch stride
        return [t[:, :, c].reshape(B * H, *t.shape[3:]) for c in range(n)]

    decays = [None] * n if across is None else chunk_major(across)
    state = memory.reshape(B * H, Df, Dv)
    deltas, starts = [], []
    for u_c, w_c, k_c, decay in zip(chunk_major(u), chunk_major(w), chunk_major(k_end_t), decays):
        starts.append(state)
        delta = torch.baddbmm(u_c, w_c, state, alpha=-1)
        deltas.append(delta)
        state = torch.baddbmm(state if decay is None else decay * state, k_c, delta)
    return (
        torch.stack(deltas, dim=1).view(B, H, n, C, Dv),
        torch.stack(starts, dim=1).view(B, H, n, Df, Dv),
        state.view(B, H, Df, Dv),
    )


def _flat(t: Tensor) -> Tensor:
    """(B, H, n, R, C) -> (B·H·n, R, C), a view of a contiguous tensor."""
    return t.reshape(-1, *t.shape[-2:])


def _pad(t: Tensor, n: int) -> Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, n))
