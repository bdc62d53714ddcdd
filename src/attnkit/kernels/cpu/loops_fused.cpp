/* Whole attention loops around the tile products of gemm.cpp (bound as operators in
 * fused.cpp): sigmoid attention forward and backward (FlashSigmoid),
 * a softmax forward with free head sizes and head maps, and a top-k attention forward.
 * Keys are restricted to a diagonal band lo <= key - query position <= hi. */
#include "common.h"

/* ------------------------------------------------------------------ fused sigmoid attention */

/* sigmoid(x + bias) in place for finite logits (the fused kernels' own tiles; hidden keys
 * are zeroed after): no -inf or NaN handling, e^-z from a degree-5 polynomial for 2^f
 * (relative error < 2.5e-7, so the gate is within 7e-8 absolute) and one Newton step for
 * the reciprocal (~1 ulp). About 30% fewer instructions than ``sigmoid_into``: the gate
 * is the only pointwise work of FlashSigmoid, as the softmax's exp is of flash attention. */
static void gates_finite(float *x, int64_t n, float bias) {
    int64_t i = 0;
#ifdef AK_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), nb = _mm256_set1_ps(-bias * 1.44269504088896341f);
    const __m256 lo = _mm256_set1_ps(-126.0f), hi = _mm256_set1_ps(126.0f), nlog2e = _mm256_set1_ps(-1.44269504088896341f);
    for (; i + 8 <= n; i += 8) {
        /* t = -(x + bias) log2 e, clamped so that 2^t stays a normal float */
        const __m256 t = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), nlog2e, nb)));
        const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 f = _mm256_sub_ps(t, k);
        /* Chebyshev interpolant of 2^f on [-1/2, 1/2], degree 5 */
        __m256 p = _mm256_set1_ps(1.339086336353527e-3f);
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.676031918255982e-3f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550357114222094e-2f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402210748530968e-1f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471880262273e-1f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000000754548972f));
        const __m256 e = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23)));
        const __m256 d = _mm256_add_ps(one, e);
        const __m256 r = _mm256_rcp_ps(d);
        _mm256_storeu_ps(x + i, _mm256_fmadd_ps(r, _mm256_fnmadd_ps(d, r, one), r));
    }
#endif
    ak_sigmoid_into(x + i, x + i, n - i, 1.0f, bias);
}

/* Gates of one tile: w = sigmoid(Q K^T + bias), 0 outside each row's band. */
static void sigmoid_tile(float *w, const float *qb, const float *kt, int64_t m, int64_t n, int64_t D,
                         float scale, float bias, int64_t first, int64_t j0, int has_lo, int64_t lo, int has_hi,
                         int64_t hi) {
    gemm_abt((int)m, (int)n, (int)D, scale, qb, (int)D, kt, (int)D, 0.0f, w, (int)n);
    gates_finite(w, m * n, bias);
    for (int64_t r = 0; r < m; r++) {
        int64_t c0, c1;
        band_columns(first + r, j0, n, has_lo, lo, has_hi, hi, &c0, &c1);
        float *row = w + r * n;
        for (int64_t c = 0; c < c0; c++) row[c] = 0.0f;
        for (int64_t c = c1; c < n; c++) row[c] = 0.0f;
    }
}

/* FlashSigmoid's forward (Ramapuram et al. 2024, arXiv 2409.04431) for the query-head rows
 * [bh0, bh1) of B*H: out = sigmoid(scale * Q K^T + bias) V over the keys of a diagonal band
 * lo <= key - (q_start + query) <= hi (has_lo / has_hi = 0: unbounded), with no row
 * statistics at all: each key tile adds sigmoid(S) V to the output and is done. q (B, H, Nq, D),
 * k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) and out (B, H, Nq, Dv) contiguous. Tiles of
 * BQ x BK logits of one head stay in L2 between the two matmuls. Returns 0, or 1 when
 * out of memory. */
