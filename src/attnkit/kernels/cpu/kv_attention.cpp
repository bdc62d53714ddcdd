/* One-token and prefill attention for the KV-cache policies (attnkit/kv/), reading the
 * cache where it lies and returning what a policy reads beside the output, and a few
 * observed query rows with their logits and weights (a meter's decoding step):
 *
 * - a decoding step with its softmax weights (H2O, TOVA score every decoded token; steps
 *   whose heads hold different counts hide their empty slots here instead of a mask);
 * - a step over heads stored packed (AdaKV, ``kv/packed.PackedKV``): each slot names its
 *   row, no padded copy of the layer per step;
 * - Quest's step (arXiv 2406.10774): pages chosen by their key bounds and attended in the
 *   same pass, the new key folded into its page's extremes;
 * - a causal prefill with the weight each key receives summed over every query (H2O's
 *   score, arXiv 2306.14048), from the pass that makes the output.
 *
 * float32 (the vectorised exp of common.h, the tile products of gemm.cpp) and float64
 * (plain loops, for tests in double precision). Python side: kv.py. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <limits>
#include <tuple>
#include <vector>

#include "common.h"
#include "parallel.h"

namespace {

using at::Tensor;

/* ------------------------------------------------------------------ one-token attention over chosen rows */

inline float dot(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    float s = 0.0f;
#ifdef AK_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    s = hsum_avx2(acc);
#endif
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

inline double dot(const double *a, const double *b, int64_t n) {
    int64_t d = 0;
    double s = 0.0;
#ifdef AK_AVX2
    __m256d acc = _mm256_setzero_pd();
    for (; d + 4 <= n; d += 4) acc = _mm256_fmadd_pd(_mm256_loadu_pd(a + d), _mm256_loadu_pd(b + d), acc);
    const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
    s = _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
#endif
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* The largest of n entries, and x <- exp(x - ref) returning the sum (float: the
 * vectorised code of common.h). */
inline double largest(const double *x, int64_t n) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
    return m;
}
inline float largest(const float *x, int64_t n) { return row_max(x, n); }

inline double exp_shifted(double *x, int64_t n, double ref) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += (x[j] = std::exp(x[j] - ref));
    return sum;
}
inline float exp_shifted(float *x, int64_t n, float ref) { return exp_sum(x, n, ref); }

/* x <- exp(x - max x), returns the sum. */
template <typename T>
inline T exp_rows(T *x, int64_t n) {
    return exp_shifted(x, n, largest(x, n));
}

/* Where ``attend`` writes what a caller reads beside the output, each when given: the
 * weights and the logits (g rows of n, ``stride`` apart), the log-normaliser (g). */
template <typename T>
struct Extras {
    T *probs = nullptr;
    T *logits = nullptr;
    T *lse = nullptr;
    int64_t stride = 0;
};

/* softmax_j(q_i . k_j * scale) v_j for g query rows (q: g rows of D, ``q_stride`` apart)
 * over n entries whose key and value rows ``key(j)`` and ``value(j)`` point to; out: g
 * rows of Dv, ``out_stride`` apart. The logits and the accumulators live in ``buf``;
 * ``extras`` receives the weights, logits and log-normalisers it points to. Returns
 * whether every logit and every output is finite. */
template <typename T, class KeyRow, class ValueRow>
bool attend(const T *q, int64_t q_stride, int64_t g, int64_t D, int64_t Dv, double scale, int64_t n, const KeyRow &key,
            const ValueRow &value, T *out, int64_t out_stride, std::vector<T> &buf, const Extras<T> &extras = {}) {
    if (n == 0) {  // nothing visible (every slot hidden): zeros, as a fully masked row of the kernels gets
        for (int64_t i = 0; i < g; ++i) std::fill(out + i * out_stride, out + i * out_stride + Dv, T(0));
        if (extras.lse) std::fill(extras.lse, extras.lse + g, -std::numeric_limits<T>::infinity());
        return true;
    }
    buf.assign(g * D + g * n + g * Dv, T(0));
    T *qs = buf.data(), *logits = qs + g * D, *acc = logits + g * n;
    for (int64_t i = 0; i < g; ++i)
        for (int64_t d = 0; d < D; ++d) qs[i * D + d] = q[i * q_stride + d] * (T)scale;  // as q * scaling, then q k^T
    for (int64_t j = 0; j < n; ++j) {
        const T *k = key(j);
        for (int64_t i = 0; i < g; ++i) logits[i * n + j] = dot(qs + i * D, k, D);
    }
    bool finite = true;
    for (int64_t t = 0; t < g * n; ++t) finite &= std::isfinite(logits[t]);
    if (extras.logits)
        for (int64_t i = 0; i < g; ++i) std::copy(logits + i * n, logits + (i + 1) * n, extras.logits + i * extras.stride);
    std::vector<T> sums(g);
    for (int64_t i = 0; i < g; ++i) {
        const T top = largest(logits + i * n, n);
        sums[i] = exp_shifted(logits + i * n, n, top);
        if (extras.lse) extras.lse[i] = top + std::log(sums[i]);
    }
    for (int64_t j = 0; j < n; ++j) {
        const T *v = value(j);
        for (int64_t i = 0; i < g; ++i) {
            const T p = logits[i * n + j];
            T *a = acc + i * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] += p * v[d];
        }
    }
    for (int64_t i = 0; i < g; ++i)
        for (int64_t d = 0; d < Dv; ++d) finite &= std::isfinite(out[i * out_stride + d] = acc[i * Dv + d] / sums[i]);
    if (extras.probs)  // the softmax weights themselves, for a policy or a meter that reads them
        for (int64_t i = 0; i < g; ++i)
            for (int64_t j = 0; j < n; ++j) extras.probs[i * extras.stride + j] = logits[i * n + j] / sums[i];
    return finite;
}

