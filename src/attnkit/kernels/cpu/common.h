/* Shared by the tile loops of the CPU operators (loops_*.cpp): vectorised exp and
 * reductions, the tile products (gemm.cpp), and the functions one file calls in another. float32 only; exp is 2^n
 * times a polynomial for 2^f (see exp_avx2); arguments below the smallest normal result
 * give exactly 0, so -inf (a masked logit) has weight 0; NaN inputs propagate. */
#ifndef ATTNKIT_CPU_COMMON_H
#define ATTNKIT_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <memory>
#include <new>

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

/* ------------------------------------------------------------------ buffers */

/* A scratch buffer of n (at least 1) uninitialised T, freed when it goes out of scope
 * (also when a tile product throws); empty (get() == nullptr) when out of memory. */
template <class T>
static inline std::unique_ptr<T[]> ak_buffer(int64_t n) {
    return std::unique_ptr<T[]>(new (std::nothrow) T[n > 0 ? (size_t)n : 1]);
}

/* ------------------------------------------------------------------ matrix products */

/* The tile products, row-major with leading dimensions, on what libtorch exports to
 * extensions (gemm.cpp: ATen's mm on views of the buffers, or oneDNN's brgemm ukernel
 * through at::native::cpublas::brgemm), single-threaded inside at::parallel_for. */

/* C (m x n) = alpha * A (m x k) * B^T (B: n x k) + beta * C; beta 0 ignores C. */
void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
              float beta, float *c, int64_t ldc);
/* C (m x n) += A (m x k) * B (k x n) */
void gemm_ab_acc(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc);
/* C (m x n) = A (m x k) * B (k x n), C not read */
void gemm_ab(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
             int64_t ldc);
/* C (m x n) += A^T B for A (k x m) and B (k x n) */
void gemm_atb_acc(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                  int64_t ldc);

/* ------------------------------------------------------------------ diagonal bands */

/* The key columns [c0, c1) of a tile row that lie in the band of query position pos. */
static inline void band_columns(int64_t pos, int64_t j0, int64_t n, int has_lo, int64_t lo, int has_hi, int64_t hi,
                         int64_t *c0, int64_t *c1) {
    int64_t a = has_lo ? pos + lo - j0 : 0, b = has_hi ? pos + hi + 1 - j0 : n;
    if (a < 0) a = 0;
    if (a > n) a = n;  /* the row's band starts after this tile */
    if (b > n) b = n;
    *c0 = a;
    *c1 = b > a ? b : a;
}

/* The key range [*jlo, *jhi) that the queries [first, last] reach. */
static inline void band_keys(int64_t first, int64_t last, int64_t Nk, int has_lo, int64_t lo, int has_hi, int64_t hi,
                      int64_t *jlo, int64_t *jhi) {
    int64_t a = has_lo ? first + lo : 0, b = has_hi ? last + hi + 1 : Nk;
    *jlo = a < 0 ? 0 : a;
    *jhi = b > Nk ? Nk : b;
}

/* -inf at the pairs of Z (rows x n: query positions first.., keys j0..) outside the band. */
static inline void hide_outside_band(float *z, int64_t rows, int64_t n, int64_t first, int64_t j0, int has_lo, int64_t lo,
                                     int has_hi, int64_t hi) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t c0, c1;
        band_columns(first + r, j0, n, has_lo, lo, has_hi, hi, &c0, &c1);
        float *row = z + r * n;
        for (int64_t c = 0; c < c0; c++) row[c] = -INFINITY;
        for (int64_t c = c1; c < n; c++) row[c] = -INFINITY;
    }
}

/* ------------------------------------------------------------------ rows of exponentials */

/* The largest of n entries (-inf for none). */
static inline float row_max(const float *x, int64_t n) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef AK_AVX2
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
        mx = hmax_avx2(vm);
    }
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

/* x <- exp(x - ref) over n entries, in place; returns their sum. */
static inline float exp_sum(float *x, int64_t n, float ref) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef AK_AVX2
    const __m256 vr = _mm256_set1_ps(ref);
    __m256 vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vr));
        _mm256_storeu_ps(x + i, p);
        vs = _mm256_add_ps(vs, p);
    }
    sum = hsum_avx2(vs);
#endif
    for (; i < n; i++) {
        x[i] = exp_scalar(x[i] - ref);
        sum += x[i];
    }
    return sum;
}

void ak_sigmoid_into(const float *x, float *y, int64_t n, float sign, float bias);
void ak_softcap(const float *x, float *y, int64_t n, float cap);
void ak_online_softmax(float *s, int64_t rows, int64_t cols, float *m, float *l, float *alpha);
void ak_abs_boost(float *s, const float *t, int64_t groups, int64_t rows, int64_t cols);
void ak_topk_row(const float *x, int64_t cols, int64_t k, float *bv, int64_t *bi);
void ak_mix_heads_scaled(const float *mix, const float *x, const float *scale, float *out, int64_t B, int64_t G,
                         int64_t H, int64_t R, int64_t C);
void ak_depthwise_conv2d(const float *x, const float *w, float *y, int64_t N, int64_t H, int64_t R, int64_t C,
                         int64_t cq, int64_t ck);
