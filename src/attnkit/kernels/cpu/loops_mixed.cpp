/* Softmax attention with a learned transform of the logits and head mixing after the
 * softmax, whole in C, forward and backward, for keys in a diagonal band lo <= key - query
 * position <= hi and no score mod:
 *
 *   S = Q K^T (q holds the scale), hidden pairs and positions outside the call set to 0;
 *   Z = T(S): a depthwise (cq x ck) convolution per head over (query, key), looking back
 *       cq - 1 queries and (ck - 1) / 2 keys to either side (multi-token attention,
 *       Golovneva et al. 2025, arXiv 2504.00927), or a mixing of the heads (talking heads,
 *       Shazeer et al. 2020, arXiv 2003.02436), or nothing; hidden pairs of Z set to -inf;
 *   P = softmax(Z) per head;  P~ = M P (heads mixed after it);  O = P~ V.
 *
 * Both mixings are block-diagonal in groups of ch heads; work goes by (batch, group) and
 * blocks of BQ queries. A key tile of BK keys takes one product per head for its logits
 * (with the convolution's halo: cq - 1 rows above, (ck - 1) / 2 keys each side); a tile's
 * heads lie one after the other (rows x n each). Mixing after the softmax needs every
 * row's final lse, so a block keeps its tiles between two passes (linear in N): the
 * forward stores e^(Z - running max), then normalises, mixes and multiplies the values;
 * the backward stores S, P and dP until delta~ = rowsum(P * dP) is complete. */
#include "common.h"

#include <string.h>

/* Zero the entries of S (R x C: call rows r0.., keys c0..) that the transform must see
 * as 0: rows before the call, keys outside [0, Nk), pairs outside the band. Also used on
 * dS, whose entries there have no gradient. */
static void zero_hidden(float *S, int64_t r0, int64_t R, int64_t c0, int64_t C, int64_t Nk, int64_t q_start, int has_lo,
                        int64_t lo, int has_hi, int64_t hi) {
    const int64_t ca = c0 < 0 ? -c0 : 0, cb = c0 + C > Nk ? Nk - c0 : C;
    for (int64_t r = 0; r < R; r++) {
        float *row = S + r * C;
        int64_t a = C, b = C;  /* rows before the call: all hidden */
        if (r0 + r >= 0) {
            band_columns(q_start + r0 + r, c0, C, has_lo, lo, has_hi, hi, &a, &b);
            a = a < ca ? ca : a > cb ? cb : a;
            b = b > cb ? cb : b < a ? a : b;
        }
        memset(row, 0, sizeof(float) * a);
        memset(row + b, 0, sizeof(float) * (C - b));
    }
}

/* The valid part of a halo tile: rows [*ra, R) are call rows, columns [*ca, *cb) real keys. */
static void valid_region(int64_t r0, int64_t c0, int64_t C, int64_t Nk, int64_t *ra, int64_t *ca, int64_t *cb) {
    *ra = r0 < 0 ? -r0 : 0;
    *ca = c0 < 0 ? -c0 : 0;
    *cb = c0 + C > Nk ? Nk - c0 : C;
    if (*cb < *ca) *cb = *ca;
}

/* S (R x C) = the logits of call rows [r0, r0 + R) and keys [c0, c0 + C), hidden ones 0. */
static void halo_logits(float *S, const float *qh, const float *kh, int64_t r0, int64_t R, int64_t c0,
                        int64_t C, int64_t Nk, int64_t D, int64_t q_start, int has_lo, int64_t lo, int has_hi, int64_t hi) {
    int64_t ra, ca, cb;
    valid_region(r0, c0, C, Nk, &ra, &ca, &cb);
    if (R > ra && cb > ca)
        gemm_abt((int)(R - ra), (int)(cb - ca), (int)D, 1.0f, qh + (r0 + ra) * D, (int)D, kh + (c0 + ca) * D, (int)D,
                 0.0f, S + ra * C + ca, (int)C);
    zero_hidden(S, r0, R, c0, C, Nk, q_start, has_lo, lo, has_hi, hi);
}