/* Every tensor of a call on the CPU (the schema does not say so; a tensor elsewhere would
 * be read through a host pointer). */
void check_cpu(std::initializer_list<std::pair<const Tensor *, const char *>> tensors) {
    for (const auto &[t, name] : tensors)
        TORCH_CHECK(t->device().is_cpu(), "attnkit: ", name, " must be on the CPU, got ", t->device());
}

void check_query(const Tensor &q, const Tensor &k, const char *k_name) {
    TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
                "attnkit: query must be a float32 or float64 CPU tensor, got ", q.scalar_type());
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "attnkit: query must be (B, Hq, 1, D) (one token), got ", q.sizes());
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), "attnkit: ", k_name, " must have the query's dtype, got ",
                k.scalar_type(), " and ", q.scalar_type());
}

/* keys and values (B, Hkv, L, D|Dv) on the CPU in q's dtype, with a unit last stride, Hkv
 * dividing q's heads and D q's head size (q (B, Hq, Nq, D) checked before). */
void check_keys_values(const Tensor &q, const Tensor &keys, const Tensor &values) {
    check_cpu({{&keys, "keys"}, {&values, "values"}});
    TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
                "attnkit: keys and values must have the query's dtype");
    const int64_t B = q.size(0);
    TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(0) == B && values.size(0) == B && keys.size(1) > 0 &&
                    values.size(1) == keys.size(1) && q.size(1) % keys.size(1) == 0 && keys.size(3) == q.size(3) &&
                    values.size(2) == keys.size(2) && keys.stride(3) == 1 && values.stride(3) == 1,
                "attnkit: keys and values must be (", B, ", Hkv, L, D) with a unit last stride, got ", keys.sizes(),
                " and ", values.sizes());
}

template <typename T>
std::tuple<Tensor, Tensor> step_attention_impl(const Tensor &q_, const Tensor &keys, const Tensor &values,
                                               const std::optional<Tensor> &hide, double scale) {
    const Tensor q = q_.contiguous();
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), H = keys.size(1), L = keys.size(2);
    const int64_t Dv = values.size(3), g = Hq / H;
    Tensor out = at::empty({B, 1, Hq, Dv}, q.options()), weights = at::empty({B, Hq, L}, q.options());
    const T *qp = q.data_ptr<T>(), *kp = keys.data_ptr<T>(), *vp = values.data_ptr<T>();
    T *op = out.data_ptr<T>(), *wp = weights.data_ptr<T>();
    const bool *hp = hide ? hide->data_ptr<bool>() : nullptr;
    attnkit::over_units_sized(B * H, 1, g * L * (D + Dv), [&](int64_t u0, int64_t u1) {
        std::vector<T> buf, probs;
        std::vector<int64_t> rows;
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / H, h = u % H;
            const T *kh = kp + b * keys.stride(0) + h * keys.stride(1), *vh = vp + b * values.stride(0) + h * values.stride(1);
            const int64_t ks = keys.stride(2), vs = values.stride(2);
            T *w = wp + (b * Hq + h * g) * L;
            if (!hp) {  // every slot: the weights go straight into their rows
                attend<T>(qp + (b * Hq + h * g) * D, D, g, D, Dv, scale, L, [&](int64_t j) { return kh + j * ks; },
                          [&](int64_t j) { return vh + j * vs; }, op + (b * Hq + h * g) * Dv, Dv, buf,
                          {w, nullptr, nullptr, L});
                continue;
            }
            const bool *hidden = hp + b * hide->stride(0) + h * hide->stride(1);
            rows.clear();
            for (int64_t j = 0; j < L; ++j)
                if (!hidden[j]) rows.push_back(j);
            const int64_t n = (int64_t)rows.size();
            probs.resize(g * n);
            attend<T>(qp + (b * Hq + h * g) * D, D, g, D, Dv, scale, n, [&](int64_t j) { return kh + rows[j] * ks; },
                      [&](int64_t j) { return vh + rows[j] * vs; }, op + (b * Hq + h * g) * Dv, Dv, buf,
                      {probs.data(), nullptr, nullptr, n});
            for (int64_t i = 0; i < g; ++i) {
                std::fill(w + i * L, w + (i + 1) * L, T(0));
                for (int64_t j = 0; j < n; ++j) w[i * L + rows[j]] = probs[i * n + j];
            }
        }
        return 0;
    });
    return {out, weights};
}

