/* C loops for the chunked tile engines (loaded by kernels/native.py through ctypes).
 *
 * Pointwise tile math in one pass over memory: PyTorch evaluates sigmoid(s + b),
 * cap * tanh(s / cap), an online-softmax update or a head mix as chains of separate
 * kernels, each a full pass over the tile; on CPU those passes cost as much as the tile's
 * two matmuls (measured 1-3 ns per logit against a few tenths here). Then whole loops
 * around the sgemm of the BLAS inside PyTorch: sigmoid attention forward and backward,
 * a softmax forward with free head sizes; and two pieces torch runs slowly on CPU:
 * top-k of rows and a depthwise 2-D convolution.
 *
 * float32 only. exp is 2^n times a polynomial for 2^f (see exp_avx2); arguments below
 * the smallest normal result give exactly 0, so -inf (a masked logit) has weight 0. NaN
 * inputs propagate. Built with the host compiler (-march=native); every function has a
 * scalar path for CPUs without AVX2/FMA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AK_AVX2 1
#endif

static const float EXP_HI = 88.3762626647949f;
static const float EXP_LO = -87.3365447505531f;

static inline float exp_scalar(float x) {
    if (x < EXP_LO) return 0.0f;  /* also -inf; NaN compares false and falls through */
    return expf(x > EXP_HI ? EXP_HI : x);  /* NaN compares false again: expf(NaN) is NaN */
}

#ifdef AK_AVX2
static inline __m256 exp_avx2(__m256 x) {
    /* e^x = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2; 2^f by a degree-6 Taylor
     * polynomial in f ln 2 (relative error < 2e-7 ~ 1.5 ulp). Operand order of max/min
     * keeps NaN: they return their second operand when either is NaN. */
    const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    __m256 t = _mm256_mul_ps(_mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x)),
                             _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hmax_avx2(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* y <- sigmoid(sign * x + bias) = 1 / (1 + exp(-(sign * x + bias))); y may be x.
 * exp is capped at e^88: gates below 1 / (1 + e^88) (denormal) become 0, so a -inf
 * argument gives exactly 0 and +inf exactly 1. */
static void sigmoid_into(const float *x, float *y, int64_t n, float sign, float bias) {
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
void ak_sigmoid(float *x, int64_t n, float bias) { sigmoid_into(x, x, n, 1.0f, bias); }

/* Stick-breaking weights of one tile (Tan et al. 2024, arXiv 2410.17980), keys right to
 * left: per row, A_j = beta_j * c and c <- c * (1 - beta_j) with beta = sigmoid(z), starting
 * from the stick ``carry`` that the keys right of the tile left over. s (rows, cols) is
 * replaced by A, carry by the stick left for the tile on the left. 1 - beta is computed
 * as sigmoid(-z), exact where beta rounds to 1; a hidden key (z = -inf) has beta = 0
 * and 1 - beta = 1 exactly. Four rows at a time: their running products are independent
 * chains, so the multiplier latency overlaps. */
int ak_stick_breaking(float *s, int64_t rows, int64_t cols, float *carry) {
    enum { R = 4 };
    float *buf = (float *)malloc(sizeof(float) * 2 * R * (cols > 0 ? cols : 1));
    if (!buf) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        int64_t nr = rows - r0 < R ? rows - r0 : R;
        float c[R];
        for (int64_t t = 0; t < nr; t++) {
            sigmoid_into(s + (r0 + t) * cols, buf + t * cols, cols, 1.0f, 0.0f);
            sigmoid_into(s + (r0 + t) * cols, buf + (R + t) * cols, cols, -1.0f, 0.0f);
            c[t] = carry[r0 + t];
        }
        for (int64_t j = cols - 1; j >= 0; j--)
            for (int64_t t = 0; t < nr; t++) {
                s[(r0 + t) * cols + j] = buf[t * cols + j] * c[t];
                c[t] *= buf[(R + t) * cols + j];
            }
        for (int64_t t = 0; t < nr; t++) carry[r0 + t] = c[t];
    }
    free(buf);
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
        float sum = 0.0f;
        j = 0;
#ifdef AK_AVX2
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (; j + 8 <= cols; j += 8) {
            __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm));
            _mm256_storeu_ps(row + j, p);
            vsum = _mm256_add_ps(vsum, p);
        }
        sum = hsum_avx2(vsum);