int ak_sigmoid_attention(const ak_sigmoid_call &call, float *out, int64_t bh0, int64_t bh1) {
    const float *q = call.q, *k = call.k, *v = call.v;
    const float scale = call.scale, bias = call.bias;
    const int64_t H = call.dims.H, Hkv = call.dims.Hkv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D, Dv = call.dims.Dv;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const int64_t BQ = call.BQ, BK = call.BK;
    const auto s_buf = ak_buffer<float>(BQ * BK);
    float *s = s_buf.get();
    if (!s) return 1;
    const int64_t group = H / Hkv;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / H, kvh = b * Hkv + (bh % H) / group;
        const float *qh = q + bh * Nq * D, *kh = k + kvh * Nk * D, *vh = v + kvh * Nk * Dv;
        float *oh = out + bh * Nq * Dv;
        for (int64_t i = 0; i < Nq * Dv; i++) oh[i] = 0.0f;
        for (int64_t i0 = 0; i0 < Nq; i0 += BQ) {
            const int64_t m = Nq - i0 < BQ ? Nq - i0 : BQ, first = q_start + i0;  /* query positions */
            int64_t jlo, jhi;
            band_keys(first, first + m - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
                const int64_t n = jhi - j0 < BK ? jhi - j0 : BK;
                sigmoid_tile(s, qh + i0 * D, kh + j0 * D, m, n, D, scale, bias, first, j0, has_lo, lo, has_hi, hi);
                gemm_ab_acc((int)m, (int)Dv, (int)n, s, (int)n, vh + j0 * Dv, (int)Dv, oh + i0 * Dv, (int)Dv);
            }
        }
    }
    return 0;
}

/* Its backward, recomputing each tile's gates: with W = sigmoid(S) and dW = dO V^T,
 * dS = dW * W * (1 - W);  dV += W^T dO,  dQ += scale * dS K,  dK += dS^T Q (Q as given,
 * times ``scale`` inside S). dq, dk, dv are accumulated into (callers zero them); query
 * heads of one GQA group add into the same dk, dv, so [bh0, bh1) ranges run one at a time. */