/* softmax(q k^T * scale | not hidden) v for one query per head (B, Hq, 1, D) over keys and
 * values (B, Hkv, L, D|Dv) (any strides, unit last), GQA without repeating heads;
 * ``hide`` (B, Hkv, L) bool: slots no query sees. Returns (out (B, 1, Hq, Dv), the
 * weights (B, Hq, L), 0 on hidden slots). */
std::tuple<Tensor, Tensor> kv_step_attention(const Tensor &q, const Tensor &keys, const Tensor &values,
                                             const std::optional<Tensor> &hide, double scale) {
    check_query(q, keys, "keys");
    check_keys_values(q, keys, values);
    if (hide) check_cpu({{&*hide, "hide"}});
    const int64_t B = q.size(0);
    if (hide)
        TORCH_CHECK(hide->scalar_type() == at::kBool && hide->dim() == 3 && hide->size(0) == B &&
                        hide->size(1) == keys.size(1) && hide->size(2) == keys.size(2) &&
                        (keys.size(2) <= 1 || hide->stride(2) == 1),
                    "attnkit: hide must be (B, Hkv, L) bool, got ", hide->sizes());
    if (q.scalar_type() == at::kFloat) return step_attention_impl<float>(q, keys, values, hide, scale);
    return step_attention_impl<double>(q, keys, values, hide, scale);
}

/* ------------------------------------------------------------------ a few query rows with their logits and weights */

template <typename T>
std::tuple<Tensor, Tensor, Tensor, Tensor, bool> rows_attention_impl(const Tensor &q_, const Tensor &keys,
                                                                      const Tensor &values, double scale) {
    const Tensor q = q_.contiguous();
    const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3), H = keys.size(1), L = keys.size(2);
    const int64_t Dv = values.size(3), g = Hq / H, rows = g * Nq;  // a KV head's query heads, their rows one block
    Tensor out = at::empty({B, Hq, Nq, Dv}, q.options()), logits = at::empty({B, Hq, Nq, L}, q.options());
    Tensor weights = at::empty({B, Hq, Nq, L}, q.options()), lse = at::empty({B, Hq, Nq}, q.options());
    const T *qp = q.data_ptr<T>(), *kp = keys.data_ptr<T>(), *vp = values.data_ptr<T>();
    T *op = out.data_ptr<T>(), *sp = logits.data_ptr<T>(), *wp = weights.data_ptr<T>(), *lp = lse.data_ptr<T>();
    std::vector<char> finite(B * H, 1);
    attnkit::over_units_sized(B * H, 1, rows * L * (D + Dv), [&](int64_t u0, int64_t u1) {
        std::vector<T> buf;
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / H, h = u % H, first = (b * Hq + h * g) * Nq;
            const T *kh = kp + b * keys.stride(0) + h * keys.stride(1), *vh = vp + b * values.stride(0) + h * values.stride(1);
            const int64_t ks = keys.stride(2), vs = values.stride(2);
            finite[u] = attend<T>(qp + first * D, D, rows, D, Dv, scale, L, [&](int64_t j) { return kh + j * ks; },
                                  [&](int64_t j) { return vh + j * vs; }, op + first * Dv, Dv, buf,
                                  {wp + first * L, sp + first * L, lp + first, L});
        }
        return 0;
    });
    return {out, logits, weights, lse, std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; })};
}