#endif
        for (; j < cols; j++) {
            row[j] = exp_scalar(row[j] - mx);
            sum += row[j];
        }
        alpha[r] = exp_scalar(m[r] - mx);
        l[r] = l[r] * alpha[r] + sum;
        m[r] = mx;
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

/* ------------------------------------------------------------------ fused sigmoid attention */

/* Fortran BLAS sgemm (column-major), as exported by the BLAS that PyTorch links. */
typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* C (m x n, row-major, ldc) = alpha * A (m x k, row-major, lda) * B^T (B: n x k, row-major, ldb) + beta * C */
static void gemm_abt(sgemm_fn gemm, int m, int n, int k, float alpha, const float *a, int lda,
                     const float *b, int ldb, float beta, float *c, int ldc) {
    /* row-major C is column-major C^T = B A^T */
    gemm("T", "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

/* C (m x n, row-major) += A (m x k, row-major) * B (k x n, row-major) */
static void gemm_ab_acc(sgemm_fn gemm, int m, int n, int k, const float *a, int lda, const float *b, int ldb,
                        float *c, int ldc) {
    const float one = 1.0f;
    gemm("N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

/* C (m x n, row-major) += A^T B for A (k x m, row-major) and B (k x n, row-major) */
static void gemm_atb_acc(sgemm_fn gemm, int m, int n, int k, const float *a, int lda, const float *b, int ldb,
                         float *c, int ldc) {
    const float one = 1.0f;
    gemm("N", "T", &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

/* The key columns [c0, c1) of a tile row that lie in the band of query position pos. */
static void band_columns(int64_t pos, int64_t j0, int64_t n, int has_lo, int64_t lo, int has_hi, int64_t hi,
                         int64_t *c0, int64_t *c1) {
    int64_t a = has_lo ? pos + lo - j0 : 0, b = has_hi ? pos + hi + 1 - j0 : n;
    if (a < 0) a = 0;
    if (b > n) b = n;
    *c0 = a;
    *c1 = b > a ? b : a;
}

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
    sigmoid_into(x + i, x + i, n - i, 1.0f, bias);
}

/* Gates of one tile: w = sigmoid(Q K^T + bias), 0 outside each row's band. */
static void sigmoid_tile(sgemm_fn gemm, float *w, const float *qb, const float *kt, int64_t m, int64_t n, int64_t D,
                         float scale, float bias, int64_t first, int64_t j0, int has_lo, int64_t lo, int has_hi,
                         int64_t hi) {
    gemm_abt(gemm, (int)m, (int)n, (int)D, scale, qb, (int)D, kt, (int)D, 0.0f, w, (int)n);
    gates_finite(w, m * n, bias);
    for (int64_t r = 0; r < m; r++) {
        int64_t c0, c1;
        band_columns(first + r, j0, n, has_lo, lo, has_hi, hi, &c0, &c1);
        float *row = w + r * n;
        for (int64_t c = 0; c < c0; c++) row[c] = 0.0f;
        for (int64_t c = c1; c < n; c++) row[c] = 0.0f;
    }
}

/* The key range [*jlo, *jhi) that the queries [first, last] reach. */
static void band_keys(int64_t first, int64_t last, int64_t Nk, int has_lo, int64_t lo, int has_hi, int64_t hi,
                      int64_t *jlo, int64_t *jhi) {
    int64_t a = has_lo ? first + lo : 0, b = has_hi ? last + hi + 1 : Nk;
    *jlo = a < 0 ? 0 : a;
    *jhi = b > Nk ? Nk : b;
}

/* FlashSigmoid's forward (Ramapuram et al. 2024, arXiv 2409.04431) for the query-head rows
 * [bh0, bh1) of B*H: out = sigmoid(scale * Q K^T + bias) V over the keys of a diagonal band
 * lo <= key - (q_start + query) <= hi (has_lo / has_hi = 0: unbounded), with no row
 * statistics at all: each key tile adds sigmoid(S) V to the output and is done. q (B, H, Nq, D),
 * k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) and out (B, H, Nq, Dv) contiguous. Tiles of
 * BQ x BK logits of one head stay in L2 between the two matmuls. Returns 0, or 1 when
 * out of memory. */
int ak_sigmoid_attention(const float *q, const float *k, const float *v, float *out, int64_t bh0, int64_t bh1,
                         int64_t H, int64_t Hkv, int64_t Nq, int64_t Nk, int64_t D, int64_t Dv, float scale, float bias,
                         int64_t q_start, int has_lo, int64_t lo, int has_hi, int64_t hi, int64_t BQ, int64_t BK,
                         void *sgemm) {
    sgemm_fn gemm = (sgemm_fn)sgemm;
    float *s = (float *)malloc(sizeof(float) * BQ * BK);
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
                sigmoid_tile(gemm, s, qh + i0 * D, kh + j0 * D, m, n, D, scale, bias, first, j0, has_lo, lo, has_hi, hi);
                gemm_ab_acc(gemm, (int)m, (int)Dv, (int)n, s, (int)n, vh + j0 * Dv, (int)Dv, oh + i0 * Dv, (int)Dv);
            }
        }
    }
    free(s);
    return 0;
}

/* Its backward, recomputing each tile's gates: with W = sigmoid(S) and dW = dO V^T,
 * dS = dW * W * (1 - W);  dV += W^T dO,  dQ += scale * dS K,  dK += dS^T Q (Q as given,
 * times ``scale`` inside S). dq, dk, dv are accumulated into (callers zero them); query
 * heads of one GQA group add into the same dk, dv, so [bh0, bh1) ranges run one at a time. */
int ak_sigmoid_attention_backward(const float *q, const float *k, const float *v, const float *dout, float *dq,
                                  float *dk, float *dv, int64_t bh0, int64_t bh1, int64_t H, int64_t Hkv, int64_t Nq,
                                  int64_t Nk, int64_t D, int64_t Dv, float scale, float bias, int64_t q_start,
                                  int has_lo, int64_t lo, int has_hi, int64_t hi, int64_t BQ, int64_t BK, void *sgemm) {
    sgemm_fn gemm = (sgemm_fn)sgemm;
    float *w = (float *)malloc(sizeof(float) * 2 * BQ * BK);
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
                sigmoid_tile(gemm, w, qb, kh + j0 * D, m, n, D, scale, bias, first, j0, has_lo, lo, has_hi, hi);
                gemm_atb_acc(gemm, (int)n, (int)Dv, (int)m, w, (int)n, dob, (int)Dv, dvh + j0 * Dv, (int)Dv);
                gemm_abt(gemm, (int)m, (int)n, (int)Dv, 1.0f, dob, (int)Dv, vh + j0 * Dv, (int)Dv, 0.0f, ds, (int)n);
                for (int64_t i = 0; i < m * n; i++) ds[i] *= w[i] * (1.0f - w[i]);  /* vectorised by the compiler */
                gemm_ab_acc(gemm, (int)m, (int)D, (int)n, ds, (int)n, kh + j0 * D, (int)D, dqb, (int)D);
                gemm_atb_acc(gemm, (int)n, (int)D, (int)m, ds, (int)n, qb, (int)D, dkh + j0 * D, (int)D);
            }
            for (int64_t i = 0; i < m * D; i++) dqb[i] *= scale;  /* dS K was accumulated unscaled */
        }
    }
    free(w);
    return 0;
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