void ak_depthwise_conv2d_weight_grad(const float *x, const float *dy, float *dw, int64_t N, int64_t H, int64_t R,
                                     int64_t C, int64_t cq, int64_t ck);

/* Whole-call loops (loops_fused.cpp, loops_mixed.cpp, loops_sparse.cpp) and the in-place
 * tile steps (loops_pointwise.cpp); the bindings (fused.cpp ...) document the arguments. */
void ak_sigmoid(float *x, int64_t n, float bias);
int ak_stick_breaking(float *s, int64_t rows, int64_t cols, float *carry);
int ak_stick_breaking_backward(float *s, float *dw, int64_t rows, int64_t cols, float *carry, float *carry_w,
                               const float *delta);
int ak_topk_rows(const float *s, int64_t rows, int64_t cols, int64_t k, float *values, int64_t *columns);

/* The parameters of the whole-call loops, one struct per family instead of 20-38 positional
 * arguments. Shapes: q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), contiguous;
 * keys lie in the band lo <= key - (q_start + query) <= hi (has_lo / has_hi = 0: unbounded). */
struct ak_dims {
    int64_t H, Hkv, Nq, Nk, D, Dv;
};

struct ak_band {
    int64_t q_start;
    int has_lo, has_hi;
    int64_t lo, hi;
};

/* Sigmoid attention (loops_fused.cpp), forward and backward. */
struct ak_sigmoid_call {
    const float *q, *k, *v;
    ak_dims dims;
    ak_band band;
    float scale, bias;
    int64_t BQ, BK;  /* tile rows and keys */
};

/* Softmax attention with head maps (loops_fused.cpp): query head j reads key head kidx[j]
 * of dims.Hkv and value head vidx[j] of Hv. */
struct ak_softmax_call {
    const float *q, *k, *v;
    const int64_t *kidx, *vidx;
    ak_dims dims;
    int64_t Hv;
    ak_band band;
    float scale, softcap;
    const float *boost;  /* (B, H, Nk) coefficients t of s + t |s| (PAI), or NULL */
    int64_t BQ, BK;
};

/* Top-k attention (loops_fused.cpp): its inputs, and the outputs it writes. */
struct ak_topk_call {
    const float *q, *k, *v;
    ak_dims dims;
    ak_band band;
    int64_t width, BQ;
};

struct ak_topk_outputs {
    float *out, *lse;
    int64_t *chosen;
    float *weights, *kept, *visible;
};

/* Softmax attention with a logit transform and head mixing (loops_mixed.cpp): w (H, cq,
 * ck) or pre (H, H) or neither (NULL), post (H, H) or NULL, in groups of ch heads. */
struct ak_mixed_call {
    const float *q, *k, *v, *w, *pre, *post;
    ak_dims dims;
    int64_t cq, ck, ch;
    ak_band band;
    int64_t BQ, BK, chunks;  /* query blocks, key tiles; query chunks per (batch, group) row */
};

/* What the mixed backward reads besides the forward's inputs, and the gradients it adds into. */
struct ak_mixed_grads {
    const float *dout, *lse, *dlse, *wf;  /* wf: w flipped in both taps */
    float *dq, *dk, *dv, *dw, *dpre, *dpost;
};

/* Native Sparse Attention (loops_sparse.cpp): q (B, Hq, Nq, D) the last Nq of Nk positions,
 * the compressed kc (B, Hkv, Ncmp, D) and vc (B, Hkv, Ncmp, Dv), gates (B, Hq, Nq, 3). */
struct ak_nsa_call {
    const float *q, *k, *v, *kc, *vc, *gates;
    int64_t Hq, Hkv, Nq, Nk, Ncmp, D, Dv;
    float scale, above;  /* above: rescale_above of the selection branch */
    int64_t cblock, stride, sblock, width, initial, local;
    int64_t chunk, tile_rows, span_rows, window, window_block;
};

int ak_sigmoid_attention(const ak_sigmoid_call &c, float *out, int64_t bh0, int64_t bh1);
int ak_sigmoid_attention_backward(const ak_sigmoid_call &c, const float *dout, float *dq, float *dk, float *dv,
                                  int64_t bh0, int64_t bh1);
int ak_softmax_attention(const ak_softmax_call &c, float *out, float *lse, int64_t bh0, int64_t bh1);
int ak_topk_attention(const ak_topk_call &c, const ak_topk_outputs &o, int64_t bh0, int64_t bh1);
int ak_mixed_softmax_attention(const ak_mixed_call &c, float *out, float *lse, int64_t u0, int64_t u1);
int ak_mixed_softmax_attention_backward(const ak_mixed_call &c, const ak_mixed_grads &g, int64_t u0, int64_t u1);
int ak_nsa_select(const ak_nsa_call &c, int64_t *chosen, float *out, float *lse_cmp, int64_t u0, int64_t u1);
int ak_nsa_selected(const ak_nsa_call &c, const int64_t *chosen, float *out, float *lse, int64_t u0, int64_t u1);
int ak_nsa_window(const ak_nsa_call &c, float *out, float *lse, int64_t bh0, int64_t bh1);

#endif