/* softmax(q k^T * scale) v for a few query rows per head that see every key (an observed
 * decoding step: attnkit/kernels/dense_rows.py), q (B, Hq, Nq, D), keys and values
 * (B, Hkv, L, D|Dv) (any strides, unit last), GQA without repeating heads. Returns (out
 * (B, Hq, Nq, Dv), the logits q k^T * scale and the weights (B, Hq, Nq, L), the
 * log-normalisers (B, Hq, Nq), whether every logit and every output is finite). */
std::tuple<Tensor, Tensor, Tensor, Tensor, bool> rows_attention(const Tensor &q, const Tensor &keys, const Tensor &values,
                                                                 double scale) {
    TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble) && q.dim() == 4,
                "attnkit: query must be a (B, Hq, Nq, D) float32 or float64 CPU tensor, got ", q.scalar_type(), " ",
                q.sizes());
    check_keys_values(q, keys, values);
    if (q.scalar_type() == at::kFloat) return rows_attention_impl<float>(q, keys, values, scale);
    return rows_attention_impl<double>(q, keys, values, scale);
}

/* ------------------------------------------------------------------ a prefill's attention with the mass each key receives */

/* S (m x n) = alpha A B^T, P V: the tile products of gemm.cpp for float32, plain loops for
 * float64 (tests in double precision). */
inline void product_abt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b,
                        int64_t ldb, float *c, int64_t ldc) {
    gemm_abt(m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}
inline void product_abt(int64_t m, int64_t n, int64_t k, double alpha, const double *a, int64_t lda, const double *b,
                        int64_t ldb, double *c, int64_t ldc) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = alpha * dot(a + i * lda, b + j * ldb, k);
}
inline void product_ab(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                       float *c, int64_t ldc) {
    // oneDNN's brgemm in slices of at most 2048 along k (at 8192 keys: 270 instead of 330 ms
    // for the whole prefill call, against SDPA's 255)
    const int64_t step = 2048;
    gemm_ab(m, n, std::min(step, k), a, lda, b, ldb, c, ldc);
    for (int64_t t = step; t < k; t += step) gemm_ab_acc(m, n, std::min(step, k - t), a + t, lda, b + t * ldb, ldb, c, ldc);
}
inline void product_ab(int64_t m, int64_t n, int64_t k, const double *a, int64_t lda, const double *b, int64_t ldb,
                       double *c, int64_t ldc) {
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0;
        for (int64_t t = 0; t < k; ++t)
            for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += a[i * lda + t] * b[t * ldb + j];
    }
}

template <typename T>
std::tuple<Tensor, Tensor> prefill_attention_impl(const Tensor &q_, const Tensor &k_, const Tensor &v_, double scale,
                                                  const Tensor &start_) {
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), start = start_.contiguous();
    const int64_t *first_real = start.data_ptr<int64_t>();
    const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), D = q.size(3), H = k.size(1), Dv = v.size(3);
    const int64_t g = Hq / H;
    // positions per block: the block's logits over every key it sees, for the g heads, stay in
    // one buffer of g * BQ * N (4 MB for 4 heads at 8192 keys; BQ 8 past 32k keys)
    const int64_t BQ = std::max<int64_t>(8, std::min<int64_t>(64, (int64_t(1) << 20) / std::max<int64_t>(N, 1)));
    Tensor out = at::empty({B, N, Hq, Dv}, q.options());
    Tensor mass = at::zeros({B, Hq, N}, q.options().dtype(at::kDouble));
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    T *op = out.data_ptr<T>();
    double *mp = mass.data_ptr<double>();
    // a KV head's g query heads together: block rows are (head i, position i0 + r) at i * rows + r,
    // so that one product reads the block's keys once for the whole group
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        std::vector<T> s(g * BQ * N), colsum(N), inv(g * BQ), qb(g * BQ * D), ob(g * BQ * Dv);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / H, h = u % H, s0 = first_real[b];  // keys before s0 are left padding
            const T *kh = kp + u * N * D, *vh = vp + u * N * Dv;
            for (int64_t i0 = 0; i0 < N; i0 += BQ) {
                const int64_t rows = std::min(BQ, N - i0), n = i0 + rows, m = g * rows;  // causal: keys up to the block's last query
                for (int64_t i = 0; i < g; ++i)
                    std::copy(qp + ((b * Hq + h * g + i) * N + i0) * D, qp + ((b * Hq + h * g + i) * N + i0 + rows) * D,
                              qb.data() + i * rows * D);
                product_abt(m, n, D, (T)scale, qb.data(), D, kh, D, s.data(), n);
                for (int64_t i = 0; i < g; ++i) {
                    std::fill(colsum.begin(), colsum.begin() + n, T(0));
                    for (int64_t r = 0; r < rows; ++r) {
                        T *row = s.data() + (i * rows + r) * n;
                        const int64_t at = i0 + r, seen = at + 1;
                        if (at < s0) {  // a padding query sees itself alone (its output is unused) and gives no mass
                            std::fill(row, row + n, T(0));
                            row[at] = T(1);
                            inv[i * rows + r] = T(1);
                            continue;
                        }
                        std::fill(row, row + s0, T(0));  // the padding before the row's first real token
                        const T w = inv[i * rows + r] = T(1) / exp_rows(row + s0, seen - s0);  // weights: row * w
                        for (int64_t j = s0; j < seen; ++j) colsum[j] += row[j] * w;
                        std::fill(row + seen, row + n, T(0));  // the keys after the query
                    }
                    double *mh = mp + (b * Hq + h * g + i) * N;
                    for (int64_t j = 0; j < n; ++j) mh[j] += (double)colsum[j];
                }
                product_ab(m, Dv, n, s.data(), n, vh, Dv, ob.data(), Dv);
                for (int64_t i = 0; i < g; ++i)
                    for (int64_t r = 0; r < rows; ++r) {
                        T *o = op + ((b * N + i0 + r) * Hq + h * g + i) * Dv;
                        const T *x = ob.data() + (i * rows + r) * Dv;
                        const T w = inv[i * rows + r];
                        for (int64_t d = 0; d < Dv; ++d) o[d] = x[d] * w;
                    }
            }
        }
        return 0;
    });
    return {out, mass};
}

