/* Pointwise tile math in one pass over memory, for the chunked tile loops (bound as
 * operators in pointwise.cpp). PyTorch evaluates sigmoid(s + b), cap * tanh(s / cap),
 * an online-softmax update or a head mix as chains of separate kernels, each a full pass
 * over the tile; on CPU those passes cost as much as the tile's two matmuls (measured
 * 1-3 ns per logit against a few tenths here). Also two pieces torch runs slowly on CPU:
 * top-k of rows and a depthwise 2-D convolution (with its gradients). Every function has
 * a scalar path for CPUs without AVX2/FMA. */
#include "common.h"

/* y <- sigmoid(sign * x + bias) = 1 / (1 + exp(-(sign * x + bias))); y may be x.
 * exp is capped at e^88: gates below 1 / (1 + e^88) (denormal) become 0, so a -inf
 * argument gives exactly 0 and +inf exactly 1. */
void ak_sigmoid_into(const float *x, float *y, int64_t n, float sign, float bias) {
    int64_t i = 0;
#ifdef AK_AVX2
    const __m256 sg = _mm256_set1_ps(-sign), b = _mm256_set1_ps(-bias), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 z = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), sg, b);  /* -(sign x + bias) */
        const __m256 tiny = _mm256_cmp_ps(z, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ);
        /* 1 / d by the reciprocal estimate (12 bits) and two Newton steps r + r (1 - d r),
         * residuals exact by FMA (the first leaves ~1 ulp, the second rounds 1 / 1 and
         * 1 / 2 exactly): still cheaper than the 8-wide division */
        const __m256 d = _mm256_add_ps(one, exp_avx2(z));
        __m256 w = _mm256_rcp_ps(d);
        w = _mm256_fmadd_ps(w, _mm256_fnmadd_ps(d, w, one), w);
        w = _mm256_fmadd_ps(w, _mm256_fnmadd_ps(d, w, one), w);
        _mm256_storeu_ps(y + i, _mm256_andnot_ps(tiny, w));
    }
#endif
    for (; i < n; i++) {
        float z = -(sign * x[i] + bias);
        y[i] = z > EXP_HI ? 0.0f : 1.0f / (1.0f + exp_scalar(z));
    }
}

/* x <- sigmoid(x + bias), in place. */
void ak_sigmoid(float *x, int64_t n, float bias) { ak_sigmoid_into(x, x, n, 1.0f, bias); }

/* Stick-breaking weights of one tile (Tan et al. 2024, arXiv 2410.17980), keys right to
 * left: per row, A_j = beta_j * c and c <- c * (1 - beta_j) with beta = sigmoid(z), starting
 * from the stick ``carry`` that the keys right of the tile left over. s (rows, cols) is
 * replaced by A, carry by the stick left for the tile on the left. 1 - beta is computed
 * as sigmoid(-z), exact where beta rounds to 1; a hidden key (z = -inf) has beta = 0
 * and 1 - beta = 1 exactly. Four rows at a time: their running products are independent
 * chains, so the multiplier latency overlaps. */
int ak_stick_breaking(float *s, int64_t rows, int64_t cols, float *carry) {
    enum { R = 4 };
    const auto buf_owner = ak_buffer<float>(2 * R * (cols > 0 ? cols : 1));
    float *buf = buf_owner.get();
    if (!buf) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        int64_t nr = rows - r0 < R ? rows - r0 : R;
        float c[R];
        for (int64_t t = 0; t < nr; t++) {
            ak_sigmoid_into(s + (r0 + t) * cols, buf + t * cols, cols, 1.0f, 0.0f);
            ak_sigmoid_into(s + (r0 + t) * cols, buf + (R + t) * cols, cols, -1.0f, 0.0f);
            c[t] = carry[r0 + t];
        }
        for (int64_t j = cols - 1; j >= 0; j--)
            for (int64_t t = 0; t < nr; t++) {
                s[(r0 + t) * cols + j] = buf[t * cols + j] * c[t];
                c[t] *= buf[(R + t) * cols + j];
            }
        for (int64_t t = 0; t < nr; t++) carry[r0 + t] = c[t];
    }
    return 0;
}