/* ------------------------------------------------------------------ fused softmax attention */

/* Softmax attention forward (FlashAttention-2's loop, arXiv 2307.08691) for the query-head
 * rows [bh0, bh1) of B*H, with what torch's fused CPU op lacks: query/key head size D
 * different from the value head size Dv, any query-head -> key-head and -> value-head
 * map (kidx, vidx: per query head, into Hk and Hv heads of each batch row), and an
 * optional softcap (cap * tanh(s / cap), Gemma 2) on s = scale * q.k. Keys outside the
 * diagonal band lo <= key - (q_start + query) <= hi are hidden. Writes out (B, H, Nq, Dv)
 * and lse (B, H, Nq); a query that sees no key gets zeros and lse = -inf. */
int ak_softmax_attention(const float *q, const float *k, const float *v, float *out, float *lse, int64_t bh0,
                         int64_t bh1, int64_t H, int64_t Hk, int64_t Hv, const int64_t *kidx, const int64_t *vidx,
                         int64_t Nq, int64_t Nk, int64_t D, int64_t Dv, float scale, float softcap, int64_t q_start,
                         int has_lo, int64_t lo, int has_hi, int64_t hi, int64_t BQ, int64_t BK, void *sgemm) {
    sgemm_fn gemm = (sgemm_fn)sgemm;
    float *s = (float *)malloc(sizeof(float) * (BQ * BK + 3 * BQ));
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
                gemm_abt(gemm, (int)rows, (int)n, (int)D, scale, qh + i0 * D, (int)D, kh + j0 * D, (int)D, 0.0f, s, (int)n);
                if (softcap > 0.0f) ak_softcap(s, s, rows * n, softcap);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t c0, c1;
                    band_columns(first + r, j0, n, has_lo, lo, has_hi, hi, &c0, &c1);
                    float *row = s + r * n;
                    for (int64_t c = 0; c < c0; c++) row[c] = -INFINITY;
                    for (int64_t c = c1; c < n; c++) row[c] = -INFINITY;
                }
                ak_online_softmax(s, rows, n, m, l, alpha);
                for (int64_t r = 0; r < rows; r++)
                    if (alpha[r] != 1.0f)
                        for (int64_t d = 0; d < Dv; d++) ob[r * Dv + d] *= alpha[r];
                gemm_ab_acc(gemm, (int)rows, (int)Dv, (int)n, s, (int)n, vh + j0 * Dv, (int)Dv, ob, (int)Dv);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                for (int64_t d = 0; d < Dv; d++) ob[r * Dv + d] *= inv;
                lh[i0 + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
            }
        }
    }
    free(s);
    return 0;
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
static void topk_row(const float *x, int64_t cols, int64_t k, float *bv, int64_t *bi) {
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
    float *bv = (float *)malloc(sizeof(float) * 6 * k);
    int64_t *bi = (int64_t *)malloc(sizeof(int64_t) * 6 * k);
    if (!bv || !bi) {
        free(bv), free(bi);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++) {
        topk_row(s + r * cols, cols, k, bv, bi);
        for (int64_t u = 0; u < k; u++) values[r * k + u] = bv[u], columns[r * k + u] = bi[u];
    }
    free(bv), free(bi);
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
    float *buf = (float *)malloc(sizeof(float) * 2 * R * (cols > 0 ? cols : 1));
    if (!buf) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
        int64_t nr = rows - r0 < R ? rows - r0 : R;
        float c[R], sw[R], d[R];
        for (int64_t t = 0; t < nr; t++) {
            sigmoid_into(s + (r0 + t) * cols, buf + t * cols, cols, 1.0f, 0.0f);
            sigmoid_into(s + (r0 + t) * cols, buf + (R + t) * cols, cols, -1.0f, 0.0f);
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
    free(buf);
    return 0;
}

/* Top-k attention forward (softmax over the k largest logits of every row; Gupta et al.
 * 2021, arXiv 2106.06899) for the query-head rows [bh0, bh1) of B*H: per block of BQ
 * queries one sgemm gives every logit the block's band reaches, topk_row picks each row's
 * k columns, and the output is the softmax of those k logits times their k value rows.
 * Keys outside a row's band count as -inf (chosen only where fewer than k are visible,
 * with weight 0). Writes out (B, H, Nq, Dv), lse, chosen and weights (B, H, Nq, k; a row
 * that reaches fewer than k keys pads with column 0, weight 0), kept (finite logits among
 * the chosen) and visible (keys in the row's band). q holds the scale already. Returns 1
 * when out of memory. */
int ak_topk_attention(const float *q, const float *k, const float *v, float *out, float *lse, int64_t *chosen,
                      float *weights, float *kept, float *visible, int64_t bh0, int64_t bh1, int64_t H, int64_t Hkv,
                      int64_t Nq, int64_t Nk, int64_t D, int64_t Dv, int64_t q_start, int has_lo, int64_t lo, int has_hi,
                      int64_t hi, int64_t width, int64_t BQ, void *sgemm) {
    sgemm_fn gemm = (sgemm_fn)sgemm;
    float *s = (float *)malloc(sizeof(float) * BQ * (Nk > 0 ? Nk : 1));
    float *bv = (float *)malloc(sizeof(float) * 6 * width);
    int64_t *bi = (int64_t *)malloc(sizeof(int64_t) * 6 * width);
    if (!s || !bv || !bi) {
        free(s), free(bv), free(bi);
        return 1;
    }
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
                gemm_abt(gemm, (int)rows, (int)n, (int)D, 1.0f, qh + i0 * D, (int)D, kh + jlo * D, (int)D, 0.0f, s, (int)n);
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
                if (m > 0) topk_row(x, n, m, bv, bi);
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
    free(s), free(bv), free(bi);
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