/* Causal softmax attention over a fresh sequence, q (B, Hq, N, D), k (B, Hkv, N, D), v (B,
 * Hkv, N, Dv), and beside it the weight each key receives summed over every query, the
 * score H2O (arXiv 2306.14048) accumulates: one pass that keeps a block of queries'
 * normalised weights for the value product and the column sums, instead of a second
 * pass over the logits after the model's attention. Rows may be left-padded: row b's
 * first real token is at ``start[b]``; its real queries see the real keys up to
 * themselves, a padding query sees itself alone and gives no mass. Returns (out (B, N,
 * Hq, Dv), transformers' layout; mass (B, Hq, N) float64). */
std::tuple<Tensor, Tensor> kv_prefill_attention(const Tensor &q, const Tensor &k, const Tensor &v, double scale,
                                                const Tensor &start) {
    TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble) &&
                    k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "attnkit: q, k and v must be float32 or float64 CPU tensors of one dtype, got ", q.scalar_type(), ", ",
                k.scalar_type(), ", ", v.scalar_type());
    check_cpu({{&k, "k"}, {&v, "v"}, {&start, "start"}});
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) > 0 &&
                    v.size(1) == k.size(1) && q.size(1) % k.size(1) == 0 && k.size(2) == q.size(2) &&
                    v.size(2) == q.size(2) && k.size(3) == q.size(3),
                "attnkit: prefill attention takes q (B, Hq, N, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv), got ", q.sizes(),
                ", ", k.sizes(), ", ", v.sizes());
    TORCH_CHECK(start.scalar_type() == at::kLong && start.dim() == 1 && start.size(0) == q.size(0),
                "attnkit: start must be (B,) int64, got ", start.sizes(), " ", start.scalar_type());
    const Tensor st = start.contiguous();
    for (int64_t b = 0; b < st.numel(); ++b)
        TORCH_CHECK(st.data_ptr<int64_t>()[b] >= 0 && st.data_ptr<int64_t>()[b] <= q.size(2), "attnkit: start[", b,
                    "] must lie in [0, ", q.size(2), "]");
    if (q.scalar_type() == at::kFloat) return prefill_attention_impl<float>(q, k, v, scale, st);
    return prefill_attention_impl<double>(q, k, v, scale, st);
}

template <typename T>
Tensor packed_attention_impl(const Tensor &q_, const Tensor &k_rows, const Tensor &v_rows, const Tensor &source,
                             int64_t empty_row, double scale) {
    const Tensor q = q_.contiguous();
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), H = source.size(1), L = source.size(2);
    const int64_t Dv = v_rows.size(1), g = Hq / H;
    Tensor out = at::empty({B, 1, Hq, Dv}, q.options());
    const T *qp = q.data_ptr<T>(), *kp = k_rows.data_ptr<T>(), *vp = v_rows.data_ptr<T>();
    const int64_t ks = k_rows.stride(0), vs = v_rows.stride(0);
    T *op = out.data_ptr<T>();
    const int32_t *sp = source.data_ptr<int32_t>();
    const int64_t sb = source.stride(0), sh = source.stride(1);
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        std::vector<T> buf;
        std::vector<int64_t> rows;
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / H, h = u % H;
            const int32_t *src = sp + b * sb + h * sh;
            rows.clear();
            for (int64_t j = 0; j < L; ++j)
                if (src[j] != empty_row) rows.push_back(src[j]);
            attend<T>(qp + (b * Hq + h * g) * D, D, g, D, Dv, scale, (int64_t)rows.size(),
                      [&](int64_t j) { return kp + rows[j] * ks; }, [&](int64_t j) { return vp + rows[j] * vs; },
                      op + (b * Hq + h * g) * Dv, Dv, buf);
        }
        return 0;
    });
    return out;
}