/* y <- cap * tanh(x / cap), with tanh(t) = 1 - 2 / (exp(2t) + 1). */
void ak_softcap(const float *x, float *y, int64_t n, float cap) {
    const float two_over_cap = 2.0f / cap;
    int64_t i = 0;
#ifdef AK_AVX2
    const __m256 k = _mm256_set1_ps(two_over_cap), c = _mm256_set1_ps(cap);
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_mul_ps(_mm256_loadu_ps(x + i), k));
        __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(c, t));
    }
#endif
    for (; i < n; i++) {
        float t = x[i] * two_over_cap;
        y[i] = cap * (1.0f - 2.0f / (exp_scalar(t) + 1.0f));
    }
}

/* One tile of the online softmax (FlashAttention-2, arXiv 2307.08691), row by row:
 *   m' = max(m, max_j s_j);  s_j <- exp(s_j - m');  alpha = exp(m - m');  l <- l * alpha + sum_j s_j;  m <- m'
 * s is (rows, cols) contiguous. A row that has seen no visible key yet keeps m = -inf,
 * gets zero weights and alpha = 1 (its accumulator is zero anyway). */
void ak_online_softmax(float *s, int64_t rows, int64_t cols, float *m, float *l, float *alpha) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * cols;
        float mx = m[r];
        int64_t j = 0;
#ifdef AK_AVX2
        __m256 vmax = _mm256_set1_ps(mx);
        for (; j + 8 <= cols; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
        mx = hmax_avx2(vmax);
#endif
        for (; j < cols; j++) mx = row[j] > mx ? row[j] : mx;
        if (mx == -INFINITY) {
            for (j = 0; j < cols; j++) row[j] = 0.0f;
            alpha[r] = 1.0f;
            continue;
        }
        const float sum = exp_sum(row, cols, mx);
        alpha[r] = exp_scalar(m[r] - mx);
        l[r] = l[r] * alpha[r] + sum;
        m[r] = mx;
    }
}

/* s <- s + t |s| over G groups of R rows of C logits, t (G, C) one coefficient per group
 * and column: PAI's boost of image logits (arXiv 2407.21771), one pass instead of torch's
 * abs, multiply-add and the guard. -inf stays -inf (-inf + t inf would be NaN: a hidden
 * key stays hidden); NaN stays NaN. */
void ak_abs_boost(float *s, const float *t, int64_t groups, int64_t rows, int64_t cols) {
    for (int64_t g = 0; g < groups; g++) {
        const float *tg = t + g * cols;
        for (int64_t r = 0; r < rows; r++) {
            float *row = s + (g * rows + r) * cols;
            int64_t j = 0;
#ifdef AK_AVX2
            const __m256 sign = _mm256_set1_ps(-0.0f), ninf = _mm256_set1_ps(-INFINITY);
            for (; j + 8 <= cols; j += 8) {
                const __m256 x = _mm256_loadu_ps(row + j);
                const __m256 y = _mm256_fmadd_ps(_mm256_loadu_ps(tg + j), _mm256_andnot_ps(sign, x), x);
                _mm256_storeu_ps(row + j, _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ)));
            }
#endif
            for (; j < cols; j++) {
                const float x = row[j];
                row[j] = x == -INFINITY ? x : fmaf(tg[j], fabsf(x), x);  /* fused, as the vector path */
            }
        }
    }
}

/* out[b, g, r, :] = sum_h mix[g, h] * scale[b, h, r] * x[b, h, r, :] for x (B, H, R, C),
 * out (B, G, R, C) and scale (B, H, R) or NULL (all ones), contiguous: a head-mixing
 * matmul with an inner dimension of a few heads, which BLAS runs far below its memory
 * bound, fused with a per-row scale (the softmax normaliser). Chunks of a row stay in L1
 * across the G outputs. */