int ak_sigmoid_attention_backward(const ak_sigmoid_call &call, const float *dout, float *dq, float *dk, float *dv,
                                  int64_t bh0, int64_t bh1) {
    const float *q = call.q, *k = call.k, *v = call.v;
    const float scale = call.scale, bias = call.bias;
    const int64_t H = call.dims.H, Hkv = call.dims.Hkv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D, Dv = call.dims.Dv;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const int64_t BQ = call.BQ, BK = call.BK;
    const auto w_buf = ak_buffer<float>(2 * BQ * BK);
    float *w = w_buf.get();
    if (!w) return 1;
    float *ds = w + BQ * BK;
    const int64_t group = H / Hkv;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / H, kvh = b * Hkv + (bh % H) / group;
        const float *qh = q + bh * Nq * D, *kh = k + kvh * Nk * D, *vh = v + kvh * Nk * Dv, *doh = dout + bh * Nq * Dv;
        float *dqh = dq + bh * Nq * D, *dkh = dk + kvh * Nk * D, *dvh = dv + kvh * Nk * Dv;
        for (int64_t i0 = 0; i0 < Nq; i0 += BQ) {
            const int64_t m = Nq - i0 < BQ ? Nq - i0 : BQ, first = q_start + i0;
            const float *qb = qh + i0 * D, *dob = doh + i0 * Dv;
            float *dqb = dqh + i0 * D;
            int64_t jlo, jhi;
            band_keys(first, first + m - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
                const int64_t n = jhi - j0 < BK ? jhi - j0 : BK;
                sigmoid_tile(w, qb, kh + j0 * D, m, n, D, scale, bias, first, j0, has_lo, lo, has_hi, hi);
                gemm_atb_acc((int)n, (int)Dv, (int)m, w, (int)n, dob, (int)Dv, dvh + j0 * Dv, (int)Dv);
                gemm_abt((int)m, (int)n, (int)Dv, 1.0f, dob, (int)Dv, vh + j0 * Dv, (int)Dv, 0.0f, ds, (int)n);
                for (int64_t i = 0; i < m * n; i++) ds[i] *= w[i] * (1.0f - w[i]);  /* vectorised by the compiler */
                gemm_ab_acc((int)m, (int)D, (int)n, ds, (int)n, kh + j0 * D, (int)D, dqb, (int)D);
                gemm_atb_acc((int)n, (int)D, (int)m, ds, (int)n, qb, (int)D, dkh + j0 * D, (int)D);
            }
            for (int64_t i = 0; i < m * D; i++) dqb[i] *= scale;  /* dS K was accumulated unscaled */
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ fused softmax attention */

/* Softmax attention forward (FlashAttention-2's loop, arXiv 2307.08691) for the query-head
 * rows [bh0, bh1) of B*H, with what torch's fused CPU op lacks: query/key head size D
 * different from the value head size Dv, any query-head -> key-head and -> value-head
 * map (kidx, vidx: per query head, into Hk and Hv heads of each batch row), an optional
 * softcap (cap * tanh(s / cap), Gemma 2) on s = scale * q.k, then an optional boost
 * s + t |s| with t per batch row, query head and key (PAI's image logits, arXiv
 * 2407.21771; a general score mod that would otherwise run as PyTorch tiles). Keys outside the
 * diagonal band lo <= key - (q_start + query) <= hi are hidden. Writes out (B, H, Nq, Dv)
 * and lse (B, H, Nq); a query that sees no key gets zeros and lse = -inf. */
int ak_softmax_attention(const ak_softmax_call &call, float *out, float *lse, int64_t bh0, int64_t bh1) {
    const float *q = call.q, *k = call.k, *v = call.v;
    const float scale = call.scale, softcap = call.softcap, *boost = call.boost;
    const int64_t *kidx = call.kidx, *vidx = call.vidx;
    const int64_t H = call.dims.H, Hk = call.dims.Hkv, Hv = call.Hv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D, Dv = call.dims.Dv;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const int64_t BQ = call.BQ, BK = call.BK;
    const auto s_buf = ak_buffer<float>(BQ * BK + 3 * BQ);
    float *s = s_buf.get();
    if (!s) return 1;
    float *m = s + BQ * BK, *l = m + BQ, *alpha = l + BQ;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / H, j = bh % H;
        const float *qh = q + bh * Nq * D, *kh = k + (b * Hk + kidx[j]) * Nk * D, *vh = v + (b * Hv + vidx[j]) * Nk * Dv;
        float *oh = out + bh * Nq * Dv, *lh = lse + bh * Nq;
        for (int64_t i0 = 0; i0 < Nq; i0 += BQ) {
            const int64_t rows = Nq - i0 < BQ ? Nq - i0 : BQ, first = q_start + i0;
            float *ob = oh + i0 * Dv;
            for (int64_t i = 0; i < rows * Dv; i++) ob[i] = 0.0f;
            for (int64_t r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
            int64_t jlo, jhi;
            band_keys(first, first + rows - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
                const int64_t n = jhi - j0 < BK ? jhi - j0 : BK;
                gemm_abt((int)rows, (int)n, (int)D, scale, qh + i0 * D, (int)D, kh + j0 * D, (int)D, 0.0f, s, (int)n);
                if (softcap > 0.0f) ak_softcap(s, s, rows * n, softcap);
                if (boost) ak_abs_boost(s, boost + bh * Nk + j0, 1, rows, n);
                hide_outside_band(s, rows, n, first, j0, has_lo, lo, has_hi, hi);
                ak_online_softmax(s, rows, n, m, l, alpha);
                for (int64_t r = 0; r < rows; r++)
                    if (alpha[r] != 1.0f)
                        for (int64_t d = 0; d < Dv; d++) ob[r * Dv + d] *= alpha[r];
                gemm_ab_acc((int)rows, (int)Dv, (int)n, s, (int)n, vh + j0 * Dv, (int)Dv, ob, (int)Dv);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                for (int64_t d = 0; d < Dv; d++) ob[r * Dv + d] *= inv;
                lh[i0 + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
            }
        }
    }
    return 0;
}

/* Top-k attention forward (softmax over the k largest logits of every row; Gupta et al.
 * 2021, arXiv 2106.06899) for the query-head rows [bh0, bh1) of B*H: per block of BQ
 * queries one product gives every logit the block's band reaches, topk_row picks each row's
 * k columns, and the output is the softmax of those k logits times their k value rows.
 * Keys outside a row's band count as -inf (chosen only where fewer than k are visible,
 * with weight 0). Writes out (B, H, Nq, Dv), lse, chosen and weights (B, H, Nq, k; a row
 * that reaches fewer than k keys pads with column 0, weight 0), kept (finite logits among
 * the chosen) and visible (keys in the row's band). q holds the scale already. Returns 1
 * when out of memory. */
int ak_topk_attention(const ak_topk_call &call, const ak_topk_outputs &o, int64_t bh0, int64_t bh1) {
    const float *q = call.q, *k = call.k, *v = call.v;
    float *out = o.out, *lse = o.lse, *weights = o.weights, *kept = o.kept, *visible = o.visible;
    int64_t *chosen = o.chosen;
    const int64_t H = call.dims.H, Hkv = call.dims.Hkv, Nq = call.dims.Nq, Nk = call.dims.Nk, D = call.dims.D, Dv = call.dims.Dv;
    const int64_t q_start = call.band.q_start, lo = call.band.lo, hi = call.band.hi;
    const int has_lo = call.band.has_lo, has_hi = call.band.has_hi;
    const int64_t width = call.width, BQ = call.BQ;
    const auto s_buf = ak_buffer<float>(BQ * (Nk > 0 ? Nk : 1)), bv_buf = ak_buffer<float>(6 * width);
    const auto bi_buf = ak_buffer<int64_t>(6 * width);
    float *s = s_buf.get(), *bv = bv_buf.get();
    int64_t *bi = bi_buf.get();
    if (!s || !bv || !bi) return 1;
    const int64_t group = H / Hkv;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t b = bh / H, kvh = b * Hkv + (bh % H) / group;
        const float *qh = q + bh * Nq * D, *kh = k + kvh * Nk * D, *vh = v + kvh * Nk * Dv;
        for (int64_t i0 = 0; i0 < Nq; i0 += BQ) {
            const int64_t rows = Nq - i0 < BQ ? Nq - i0 : BQ, first = q_start + i0;
            int64_t jlo, jhi;
            band_keys(first, first + rows - 1, Nk, has_lo, lo, has_hi, hi, &jlo, &jhi);
            const int64_t n = jhi > jlo ? jhi - jlo : 0;
            if (n > 0)
                gemm_abt((int)rows, (int)n, (int)D, 1.0f, qh + i0 * D, (int)D, kh + jlo * D, (int)D, 0.0f, s, (int)n);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t row = bh * Nq + i0 + r;
                float *x = s + r * n, *o = out + row * Dv, *w = weights + row * width;
                int64_t *c = chosen + row * width;
                int64_t c0, c1;
                band_columns(first + r, jlo, n, has_lo, lo, has_hi, hi, &c0, &c1);
                for (int64_t t = 0; t < c0; t++) x[t] = -INFINITY;
                for (int64_t t = c1; t < n; t++) x[t] = -INFINITY;
                visible[row] = (float)(c1 - c0);
                const int64_t m = n < width ? n : width;
                if (m > 0) ak_topk_row(x, n, m, bv, bi);
                float mx = -INFINITY;
                for (int64_t t = 0; t < m; t++) mx = bv[t] > mx ? bv[t] : mx;
                for (int64_t d = 0; d < Dv; d++) o[d] = 0.0f;
                float l = 0.0f, finite = 0.0f;
                for (int64_t t = 0; t < width; t++) {
                    const float p = t < m && mx > -INFINITY ? exp_scalar(bv[t] - mx) : 0.0f;
                    c[t] = t < m ? jlo + bi[t] : 0;
                    w[t] = p;
                    l += p;
                    finite += t < m && bv[t] > -INFINITY;
                }
                kept[row] = finite;
                if (l == 0.0f) {
                    lse[row] = -INFINITY;
                    continue;
                }
                lse[row] = mx + logf(l);
                const float inv = 1.0f / l;
                for (int64_t t = 0; t < m; t++) {
                    if (w[t] == 0.0f) continue;
                    w[t] *= inv;
                    const float *vr = vh + c[t] * Dv;
                    for (int64_t d = 0; d < Dv; d++) o[d] += w[t] * vr[d];  /* vectorised by the compiler */
                }
            }
        }
    }
    return 0;
}