/* One query per head (B, Hq, 1, D) over heads stored packed: ``k_rows`` (T, D) and
 * ``v_rows`` (T, Dv) hold the entries, ``source`` (B, Hkv, L) int32 the row each slot
 * reads, ``empty_row`` for an empty slot (skipped). Returns (B, 1, Hq, Dv), the layout
 * transformers' attention functions return. */
Tensor kv_packed_attention(const Tensor &q, const Tensor &k_rows, const Tensor &v_rows, const Tensor &source,
                           int64_t empty_row, double scale) {
    check_query(q, k_rows, "k_rows");
    check_cpu({{&k_rows, "k_rows"}, {&v_rows, "v_rows"}, {&source, "source"}});
    TORCH_CHECK(v_rows.scalar_type() == q.scalar_type(), "attnkit: v_rows must have the query's dtype");
    TORCH_CHECK(k_rows.dim() == 2 && v_rows.dim() == 2 && k_rows.size(1) == q.size(3) && k_rows.stride(1) == 1 &&
                    v_rows.stride(1) == 1 && v_rows.size(0) == k_rows.size(0),
                "attnkit: k_rows must be (T, ", q.size(3), ") and v_rows (T, Dv), rows contiguous, got ", k_rows.sizes(),
                " and ", v_rows.sizes());
    TORCH_CHECK(source.scalar_type() == at::kInt && source.dim() == 3 && source.size(0) == q.size(0) &&
                    source.size(1) > 0 && q.size(1) % source.size(1) == 0 && (source.size(2) <= 1 || source.stride(2) == 1),
                "attnkit: source must be (B, Hkv, L) int32 with Hq a multiple of Hkv, got ", source.sizes(), " ",
                source.scalar_type());
    const Tensor src = source.contiguous();
    const int64_t T = k_rows.size(0);
    const int32_t *sp = src.data_ptr<int32_t>();
    for (int64_t i = 0; i < src.numel(); ++i)
        TORCH_CHECK(sp[i] >= 0 && sp[i] < T, "attnkit: source holds row ", sp[i], ", outside the ", T, " rows");
    if (q.scalar_type() == at::kFloat) return packed_attention_impl<float>(q, k_rows, v_rows, src, empty_row, scale);
    return packed_attention_impl<double>(q, k_rows, v_rows, src, empty_row, scale);
}

/* Quest's choice for one query head (or a KV head's group, ``bound`` then the highest of
 * its heads'): the incomplete last page when there is one, then the highest bounds, ties
 * to the earlier page, ``budget`` pages in all, among the pages holding a key. */
void choose_pages(const double *bound, const bool *has, int64_t P, int64_t budget, bool incomplete, bool *chosen,
                  std::vector<int64_t> &order) {
    std::fill(chosen, chosen + P, false);
    int64_t left = budget;
    if (incomplete && P > 0 && has[P - 1]) {
        chosen[P - 1] = true;
        --left;
    }
    order.clear();
    for (int64_t p = 0; p < P; ++p)
        if (has[p] && !chosen[p]) order.push_back(p);
    if (left <= 0) return;
    if ((int64_t)order.size() > left) {
        auto before = [&](int64_t a, int64_t b) { return bound[a] > bound[b] || (bound[a] == bound[b] && a < b); };
        std::nth_element(order.begin(), order.begin() + (left - 1), order.end(), before);
        order.resize(left);
    }
    for (int64_t p : order) chosen[p] = true;
}