void ak_mix_heads_scaled(const float *mix, const float *x, const float *scale, float *out, int64_t B, int64_t G,
                         int64_t H, int64_t R, int64_t C) {
    enum { CHUNK = 512, MAXH = 64 };
    float coef[MAXH];
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < R; r++) {
            const float *xr = x + (b * H * R + r) * C;
            float *orow = out + (b * G * R + r) * C;
            for (int64_t c0 = 0; c0 < C; c0 += CHUNK) {
                int64_t c1 = c0 + CHUNK < C ? c0 + CHUNK : C;
                for (int64_t g = 0; g < G; g++) {
                    for (int64_t h = 0; h < H; h++)
                        coef[h] = mix[g * H + h] * (scale ? scale[(b * H + h) * R + r] : 1.0f);
                    float *o = orow + g * R * C;
                    int64_t i = c0;
#ifdef AK_AVX2
                    for (; i + 8 <= c1; i += 8) {
                        __m256 acc = _mm256_setzero_ps();
                        for (int64_t h = 0; h < H; h++)
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(coef[h]), _mm256_loadu_ps(xr + h * R * C + i), acc);
                        _mm256_storeu_ps(o + i, acc);
                    }
#endif
                    for (; i < c1; i++) {
                        float acc = 0.0f;
                        for (int64_t h = 0; h < H; h++) acc += coef[h] * xr[h * R * C + i];
                        o[i] = acc;
                    }
                }
            }
        }
}

/* y = depthwise "valid" 2-D correlation of x with one (cq x ck) kernel per head:
 *   y[n, h, r, c] = sum_{a < cq, b < ck} w[h, a, b] * x[n, h, r + a, c + b]
 * for x (N, H, R, C) and y (N, H, R - cq + 1, C - ck + 1), contiguous. Multi-token
 * attention's key-query convolution (arXiv 2504.00927); oneDNN's depthwise path runs it
 * below FMA throughput. 64 outputs of a row share each broadcast weight; their 8
 * independent accumulators cover the FMA latency. */
void ak_depthwise_conv2d(const float *x, const float *w, float *y, int64_t N, int64_t H, int64_t R, int64_t C,
                         int64_t cq, int64_t ck) {
    const int64_t Ro = R - cq + 1, Co = C - ck + 1;
    if (Ro <= 0 || Co <= 0) return;
    for (int64_t nh = 0; nh < N * H; nh++) {
        const float *xp = x + nh * R * C, *wh = w + (nh % H) * cq * ck;
        float *yp = y + nh * Ro * Co;
        for (int64_t r = 0; r < Ro; r++) {
            float *yr = yp + r * Co;
            int64_t c = 0;
#ifdef AK_AVX2
            for (; c + 64 <= Co; c += 64) {
                __m256 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
                for (int64_t a = 0; a < cq; a++) {
                    const float *xr = xp + (r + a) * C + c;
                    for (int64_t b = 0; b < ck; b++) {
                        const __m256 wv = _mm256_set1_ps(wh[a * ck + b]);
                        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + b + 8 * u), acc[u]);
                    }
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(yr + c + 8 * u, acc[u]);
            }
            for (; c + 8 <= Co; c += 8) {  /* the rest of the row, 8 at a time (halo widths are not multiples of 64) */
                __m256 acc = _mm256_setzero_ps();
                for (int64_t a = 0; a < cq; a++) {
                    const float *xr = xp + (r + a) * C + c;
                    for (int64_t b = 0; b < ck; b++) acc = _mm256_fmadd_ps(_mm256_set1_ps(wh[a * ck + b]), _mm256_loadu_ps(xr + b), acc);
                }
                _mm256_storeu_ps(yr + c, acc);
            }
#endif
            for (; c < Co; c++) {
                float acc = 0.0f;
                for (int64_t a = 0; a < cq; a++)
                    for (int64_t b = 0; b < ck; b++) acc += wh[a * ck + b] * xp[(r + a) * C + c + b];
                yr[c] = acc;
            }
        }
    }
}

/* ------------------------------------------------------------------ top-k of rows */

/* Reorder (v, ix)[0..n) so that its first k entries are the k largest values (quickselect,
 * Hoare partition around a median of three; ties in any order). */