/* z <- exp(z - lse[row]) for the rows x n tile; 0 in rows that see no key (lse = -inf). */
static void exp_minus_rows(float *z, int64_t rows, int64_t n, const float *lse) {
    for (int64_t r = 0; r < rows; r++) {
        if (lse[r] == -INFINITY) memset(z + r * n, 0, sizeof(float) * n);
        else exp_sum(z + r * n, n, lse[r]);
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
    int64_t i = 0;
#ifdef AK_AVX2
    __m256 v0 = _mm256_setzero_ps(), v1 = v0;
    for (; i + 16 <= n; i += 16) {
        v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
        v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
    }
    acc = hsum_avx2(_mm256_add_ps(v0, v1));
#endif
    for (; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* The shape of one call, shared by the forward and the backward. */
typedef struct {
    int64_t H, Hkv, Nq, Nk, D, Dv, cq, ck, ch, q_start;  /* cq = ck = 1 without a convolution */
    int has_lo, has_hi;
    int64_t lo, hi, BQ, BK;
} mixed_call;

/* Key tiles of a block: [jlo, jhi) in steps of BK. */
static int64_t tile_count(const mixed_call *c, int64_t jlo, int64_t jhi) { return jhi > jlo ? (jhi - jlo + c->BK - 1) / c->BK : 0; }

/* The (ch x ch) mixing block of group g of the (H x H) matrix, or its transpose. */
static void group_mix(const float *mix, int64_t H, int64_t ch, int64_t g, int transpose, float *out) {
    for (int64_t a = 0; a < ch; a++)
        for (int64_t b = 0; b < ch; b++)
            out[a * ch + b] = transpose ? mix[(g * ch + b) * H + g * ch + a] : mix[(g * ch + a) * H + g * ch + b];
}

/* Z of the group's ch heads (rows x n each, one after the other) for queries [i0, i0 + rows)
 * and keys [j0, j0 + n), -inf outside the band. S receives each head's logits with the
 * convolution's halo ((rows + cq - 1) x (n + ck - 1), one after the other) where there is
 * a transform w (H, cq, ck) or pre (ch x ch); without one the logits go straight to Z. */
static void group_logits(const mixed_call *c, float *S, float *z, const float *q, const float *k, const float *w,
                         const float *pre, int64_t b, int64_t h0, int64_t i0, int64_t rows, int64_t j0, int64_t n) {
    const int64_t G = c->H / c->Hkv, R = rows + c->cq - 1, C = n + c->ck - 1, r0 = i0 - (c->cq - 1), c0 = j0 - c->ck / 2;
    for (int64_t t = 0; t < c->ch; t++) {
        const int64_t h = h0 + t;
        float *St = w || pre ? S + t * R * C : z + t * rows * n;
        halo_logits(St, q + (b * c->H + h) * c->Nq * c->D, k + (b * c->Hkv + h / G) * c->Nk * c->D, r0, R, c0, C, c->Nk,
                    c->D, c->q_start, c->has_lo, c->lo, c->has_hi, c->hi);
        if (w) ak_depthwise_conv2d(St, w + h * c->cq * c->ck, z + t * rows * n, 1, 1, R, C, c->cq, c->ck);
    }
    if (pre) ak_mix_heads_scaled(pre, S, NULL, z, 1, c->ch, c->ch, rows, n);
    for (int64_t t = 0; t < c->ch; t++)
        hide_outside_band(z + t * rows * n, rows, n, c->q_start + i0, j0, c->has_lo, c->lo, c->has_hi, c->hi);
}

/* Forward for the work units [u0, u1) of B * (H / ch) * chunks: unit u takes the
 * (batch, group) row u / chunks and, of its blocks of BQ queries, every chunks-th from
 * block u % chunks (chunks > 1 lets threads share a call with fewer groups than threads;
 * interleaved, the causal blocks' growing work splits evenly). Writes out (B, H, Nq, Dv) and
 * each head's own lse before the mixing (B, H, Nq). q (B, H, Nq, D) holds the scale, k
 * (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); the transform is w (H, cq, ck) or pre (H, H) or
 * neither (NULL; never both; cq = ck = 1 without w), post (H, H) or NULL (ch = 1).
 * Returns 0, or 1 when out of memory. */
int ak_mixed_softmax_attention(const ak_mixed_call &call, float *out, float *lse, int64_t u0, int64_t u1) {
    const float *q = call.q, *k = call.k, *v = call.v, *w = call.w, *pre = call.pre, *post = call.post;
    const int64_t H = call.dims.H, Hkv = call.dims.Hkv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D;
    const int64_t Dv = call.dims.Dv, cq = call.cq, ck = call.ck, ch = call.ch, chunks = call.chunks;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi, BQ = call.BQ, BK = call.BK;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const mixed_call c = {H, Hkv, Nq, Nk, D, Dv, cq, ck, ch, q_start, has_lo, has_hi, lo, hi, BQ, BK};
    const int64_t groups = H / ch, G = H / Hkv, max_tiles = (Nk + BK - 1) / BK + 1, tile = BQ * BK;
    const int64_t sx = (BQ + cq - 1) * (BK + ck - 1);
    const size_t floats = (size_t)ch * sx + (size_t)max_tiles * ch * (tile + BQ) + ch * tile + 3 * ch * BQ + BQ + 2 * ch * ch;
    const auto S_buf = ak_buffer<float>((int64_t)floats);
    float *S = S_buf.get();
    if (!S) return 1;
    float *E = S + ch * sx;                  /* per tile and head: e^(Z - running max) */
    float *mt = E + max_tiles * ch * tile;   /* per tile and head: that running max */
    float *X = mt + max_tiles * ch * BQ;     /* a tile's heads mixed */
    float *scale = X + ch * tile, *m = scale + ch * BQ, *l = m + ch * BQ, *alpha = l + ch * BQ;
    float *Mpre = alpha + BQ, *Mpost = Mpre + ch * ch;
    const float unit = 1.0f;  /* the mixing of one head with itself */
    for (int64_t u = u0; u < u1; u++) {
        const int64_t gr = u / chunks, b = gr / groups, grp = gr % groups, h0 = grp * ch;
        if (pre) group_mix(pre, H, ch, grp, 0, Mpre);
        if (post) group_mix(post, H, ch, grp, 0, Mpost);
        for (int64_t i0 = u % chunks * BQ; i0 < Nq; i0 += chunks * BQ) {
            const int64_t rows = Nq - i0 < BQ ? Nq - i0 : BQ;
            int64_t jlo, jhi;
            band_keys(q_start + i0, q_start + i0 + rows - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            const int64_t tiles = tile_count(&c, jlo, jhi);
            for (int64_t t = 0; t < ch * BQ; t++) m[t] = -INFINITY, l[t] = 0.0f;
            /* pass 1: every tile's Z, exponentiated against the running max */
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t j0 = jlo + ti * BK, n = jhi - j0 < BK ? jhi - j0 : BK;
                float *z = E + ti * ch * tile;
                group_logits(&c, S, z, q, k, w, pre ? Mpre : NULL, b, h0, i0, rows, j0, n);
                for (int64_t t = 0; t < ch; t++) {
                    ak_online_softmax(z + t * rows * n, rows, n, m + t * BQ, l + t * BQ, alpha);
                    memcpy(mt + (ti * ch + t) * BQ, m + t * BQ, sizeof(float) * rows);
                }
            }
            for (int64_t t = 0; t < ch; t++) {
                float *o = out + ((b * H + h0 + t) * Nq + i0) * Dv, *ls = lse + (b * H + h0 + t) * Nq + i0;
                memset(o, 0, sizeof(float) * rows * Dv);
                for (int64_t r = 0; r < rows; r++) ls[r] = l[t * BQ + r] > 0.0f ? m[t * BQ + r] + logf(l[t * BQ + r]) : -INFINITY;
            }
            /* pass 2: normalise, mix the heads, multiply the values */
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t j0 = jlo + ti * BK, n = jhi - j0 < BK ? jhi - j0 : BK;
                for (int64_t t = 0; t < ch; t++)
                    for (int64_t r = 0; r < rows; r++) {
                        const float lt = l[t * BQ + r];
                        scale[t * rows + r] = lt > 0.0f ? exp_scalar(mt[(ti * ch + t) * BQ + r] - m[t * BQ + r]) / lt : 0.0f;
                    }
                if (post)
                    ak_mix_heads_scaled(Mpost, E + ti * ch * tile, scale, X, 1, ch, ch, rows, n);
                else  /* each head only normalised */
                    ak_mix_heads_scaled(&unit, E + ti * ch * tile, scale, X, ch, 1, 1, rows, n);
                for (int64_t t = 0; t < ch; t++) {
                    const int64_t h = h0 + t;
                    gemm_ab_acc((int)rows, (int)Dv, (int)n, X + t * rows * n, (int)n, v + ((b * Hkv + h / G) * Nk + j0) * Dv,
                                (int)Dv, out + ((b * H + h) * Nq + i0) * Dv, (int)Dv);
                }
            }
        }
    }
    return 0;
}

/* Backward of ak_mixed_softmax_attention for the work units [u0, u1) (as the forward's), given
 * dout and each head's lse. With dW_g = dO_g V^T, dP = M^T dW and
 * delta~_h = rowsum(P_h * dP_h) (no longer rowsum(dO * O) once heads are mixed):
 *   dZ = P * (dP - delta~);  dV += (M P)^T dO;  dM += dW P^T;
 *   dS = T^T(dZ), 0 where S was hidden: the transposed convolution (the flipped kernel wf
 *   over dZ padded by the kernel's reach) with dw_h += sum dZ * S shifted by each tap,
 *   or the transposed mixing with dpre += dZ S^T;  dQ += dS K, dK += dS^T Q (halo included).
 * Adds into dq (B, H, Nq, D; gradient of the scaled q), dk, dv (zeroed by the caller),
 * dw (B, H, cq, ck), dpre and dpost (B, H / ch, ch, ch); pointers for an absent transform
 * or mixing are not touched. Threads need gradient buffers of their own: they may share
 * key heads and groups. Returns 0, or 1 when out of memory. */
int ak_mixed_softmax_attention_backward(const ak_mixed_call &call, const ak_mixed_grads &grads, int64_t u0, int64_t u1) {
    const float *q = call.q, *k = call.k, *v = call.v, *w = call.w, *pre = call.pre, *post = call.post;
    const int64_t H = call.dims.H, Hkv = call.dims.Hkv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D;
    const int64_t Dv = call.dims.Dv, cq = call.cq, ck = call.ck, ch = call.ch, chunks = call.chunks;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi, BQ = call.BQ, BK = call.BK;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const float *dout = grads.dout, *lse = grads.lse, *dlse = grads.dlse, *wf = grads.wf;
    float *dq = grads.dq, *dk = grads.dk, *dv = grads.dv, *dw = grads.dw, *dpre = grads.dpre, *dpost = grads.dpost;
    const mixed_call c = {H, Hkv, Nq, Nk, D, Dv, cq, ck, ch, q_start, has_lo, has_hi, lo, hi, BQ, BK};
    const int64_t groups = H / ch, G = H / Hkv, max_tiles = (Nk + BK - 1) / BK + 1, tile = BQ * BK;
    const int64_t sx = (BQ + cq - 1) * (BK + ck - 1), padded = w ? (BQ + 2 * (cq - 1)) * (BK + 2 * (ck - 1)) : 0;
    const size_t floats = (size_t)max_tiles * ch * (sx + 2 * tile) + 2 * ch * tile + padded + ch * sx + ch * BQ + cq * ck
                          + 4 * ch * ch;
    const auto Sx_buf = ak_buffer<float>((int64_t)floats);
    float *Sx = Sx_buf.get();
    if (!Sx) return 1;
    float *Pt = Sx + max_tiles * ch * sx;   /* per tile: the heads' logits S, then P, then dP (later dZ) */
    float *dPt = Pt + max_tiles * ch * tile;
    float *W = dPt + max_tiles * ch * tile;  /* a tile's dW of the heads */
    float *X = W + ch * tile;                /* ... and its mixed P */
    float *Zpad = X + ch * tile, *dS = Zpad + padded, *delta = dS + ch * sx, *dwt = delta + ch * BQ;
    float *Mpre = dwt + cq * ck, *MpreT = Mpre + ch * ch, *Mpost = MpreT + ch * ch, *MpostT = Mpost + ch * ch;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t gr = u / chunks, b = gr / groups, grp = gr % groups, h0 = grp * ch;
        if (pre) group_mix(pre, H, ch, grp, 0, Mpre), group_mix(pre, H, ch, grp, 1, MpreT);
        if (post) group_mix(post, H, ch, grp, 0, Mpost), group_mix(post, H, ch, grp, 1, MpostT);
        for (int64_t i0 = u % chunks * BQ; i0 < Nq; i0 += chunks * BQ) {
            const int64_t rows = Nq - i0 < BQ ? Nq - i0 : BQ, R = rows + cq - 1, r0 = i0 - (cq - 1);
            int64_t jlo, jhi;
            band_keys(q_start + i0, q_start + i0 + rows - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            const int64_t tiles = tile_count(&c, jlo, jhi);
            memset(delta, 0, sizeof(float) * ch * BQ);
            /* pass 1: S, P, dP of every tile; dV, dM and delta~ */
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t j0 = jlo + ti * BK, n = jhi - j0 < BK ? jhi - j0 : BK;
                float *P = Pt + ti * ch * tile, *dP = dPt + ti * ch * tile;
                group_logits(&c, Sx + ti * ch * sx, P, q, k, w, pre ? Mpre : NULL, b, h0, i0, rows, j0, n);
                for (int64_t t = 0; t < ch; t++) {
                    const int64_t h = h0 + t;
                    exp_minus_rows(P + t * rows * n, rows, n, lse + (b * H + h) * Nq + i0);
                    gemm_abt((int)rows, (int)n, (int)Dv, 1.0f, dout + ((b * H + h) * Nq + i0) * Dv, (int)Dv,
                             v + ((b * Hkv + h / G) * Nk + j0) * Dv, (int)Dv, 0.0f, (post ? W : dP) + t * rows * n, (int)n);
                }
                const float *Pmix = P;
                if (post) {
                    float *dm = dpost + gr * ch * ch;
                    for (int64_t g = 0; g < ch; g++)
                        for (int64_t t = 0; t < ch; t++) dm[g * ch + t] += dot(W + g * rows * n, P + t * rows * n, rows * n);
                    ak_mix_heads_scaled(MpostT, W, NULL, dP, 1, ch, ch, rows, n);
                    ak_mix_heads_scaled(Mpost, P, NULL, X, 1, ch, ch, rows, n);
                    Pmix = X;
                }
                for (int64_t t = 0; t < ch; t++) {
                    const int64_t h = h0 + t;
                    gemm_atb_acc((int)n, (int)Dv, (int)rows, Pmix + t * rows * n, (int)n, dout + ((b * H + h) * Nq + i0) * Dv,
                                 (int)Dv, dv + ((b * Hkv + h / G) * Nk + j0) * Dv, (int)Dv);
                    for (int64_t r = 0; r < rows; r++)
                        delta[t * BQ + r] += dot(P + t * rows * n + r * n, dP + t * rows * n + r * n, n);
                }
            }
            if (dlse) /* a gradient g reaching each head's lse adds g * P to dZ: P * (dP - (delta~ - g)) */
                for (int64_t t = 0; t < ch; t++)
                    for (int64_t r = 0; r < rows; r++) delta[t * BQ + r] -= dlse[(b * H + h0 + t) * Nq + i0 + r];
            /* pass 2: dZ, the transform's transpose into dS, then dq, dk and the transform's own gradient */
            for (int64_t ti = 0; ti < tiles; ti++) {
                const int64_t j0 = jlo + ti * BK, n = jhi - j0 < BK ? jhi - j0 : BK, C = n + ck - 1, c0 = j0 - ck / 2;
                const float *P = Pt + ti * ch * tile, *S = Sx + ti * ch * sx;
                float *dZ = dPt + ti * ch * tile;
                for (int64_t t = 0; t < ch; t++)
                    for (int64_t r = 0; r < rows; r++) {
                        const float d = delta[t * BQ + r];
                        float *gz = dZ + t * rows * n + r * n;
                        const float *pz = P + t * rows * n + r * n;
                        for (int64_t j = 0; j < n; j++) gz[j] = pz[j] * (gz[j] - d);
                    }
                if (w) {
                    const int64_t pr = rows + 2 * (cq - 1), pc = n + 2 * (ck - 1);
                    for (int64_t t = 0; t < ch; t++) {
                        const int64_t h = h0 + t;
                        memset(Zpad, 0, sizeof(float) * pr * pc);
                        for (int64_t r = 0; r < rows; r++)
                            memcpy(Zpad + (r + cq - 1) * pc + ck - 1, dZ + t * rows * n + r * n, sizeof(float) * n);
                        ak_depthwise_conv2d(Zpad, wf + h * cq * ck, dS + t * R * C, 1, 1, pr, pc, cq, ck);
                        ak_depthwise_conv2d_weight_grad(S + t * R * C, dZ + t * rows * n, dwt, 1, 1, R, C, cq, ck);
                        float *dwh = dw + (b * H + h) * cq * ck;
                        for (int64_t i = 0; i < cq * ck; i++) dwh[i] += dwt[i];
                    }
                } else if (pre) {
                    float *dm = dpre + gr * ch * ch;
                    for (int64_t g = 0; g < ch; g++)
                        for (int64_t t = 0; t < ch; t++) dm[g * ch + t] += dot(dZ + g * rows * n, S + t * rows * n, rows * n);
                    ak_mix_heads_scaled(MpreT, dZ, NULL, dS, 1, ch, ch, rows, n);
                }
                float *grad = w || pre ? dS : dZ;  /* without a transform dS is dZ */
                int64_t ra, ca, cb;
                valid_region(r0, c0, C, Nk, &ra, &ca, &cb);
                for (int64_t t = 0; t < ch; t++) {
                    const int64_t h = h0 + t;
                    float *dSt = grad + t * R * C;
                    zero_hidden(dSt, r0, R, c0, C, Nk, q_start, has_lo, lo, has_hi, hi);
                    if (R > ra && cb > ca) {
                        gemm_ab_acc((int)(R - ra), (int)D, (int)(cb - ca), dSt + ra * C + ca, (int)C,
                                    k + ((b * Hkv + h / G) * Nk + c0 + ca) * D, (int)D, dq + ((b * H + h) * Nq + r0 + ra) * D, (int)D);
                        gemm_atb_acc((int)(cb - ca), (int)D, (int)(R - ra), dSt + ra * C + ca, (int)C,
                                     q + ((b * H + h) * Nq + r0 + ra) * D, (int)D, dk + ((b * Hkv + h / G) * Nk + c0 + ca) * D, (int)D);
                    }
                }
            }
        }
    }
    return 0;
}