template <typename T>
std::tuple<Tensor, Tensor> quest_attention_impl(const Tensor &q_, const Tensor &keys, const Tensor &values,
                                                const Tensor &kmin, const Tensor &kmax, const Tensor &has,
                                                const Tensor &budget_, int64_t page_size, int64_t cached, bool per_group,
                                                double scale, bool fold) {
    const Tensor q = q_.contiguous(), budget = budget_.contiguous();
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), H = keys.size(1), Dv = values.size(3);
    const int64_t g = Hq / H, L = cached, P = (L + page_size - 1) / page_size, Hs = per_group ? H : Hq;
    Tensor out = at::empty({B, 1, Hq, Dv}, q.options());
    Tensor chosen = at::empty({B, Hs, P}, q.options().dtype(at::kBool));
    const T *qp = q.data_ptr<T>(), *kp = keys.data_ptr<T>(), *vp = values.data_ptr<T>();
    T *op = out.data_ptr<T>();
    bool *cp = chosen.data_ptr<bool>();
    const double *lo = kmin.data_ptr<double>(), *hi = kmax.data_ptr<double>();
    const bool *hp = has.data_ptr<bool>();
    const int64_t *bp = budget.data_ptr<int64_t>();
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        std::vector<T> buf;
        std::vector<double> bound(g * P), q_pos(g * D), q_neg(g * D);
        std::vector<int64_t> order, rows;
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t b = u / H, h = u % H;
            const double *mn = lo + b * kmin.stride(0) + h * kmin.stride(1), *mx = hi + b * kmax.stride(0) + h * kmax.stride(1);
            const bool *hs = hp + b * has.stride(0) + h * has.stride(1);
            // Quest's bound of q . k over a page, sum_d max(q_d min_d, q_d max_d), as q+ . max + q- . min
            // (q+, q- the positive and negative parts of q); an empty page's is unused
            for (int64_t i = 0; i < g; ++i)
                for (int64_t d = 0; d < D; ++d) {
                    const double x = (double)qp[(b * Hq + h * g + i) * D + d];
                    q_pos[i * D + d] = x > 0 ? x : 0.0;
                    q_neg[i * D + d] = x < 0 ? x : 0.0;
                }
            for (int64_t p = 0; p < P; ++p) {
                const double *pmx = mx + p * kmax.stride(2), *pmn = mn + p * kmin.stride(2);
                for (int64_t i = 0; i < g; ++i)
                    bound[i * P + p] = hs[p] ? dot(q_pos.data() + i * D, pmx, D) + dot(q_neg.data() + i * D, pmn, D) : 0.0;
            }
            if (per_group)
                for (int64_t i = 1; i < g; ++i)
                    for (int64_t p = 0; p < P; ++p) bound[p] = std::max(bound[p], bound[i * P + p]);
            const int64_t pages = (bp[b] + page_size - 1) / page_size;
            const T *kh = kp + b * keys.stride(0) + h * keys.stride(1), *vh = vp + b * values.stride(0) + h * values.stride(1);
            const int64_t ks = keys.stride(2), vs = values.stride(2);
            for (int64_t i = 0; i < (per_group ? 1 : g); ++i) {
                bool *pick = cp + (b * Hs + (per_group ? h : h * g + i)) * P;
                choose_pages(bound.data() + i * P, hs, P, pages, L % page_size != 0, pick, order);
                rows.clear();  // the chosen pages' slots, then the new token's (slot L)
                for (int64_t p = 0; p < P; ++p)
                    if (pick[p])
                        for (int64_t j = p * page_size; j < std::min(L, (p + 1) * page_size); ++j) rows.push_back(j);
                rows.push_back(L);
                const int64_t heads = per_group ? g : 1, first = h * g + (per_group ? 0 : i);
                attend<T>(qp + (b * Hq + first) * D, D, heads, D, Dv, scale, (int64_t)rows.size(),
                          [&](int64_t j) { return kh + rows[j] * ks; }, [&](int64_t j) { return vh + rows[j] * vs; },
                          op + (b * Hq + first) * Dv, Dv, buf);
            }
            if (fold) {  // the new token's key joins its page's extremes (a new page when L is a page boundary)
                const int64_t p = L / page_size;
                double *pmn = (double *)mn + p * kmin.stride(2), *pmx = (double *)mx + p * kmax.stride(2);
                const T *k = kh + L * ks;
                for (int64_t d = 0; d < D; ++d) {
                    const double x = (double)k[d];
                    pmn[d] = L % page_size == 0 ? x : std::min(pmn[d], x);
                    pmx[d] = L % page_size == 0 ? x : std::max(pmx[d], x);
                }
                ((bool *)hs)[p] = true;
            }
        }
        return 0;
    });
    return {out, chosen};
}