static void select_top(float *v, int64_t *ix, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float a = v[lo], b = v[mid], c = v[hi];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float tv = v[i]; v[i] = v[j]; v[j] = tv;
                int64_t ti = ix[i]; ix[i] = ix[j]; ix[j] = ti;
                i++, j--;
            }
        }
        /* [lo, j] >= pivot >= [i, hi] */
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* The k largest values of the row x (cols >= k entries), unsorted, into bv[0..k) with
 * their columns in bi[0..k). A first bar comes cheap: the k-th largest of the maxima of
 * 2k groups of columns — k distinct entries reach it, so nothing below it is in the top
 * k, and half the groups may be fully masked (-inf) without loosening it. Entries that
 * reach the bar collect in a buffer of 4k; should it fill, quickselect keeps the best k
 * and their k-th value becomes the (strict) bar. On attention logits a few percent of a
 * row reaches the first bar, so the cost is about two vectorised passes, where
 * torch.topk spends ~10 ns per element. bv, bi hold 6k entries (the last 2k: scratch). */
void ak_topk_row(const float *x, int64_t cols, int64_t k, float *bv, int64_t *bi) {
    const int64_t cap = 4 * k, groups = 2 * k, g = cols / groups;  /* the last cols % groups columns: in none */
    float *gmax = bv + cap;
    float bar = -INFINITY;
    if (g > 0) {
        for (int64_t q = 0; q < groups; q++) {
            float mx = -INFINITY;
            int64_t t = q * g;
#ifdef AK_AVX2
            if (g >= 8) {
                __m256 vm = _mm256_loadu_ps(x + t);
                for (t += 8; t + 8 <= (q + 1) * g; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + t));
                mx = hmax_avx2(vm);
            }
#endif
            for (; t < (q + 1) * g; t++) mx = x[t] > mx ? x[t] : mx;
            gmax[q] = mx;
        }
        select_top(gmax, bi + cap, groups, k);
        bar = gmax[0];
        for (int64_t u = 1; u < k; u++) bar = gmax[u] < bar ? gmax[u] : bar;
    }
    int64_t n = 0, strict = 0;
#define AK_TAKE(t)                                                   \
    if (strict ? x[t] > bar : x[t] >= bar) {                         \
        bv[n] = x[t], bi[n] = t;                                     \
        if (++n == cap) {                                            \
            select_top(bv, bi, n, k);                                \
            n = k, strict = 1, bar = bv[0];                          \
            for (int64_t u = 1; u < k; u++) bar = bv[u] < bar ? bv[u] : bar; \
        }                                                            \
    }
    int64_t j = 0;
#ifdef AK_AVX2
    for (; j + 8 <= cols; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j), b = _mm256_set1_ps(bar);
        if (!_mm256_movemask_ps(strict ? _mm256_cmp_ps(v, b, _CMP_GT_OQ) : _mm256_cmp_ps(v, b, _CMP_GE_OQ))) continue;
        for (int64_t t = j; t < j + 8; t++) { AK_TAKE(t) }
    }
#endif
    for (; j < cols; j++) { AK_TAKE(j) }
#undef AK_TAKE
    select_top(bv, bi, n, k);
}

/* topk_row for every row of s (rows, cols), k <= cols. Returns 1 when out of memory. */
int ak_topk_rows(const float *s, int64_t rows, int64_t cols, int64_t k, float *values, int64_t *columns) {
    const auto bv_buf = ak_buffer<float>(6 * k);
    const auto bi_buf = ak_buffer<int64_t>(6 * k);
    float *bv = bv_buf.get();
    int64_t *bi = bi_buf.get();
    if (!bv || !bi) return 1;
    for (int64_t r = 0; r < rows; r++) {
        ak_topk_row(s + r * cols, cols, k, bv, bi);
        for (int64_t u = 0; u < k; u++) values[r * k + u] = bv[u], columns[r * k + u] = bi[u];
    }
    return 0;
}