/* Quest's decoding step (arXiv 2406.10774) for one query per head (B, Hq, 1, D), in one
 * pass: each query head (``per_group``: each KV head, by the highest bound among its
 * query heads) ranks the pages of the ``cached`` slots before the new token by their
 * bound from ``kmin``/``kmax`` (B, Hkv, >= P, D) float64 and ``has`` (B, Hkv, >= P),
 * chooses ceil(budget[b] / page_size) of them (the incomplete last page first), and
 * attends to their slots and to the new token (slot ``cached``) of ``keys``/``values``
 * (B, Hkv, >= cached + 1, D|Dv), every slot a kept entry. ``fold``: then add the new
 * key to its page's extremes, in place (they then cover cached + 1 slots). Returns (out
 * (B, 1, Hq, Dv), the chosen pages (B, Hq or Hkv, P) bool). */
std::tuple<Tensor, Tensor> kv_quest_attention(const Tensor &q, const Tensor &keys, const Tensor &values,
                                              const Tensor &kmin, const Tensor &kmax, const Tensor &has,
                                              const Tensor &budget, int64_t page_size, int64_t cached, bool per_group,
                                              double scale, bool fold) {
    check_query(q, keys, "keys");
    check_cpu({{&keys, "keys"}, {&values, "values"}, {&kmin, "kmin"}, {&kmax, "kmax"}, {&has, "has"}, {&budget, "budget"}});
    TORCH_CHECK(values.scalar_type() == q.scalar_type(), "attnkit: values must have the query's dtype");
    TORCH_CHECK(page_size > 0 && cached >= 0, "attnkit: page_size must be positive and cached >= 0");
    const int64_t B = q.size(0), H = keys.size(1), P = (cached + page_size - 1) / page_size;
    TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(0) == B && values.size(0) == B && H > 0 &&
                    values.size(1) == H && q.size(1) % H == 0 && keys.size(3) == q.size(3) && keys.size(2) > cached &&
                    values.size(2) > cached && keys.stride(3) == 1 && values.stride(3) == 1,
                "attnkit: keys and values must be (", B, ", Hkv, > ", cached, ", D) with a unit last stride, got ",
                keys.sizes(), " and ", values.sizes());
    for (const Tensor *t : {&kmin, &kmax})
        TORCH_CHECK(t->scalar_type() == at::kDouble && t->dim() == 4 && t->size(0) == B && t->size(1) == H &&
                        t->size(2) >= P && t->size(3) == q.size(3) && t->stride(3) == 1,
                    "attnkit: kmin and kmax must be (", B, ", ", H, ", >= ", P, ", ", q.size(3), ") float64, got ",
                    t->sizes(), " ", t->scalar_type());
    TORCH_CHECK(has.scalar_type() == at::kBool && has.dim() == 3 && has.size(0) == B && has.size(1) == H &&
                    has.size(2) >= P && (has.size(2) <= 1 || has.stride(2) == 1),
                "attnkit: has must be (", B, ", ", H, ", >= ", P, ") bool, got ", has.sizes());
    TORCH_CHECK(budget.scalar_type() == at::kLong && budget.numel() == B, "attnkit: budget must be (B,) int64");
    TORCH_CHECK(!fold || (kmin.size(2) > cached / page_size && has.size(2) > cached / page_size),
                "attnkit: folding the new key needs room for page ", cached / page_size, " in kmin, kmax and has");
    if (q.scalar_type() == at::kFloat)
        return quest_attention_impl<float>(q, keys, values, kmin, kmax, has, budget, page_size, cached, per_group, scale, fold);
    return quest_attention_impl<double>(q, keys, values, kmin, kmax, has, budget, page_size, cached, per_group, scale, fold);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("kv_step_attention(Tensor q, Tensor keys, Tensor values, Tensor? hide, float scale) -> (Tensor, Tensor)");
    m.def("rows_attention(Tensor q, Tensor keys, Tensor values, float scale) -> (Tensor, Tensor, Tensor, Tensor, bool)");
    m.def("kv_prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor start) -> (Tensor, Tensor)");
    m.def("kv_packed_attention(Tensor q, Tensor k_rows, Tensor v_rows, Tensor source, int empty_row, float scale) -> Tensor");
    m.def("kv_quest_attention(Tensor q, Tensor keys, Tensor values, Tensor(a!) kmin, Tensor(b!) kmax, Tensor(c!) has, "
          "Tensor budget, int page_size, int cached, bool per_group, float scale, bool fold) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("kv_step_attention", &kv_step_attention);
    m.impl("rows_attention", &rows_attention);
    m.impl("kv_prefill_attention", &kv_prefill_attention);
    m.impl("kv_packed_attention", &kv_packed_attention);
    m.impl("kv_quest_attention", &kv_quest_attention);
}