/* The backward of ak_stick_breaking for one tile, keys right to left, given dW = dO V^T
 * (rows, cols) in dw and per row: the stick ``carry`` left by the keys right of the tile,
 * ``carry_w`` = sum of W = A * dW over those keys, and delta = rowsum(dO * O). With
 * S_j = sum_{k >= j} W_k (carry_w included), dz_j = (1 - beta_j) W_j - beta_j (delta - S_j).
 * s becomes A (for dV = A^T dO), dw becomes dz; carry and carry_w move to the tile's left
 * edge. Returns 1 when out of memory. */
int ak_stick_breaking_backward(float *s, float *dw, int64_t rows, int64_t cols, float *carry, float *carry_w,
                               const float *delta) {
    enum { R = 4 };
    const auto buf_owner = ak_buffer<float>(2 * R * (cols > 0 ? cols : 1));
    float *buf = buf_owner.get();
    if (!buf) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        int64_t nr = rows - r0 < R ? rows - r0 : R;
        float c[R], sw[R], d[R];
        for (int64_t t = 0; t < nr; t++) {
            ak_sigmoid_into(s + (r0 + t) * cols, buf + t * cols, cols, 1.0f, 0.0f);
            ak_sigmoid_into(s + (r0 + t) * cols, buf + (R + t) * cols, cols, -1.0f, 0.0f);
            c[t] = carry[r0 + t], sw[t] = carry_w[r0 + t], d[t] = delta[r0 + t];
        }
        for (int64_t j = cols - 1; j >= 0; j--)
            for (int64_t t = 0; t < nr; t++) {
                const int64_t at = (r0 + t) * cols + j;
                const float beta = buf[t * cols + j], rest = buf[(R + t) * cols + j];
                const float a = beta * c[t], w = a * dw[at];
                c[t] *= rest;
                sw[t] += w;
                s[at] = a;
                dw[at] = rest * w - beta * (d[t] - sw[t]);
            }
        for (int64_t t = 0; t < nr; t++) carry[r0 + t] = c[t], carry_w[r0 + t] = sw[t];
    }
    return 0;
}

/* The kernel gradient of ak_depthwise_conv2d: dw[h, a, b] = sum over n, r, c of
 * x[n, h, r + a, c + b] * dy[n, h, r, c], for x (N, H, R, C), dy (N, H, R - cq + 1,
 * C - ck + 1) and dw (H, cq, ck), all contiguous; dw is overwritten. One dot product per
 * kernel tap over the whole plane (which stays in L2 across the taps). */
void ak_depthwise_conv2d_weight_grad(const float *x, const float *dy, float *dw, int64_t N, int64_t H, int64_t R,
                                     int64_t C, int64_t cq, int64_t ck) {
    const int64_t Ro = R - cq + 1, Co = C - ck + 1;
    for (int64_t i = 0; i < H * cq * ck; i++) dw[i] = 0.0f;
    if (Ro <= 0 || Co <= 0) return;
    for (int64_t nh = 0; nh < N * H; nh++) {
        const float *xp = x + nh * R * C, *gp = dy + nh * Ro * Co;
        float *wh = dw + (nh % H) * cq * ck;
        for (int64_t a = 0; a < cq; a++)
            for (int64_t b = 0; b < ck; b++) {
                float acc = 0.0f;
#ifdef AK_AVX2
                __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;  /* 4 chains hide the FMA latency */
#endif
                for (int64_t r = 0; r < Ro; r++) {
                    const float *xr = xp + (r + a) * C + b, *gr = gp + r * Co;
                    int64_t c = 0;
#ifdef AK_AVX2
                    for (; c + 32 <= Co; c += 32) {
                        v0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(gr + c), v0);
                        v1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 8), _mm256_loadu_ps(gr + c + 8), v1);
                        v2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 16), _mm256_loadu_ps(gr + c + 16), v2);
                        v3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c + 24), _mm256_loadu_ps(gr + c + 24), v3);
                    }
                    for (; c + 8 <= Co; c += 8) v0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(gr + c), v0);
#endif
                    for (; c < Co; c++) acc += xr[c] * gr[c];
                }
#ifdef AK_AVX2
                acc += hsum_avx2(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
#endif
                wh[a * ck + b] += acc;
            }
    }
}
