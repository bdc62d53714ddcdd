/* Native Sparse Attention loops (Yuan et al. 2025, arXiv 2502.11089), inference forward
 * only, around the tile products of gemm.cpp (bound in sparse.cpp;
 * mechanisms/native_sparse.py describes the branches). Each loop adds
 * its branch, times the branch's gate, into one output (B, Hq, Nq, Dv):
 *   - ak_nsa_select: the scoring pass. Softmax of the queries over the compressed keys
 *     (the compression branch, eq. 7-8, whose output it writes first), block importance
 *     (eq. 9-10) and the choice of each query's blocks (eq. 11).
 *   - ak_nsa_selected: the selection branch. Queries grouped by key block: the rows that
 *     chose a block are gathered and run against its keys as one tile.
 *   - ak_nsa_window: the sliding window, one tile of keys per block of queries.
 * The first two split work by (batch, kv head): a GQA group shares its choice of blocks. */
#include "common.h"

#include <string.h>

static void scale_row(float *x, int64_t n, float by) {
    for (int64_t i = 0; i < n; i++) x[i] *= by;  /* vectorised by the compiler */
}

static void zero_row(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = 0.0f;
}

/* ------------------------------------------------------------------ scoring pass */

/* Compressed blocks complete at token position pos: block i covers tokens
 * [i * stride, i * stride + cblock) and is visible once i * stride + cblock - 1 <= pos. */
static int64_t complete_blocks(int64_t pos, int64_t cblock, int64_t stride) {
    const int64_t last = pos - cblock + 1;
    return last < 0 ? 0 : last / stride + 1;
}

/* One head's compression branch for a chunk of m queries at positions first, first + 1,
 * ...: logits s of the (scaled) query rows qb against the first ``seen`` compressed keys,
 * each row's weights exp(s - max) over the keys complete at its position (0 on the rest),
 * lse and inv = 1 / their sum (0 for a row that sees nothing), and the output p V times
 * each row's gate (gb, a stride-3 column) written to ob (B Hq Nq Dv rows; ``pv`` holds the
 * product first). s keeps the unnormalised weights: the 1 / sum scales the m rows of the
 * output and of what is summed from them, not the m x seen weights. */
static void compressed_chunk(const float *qb, const float *kh, const float *vh, float *s, float *inv,
                             float *pv, const float *gb, float *ob, float *lb, int64_t m, int64_t seen, int64_t first,
                             int64_t cblock, int64_t stride, int64_t D, int64_t Dv) {
    gemm_abt((int)m, (int)seen, (int)D, 1.0f, qb, (int)D, kh, (int)D, 0.0f, s, (int)seen);
    for (int64_t i = 0; i < m; i++) {
        const int64_t complete = complete_blocks(first + i, cblock, stride), vis = complete < seen ? complete : seen;
        float *x = s + i * seen;
        zero_row(x + vis, seen - vis);
        if (vis == 0) {
            inv[i] = 0.0f, lb[i] = -INFINITY;
            continue;
        }
        const float mx = row_max(x, vis), den = exp_sum(x, vis, mx);
        inv[i] = 1.0f / den, lb[i] = mx + logf(den);
    }
    gemm_ab((int)m, (int)Dv, (int)seen, s, (int)seen, vh, (int)Dv, pv, (int)Dv);
    for (int64_t i = 0; i < m; i++) {
        const float w = gb[i * 3] * inv[i];
        for (int64_t d = 0; d < Dv; d++) ob[i * Dv + d] = w * pv[i * Dv + d];  /* vectorised by the compiler */
    }
}

/* The blocks forced on the query whose own block is ``own`` (eq. 11: the first
 * ``initial`` and the last ``local``, own included, as the paper's 1 + 2) are [0, *lo)
 * and [*hi, own]; the blocks [*lo, *hi) between them compete by importance. */
static void forced_blocks(int64_t own, int64_t initial, int64_t local, int64_t *lo, int64_t *hi) {
    *lo = initial < own + 1 ? initial : own + 1;
    *hi = own - local + 1 > *lo ? own - local + 1 : *lo;
}

/* Importance of the selection blocks [lo, hi) from one row of compressed probabilities
 * p (seen columns; summed over a GQA group's heads, eq. 10): with a = select block /
 * stride and c = compress block / stride, block j shares tokens with the compressed
 * blocks j * a + t, 1 - c <= t < a (eq. 9), summed in that order. */
static void block_mass(const float *p, int64_t seen, int64_t lo, int64_t hi, int64_t a, int64_t c, float *imp) {
    for (int64_t j = lo; j < hi; j++) {
        const int64_t t0 = 1 - c > -j * a ? 1 - c : -j * a, t1 = a < seen - j * a ? a : seen - j * a;
        float s = 0.0f;
        for (int64_t t = t0; t < t1; t++) s += p[j * a + t];
        imp[j] = s;
    }
}

/* How many of x[0..n) are >= bar. */
static int64_t count_at_least(const float *x, int64_t n, float bar) {
    int64_t c = 0, i = 0;
#ifdef AK_AVX2
    const __m256 vb = _mm256_set1_ps(bar);
    for (; i + 8 <= n; i += 8) c += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vb, _CMP_GE_OQ)));
#endif
    for (; i < n; i++) c += x[i] >= bar;
    return c;
}

/* Rank of the entry (x, at) among (v, ix)[0..n): how many score higher, or the same from
 * a lower block (a stable descending sort's order, so ranks are distinct). */
static int64_t rank_of(const float *v, const int32_t *ix, int64_t n, float x, int32_t at) {
    int64_t c = 0, k = 0;
#ifdef AK_AVX2
    const __m256 vx = _mm256_set1_ps(x);
    const __m256i va = _mm256_set1_epi32(at);
    for (; k + 8 <= n; k += 8) {
        const __m256 vk = _mm256_loadu_ps(v + k);
        const __m256 lower = _mm256_castsi256_ps(_mm256_cmpgt_epi32(va, _mm256_loadu_si256((const __m256i *)(ix + k))));
        const __m256 above = _mm256_or_ps(_mm256_cmp_ps(vk, vx, _CMP_GT_OQ), _mm256_and_ps(_mm256_cmp_ps(vk, vx, _CMP_EQ_OQ), lower));
        c += __builtin_popcount(_mm256_movemask_ps(above));
    }
#endif
    for (; k < n; k++) c += v[k] > x || (v[k] == x && ix[k] < at);
    return c;
}

static float bits_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static uint32_t float_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* The r highest-scoring of the blocks [lo, hi) into out, unordered; of equal scores the
 * lower block wins (as a stable descending sort ranks them). Scores are sums of
 * probabilities, >= 0, so their bit patterns order like their values: bisecting the bits
 * between the least and the greatest score, with one vectorised count per step, finds a
 * bar that at least r and at most r + TOP_SLACK scores reach (a few steps on ordinary
 * scores; ties may end it with more); only those are ranked against each other. Branchy
 * one-pass insertion measured ~3x slower: its branches follow the data. cv, ci hold
 * hi - lo entries of scratch. Returns how many were written (fewer than r when fewer
 * blocks compete). */
enum { TOP_SLACK = 8 };
static int64_t top_blocks(const float *imp, int64_t lo, int64_t hi, int64_t r, float *cv, int32_t *ci, int64_t *out) {
    const int64_t m = hi - lo;
    const float *x = imp + lo;
    if (m <= r) {
        for (int64_t j = 0; j < m; j++) out[j] = lo + j;
        return m;
    }
    float least = x[0], most = x[0];
    for (int64_t j = 1; j < m; j++) least = x[j] < least ? x[j] : least, most = x[j] > most ? x[j] : most;
    uint32_t bar = float_bits(least), above = float_bits(most) + 1;  /* >= r reach bar, fewer reach above */
    int64_t n = m;
    while (n > r + TOP_SLACK && above - bar > 1) {
        const uint32_t mid = bar + (above - bar) / 2;
        const int64_t c = count_at_least(x, m, bits_float(mid));
        if (c >= r) bar = mid, n = c;
        else above = mid;
    }
    const float b = bits_float(bar);
    n = 0;
    for (int64_t j = 0; j < m; j++) {  /* branch-free: every score is written, the reaching ones kept */
        cv[n] = x[j], ci[n] = (int32_t)(lo + j);
        n += x[j] >= b;
    }
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++)
        if (rank_of(cv, ci, n, cv[i], ci[i]) < r) out[u++] = ci[i];
    return u;
}

/* The ``width`` blocks of the query whose own block is ``own`` (eq. 11): the forced ones,
 * then the top-scoring of the rest by importance ``imp`` (valid on [lo, hi) of
 * forced_blocks); -1 in the slots left over. cv, ci: scratch for top_blocks. */
static void choose_row(const float *imp, int64_t own, int64_t lo, int64_t hi, int64_t width, float *cv, int32_t *ci,
                       int64_t *out) {
    int64_t u = 0;
    for (int64_t j = 0; j < lo; j++) out[u++] = j;
    for (int64_t j = hi; j <= own; j++) out[u++] = j;
    u += top_blocks(imp, lo, hi, width - u, cv, ci, out + u);
    for (; u < width; u++) out[u] = -1;
}

/* The scoring pass of NSA for the (batch, kv head) units [u0, u1) of B * Hkv. Queries
 * (B, Hq, Nq, D) are the last Nq of Nk positions; the compressed keys kc (B, Hkv, Ncmp, D)
 * and values vc (B, Hkv, Ncmp, Dv) summarise blocks of ``cblock`` tokens every ``stride``.
 * In chunks of ``chunk`` queries and per head of the group: one product of the chunk against
 * the compressed keys complete by its last position, the causal softmax of each row
 * (lse_cmp, B Hq Nq), one product of p with the compressed values: the compression branch,
 * times the gates' first column (gates B Hq Nq 3), written to out (B Hq Nq Dv), and p
 * summed over the group's heads. From that sum, per query, the importance of the
 * selection blocks of ``sblock`` tokens that compete for its slots, and its ``width``
 * chosen blocks (chosen, B Hkv Nq width). Returns 1 when out of memory. */
int ak_nsa_select(const ak_nsa_call &call, int64_t *chosen, float *out, float *lse_cmp, int64_t u0, int64_t u1) {
    const float *q = call.q, *kc = call.kc, *vc = call.vc, *gates = call.gates;
    const int64_t Hq = call.Hq, Hkv = call.Hkv, Nq = call.Nq, Nk = call.Nk, Ncmp = call.Ncmp, D = call.D, Dv = call.Dv;
    const int64_t cblock = call.cblock, stride = call.stride, sblock = call.sblock, width = call.width;
    const int64_t initial = call.initial, local = call.local, chunk = call.chunk;
    const float scale = call.scale;
    const int64_t G = Hq / Hkv, q_start = Nk - Nq, a = sblock / stride, c = cblock / stride;
    const int64_t n_blocks = (Nk + sblock - 1) / sblock, span = Ncmp > 0 ? Ncmp : 1;
    const auto s_buf = ak_buffer<float>(chunk * span), qb_buf = ak_buffer<float>(chunk * D);
    const auto pv_buf = ak_buffer<float>(chunk * Dv), inv_buf = ak_buffer<float>(chunk);
    const auto psum_buf = ak_buffer<float>(G > 1 ? chunk * span : 1);
    const auto imp_buf = ak_buffer<float>(n_blocks), cv_buf = ak_buffer<float>(n_blocks);
    const auto ci_buf = ak_buffer<int32_t>(n_blocks);
    float *s = s_buf.get(), *qb = qb_buf.get(), *pv = pv_buf.get(), *inv = inv_buf.get();
    float *psum = G > 1 ? psum_buf.get() : s;  /* one head: its weights are the sum */
    float *imp = imp_buf.get(), *cv = cv_buf.get();
    int32_t *ci = ci_buf.get();
    if (!s || !qb || !pv || !psum || !inv || !imp || !cv || !ci) return 1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / Hkv, kvh = u % Hkv;
        const float *kh = kc + u * Ncmp * D, *vh = vc + u * Ncmp * Dv;
        for (int64_t r0 = 0; r0 < Nq; r0 += chunk) {
            const int64_t m = Nq - r0 < chunk ? Nq - r0 : chunk, first = q_start + r0;
            const int64_t complete = complete_blocks(first + m - 1, cblock, stride);
            const int64_t seen = complete < Ncmp ? complete : Ncmp;
            if (G > 1) zero_row(psum, m * seen);
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = b * Hq + kvh * G + g;
                float *ob = out + (h * Nq + r0) * Dv, *lb = lse_cmp + h * Nq + r0;
                if (seen == 0) {  /* no compressed block is complete yet: p = 0 */
                    zero_row(ob, m * Dv);
                    for (int64_t i = 0; i < m; i++) lb[i] = -INFINITY;
                    continue;
                }
                const float *qh = q + (h * Nq + r0) * D;
                for (int64_t i = 0; i < m * D; i++) qb[i] = qh[i] * scale;  /* scaled as the PyTorch path does */
                compressed_chunk(qb, kh, vh, s, inv, pv, gates + (h * Nq + r0) * 3, ob, lb, m, seen, first, cblock,
                                 stride, D, Dv);
                if (G > 1)
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < seen; j++) psum[i * seen + j] += s[i * seen + j] * inv[i];
            }
            for (int64_t i = 0; i < m; i++) {
                const int64_t own = (first + i) / sblock;
                int64_t lo, hi;
                forced_blocks(own, initial, local, &lo, &hi);
                if (seen) block_mass(psum + i * seen, seen, lo, hi, a, c, imp);
                else zero_row(imp + lo, hi - lo);
                if (G == 1) scale_row(imp + lo, hi - lo, inv[i]);  /* the weights were not normalised */
                choose_row(imp, own, lo, hi, width, cv, ci, chosen + (u * Nq + r0 + i) * width);
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ selected blocks */

/* Per-row state of the selection branch for a span of queries [t0, t0 + len) of one
 * (batch, kv head): row (g, t) is query t under head g of the group; its output
 * accumulates unnormalised in acc, its weights are exp(logit - ref) and their sum is den. */
typedef struct {
    float *acc, *ref, *den;
    int64_t t0, len, Dv;
} rows_state;

static int64_t state_row(const rows_state *st, int64_t g, int64_t t) { return g * st->len + t - st->t0; }

static float *acc_row(const rows_state *st, int64_t g, int64_t t) { return st->acc + state_row(st, g, t) * st->Dv; }

/* The queries of the position blocks [jb0, jb1) (the span) against their own block of
 * ``block`` keys, causally: the first term of each row, whose max becomes its reference
 * (so den >= 1). qh, kh, vh: the group's first query head and its key and value heads. */
static void own_blocks(const float *qh, const float *kh, const float *vh, rows_state *st, float *s,
                       int64_t jb0, int64_t jb1, int64_t G, int64_t Nq, int64_t Nk, int64_t D, int64_t block,
                       float scale) {
    const int64_t q_start = Nk - Nq, Dv = st->Dv;
    for (int64_t jb = jb0; jb < jb1; jb++) {
        const int64_t k0 = jb * block, nk = Nk - k0 < block ? Nk - k0 : block;
        const int64_t t0 = (k0 > q_start ? k0 : q_start) - q_start, m = k0 + nk - q_start - t0;
        for (int64_t g = 0; g < G; g++) {
            gemm_abt((int)m, (int)nk, (int)D, scale, qh + (g * Nq + t0) * D, (int)D, kh + k0 * D, (int)D, 0.0f, s,
                     (int)nk);
            for (int64_t i = 0; i < m; i++) {
                const int64_t row = state_row(st, g, t0 + i), vis = q_start + t0 + i - k0 + 1;  /* keys k0 .. its position */
                float *x = s + i * nk;
                st->ref[row] = row_max(x, vis);
                st->den[row] = exp_sum(x, vis, st->ref[row]);
                zero_row(x + vis, nk - vis);
            }
            gemm_ab((int)m, (int)Dv, (int)nk, s, (int)nk, vh + k0 * Dv, (int)Dv, acc_row(st, g, t0), (int)Dv);
        }
    }
}

/* The queries [t0, t1) that chose each key block, own blocks and empty slots left out: a
 * counting sort of their (query, slot) pairs by block, queries ascending within a block.
 * start has n_blocks + 1 entries; the queries of block j are list[start[j] .. start[j + 1]). */
static void group_by_block(const int64_t *sel, int64_t t0, int64_t t1, int64_t width, int64_t q_start, int64_t block,
                           int64_t n_blocks, int64_t *start, int32_t *list) {
    for (int64_t j = 0; j <= n_blocks; j++) start[j] = 0;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t u = 0; u < width; u++) {
            const int64_t j = sel[t * width + u];
            if (j >= 0 && j != (q_start + t) / block) start[j + 1]++;
        }
    for (int64_t j = 0; j < n_blocks; j++) start[j + 1] += start[j];
    for (int64_t t = t0; t < t1; t++)
        for (int64_t u = 0; u < width; u++) {
            const int64_t j = sel[t * width + u];
            if (j >= 0 && j != (q_start + t) / block) list[start[j]++] = (int32_t)t;
        }
    for (int64_t j = n_blocks; j > 0; j--) start[j] = start[j - 1];  /* the fill moved each start to the next */
    start[0] = 0;
}

/* One tile of the selection branch: the m queries ``ts`` (with the G heads of the group,
 * rows i * G + g) against one whole key block (all its keys precede them). Gathers their
 * query rows (scaled: product's alpha would be a pass of its own), one product for the
 * logits, each row's weights exp(s - ref) with its reference raised first (and its sums
 * rescaled) only if the block's max exceeds it by more than ``above``, one product with the
 * block's values, and the rows added into their accumulators. */
static void selected_tile(const float *qh, const float *kb, const float *vb, rows_state *st,
                          const int32_t *ts, int64_t m, int64_t G, int64_t Nq, int64_t D, int64_t block, float scale,
                          float above, float *qb, float *s, float *ob) {
    const int64_t Dv = st->Dv, rows = m * G;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < G; g++) {
            const float *src = qh + (g * Nq + ts[i]) * D;
            float *dst = qb + (i * G + g) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
        }
    gemm_abt((int)rows, (int)block, (int)D, 1.0f, qb, (int)D, kb, (int)D, 0.0f, s, (int)block);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = state_row(st, r % G, ts[r / G]);
        float *x = s + r * block;
        const float mx = row_max(x, block), ref = st->ref[row];
        if (mx > ref && mx - ref > above) {  /* rare: keeps exp(s - ref) <= e^above, far from overflow */
            const float alpha = expf(ref - mx);
            scale_row(st->acc + row * Dv, Dv, alpha);
            st->den[row] *= alpha;
            st->ref[row] = mx;
        }
        st->den[row] += exp_sum(x, block, st->ref[row]);
    }
    gemm_ab((int)rows, (int)Dv, (int)block, s, (int)block, vb, (int)Dv, ob, (int)Dv);
    for (int64_t r = 0; r < rows; r++) {
        float *o = acc_row(st, r % G, ts[r / G]);
        const float *p = ob + r * Dv;
        for (int64_t d = 0; d < Dv; d++) o[d] += p[d];  /* vectorised by the compiler */
    }
}

/* out <- out + gate * branch for the rows of a span: each row's acc / den, weighted by
 * its gate (gates (B, Hq, Nq, 3), column ``branch``), and its lse. h0: the group's first
 * query head among B * Hq. */
static void add_span(const rows_state *st, const float *gates, int64_t branch, float *out, float *lse, int64_t h0,
                     int64_t G, int64_t Nq) {
    const int64_t Dv = st->Dv;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < st->len; i++) {
            const int64_t row = g * st->len + i, at = (h0 + g) * Nq + st->t0 + i;
            const float w = gates[at * 3 + branch] / st->den[row];
            const float *a = st->acc + row * Dv;
            float *o = out + at * Dv;
            for (int64_t d = 0; d < Dv; d++) o[d] += w * a[d];  /* vectorised by the compiler */
            lse[at] = st->ref[row] + logf(st->den[row]);
        }
}

/* The selection branch of NSA for the (batch, kv head) units [u0, u1) of B * Hkv, added
 * into out (B, Hq, Nq, Dv) times the gates' second column: every query attends to the
 * keys of its ``width`` chosen blocks of ``block`` tokens (chosen, B Hkv Nq width, -1 for
 * an empty slot; its own block always among them, causally). q (B, Hq, Nq, D) are the
 * last Nq of the Nk positions of k (B, Hkv, Nk, D) and v (B, Hkv, Nk, Dv). Queries go in
 * spans of whole position blocks, about ``span_rows`` (query, head) rows each, whose
 * accumulators stay in cache while every key block that a query of the span chose runs
 * once against them (the own blocks first), ``tile_rows`` rows per tile. All of a row's
 * terms share one reference (first its own block's max), so partial results add without
 * a running max (see selected_tile). Writes lse (B, Hq, Nq). Returns 1 when out of
 * memory. */
int ak_nsa_selected(const ak_nsa_call &call, const int64_t *chosen, float *out, float *lse, int64_t u0, int64_t u1) {
    const float *q = call.q, *k = call.k, *v = call.v, *gates = call.gates;
    const int64_t Hq = call.Hq, Hkv = call.Hkv, Nq = call.Nq, Nk = call.Nk, D = call.D, Dv = call.Dv;
    const int64_t width = call.width, block = call.sblock, tile_rows = call.tile_rows, span_rows = call.span_rows;
    const float scale = call.scale, above = call.above;
    const int64_t G = Hq / Hkv, q_start = Nk - Nq, n_blocks = (Nk + block - 1) / block;
    const int64_t per_tile = tile_rows / G > 0 ? tile_rows / G : 1, rows = per_tile * G;
    const int64_t span = span_rows / (G * block) > 0 ? span_rows / (G * block) : 1;  /* position blocks per span */
    const int64_t s_rows = rows > block ? rows : block, span_len = span * block;
    const auto s_buf = ak_buffer<float>(s_rows * block), qb_buf = ak_buffer<float>(rows * D);
    const auto ob_buf = ak_buffer<float>(rows * Dv), acc_buf = ak_buffer<float>(G * span_len * Dv);
    const auto ref_buf = ak_buffer<float>(G * span_len), den_buf = ak_buffer<float>(G * span_len);
    const auto start_buf = ak_buffer<int64_t>(n_blocks + 1);
    const auto list_buf = ak_buffer<int32_t>(span_len * width);
    float *s = s_buf.get(), *qb = qb_buf.get(), *ob = ob_buf.get(), *acc = acc_buf.get();
    float *ref = ref_buf.get(), *den = den_buf.get();
    int64_t *start = start_buf.get();
    int32_t *list = list_buf.get();
    if (!s || !qb || !ob || !acc || !ref || !den || !start || !list) return 1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / Hkv, kvh = u % Hkv, h0 = b * Hq + kvh * G;
        const float *qh = q + h0 * Nq * D, *kh = k + u * Nk * D, *vh = v + u * Nk * Dv;
        for (int64_t jb0 = q_start / block; jb0 < n_blocks; jb0 += span) {
            const int64_t jb1 = jb0 + span < n_blocks ? jb0 + span : n_blocks;
            const int64_t t0 = (jb0 * block > q_start ? jb0 * block : q_start) - q_start;
            const int64_t t1 = (jb1 * block < Nk ? jb1 * block : Nk) - q_start;
            rows_state st = {acc, ref, den, t0, t1 - t0, Dv};
            own_blocks(qh, kh, vh, &st, s, jb0, jb1, G, Nq, Nk, D, block, scale);
            group_by_block(chosen + u * Nq * width, t0, t1, width, q_start, block, n_blocks, start, list);
            for (int64_t j = 0; j < n_blocks; j++)
                for (int64_t e = start[j]; e < start[j + 1]; e += per_tile) {
                    const int64_t m = start[j + 1] - e < per_tile ? start[j + 1] - e : per_tile;
                    selected_tile(qh, kh + j * block * D, vh + j * block * Dv, &st, list + e, m, G, Nq, D, block,
                                  scale, above, qb, s, ob);
                }
            add_span(&st, gates, 1, out, lse, h0, G, Nq);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ sliding window */

/* The sliding-window branch of NSA for the query-head rows [bh0, bh1) of B * H, added
 * into out (B, H, Nq, Dv) times the gates' third column: every query (the last Nq of Nk
 * positions) against its ``window`` most recent keys, itself included. Per block of BQ
 * queries one product against the window - 1 + BQ keys that the block reaches (one tile:
 * no running max), each row's weights over its own band (0 elsewhere), one product with the
 * values, and the rows normalised into out. Writes lse (B, H, Nq). Returns 1 when out of
 * memory. */
int ak_nsa_window(const ak_nsa_call &call, float *out, float *lse, int64_t bh0, int64_t bh1) {
    const float *q = call.q, *k = call.k, *v = call.v, *gates = call.gates;
    const int64_t H = call.Hq, Hkv = call.Hkv, Nq = call.Nq, Nk = call.Nk, D = call.D, Dv = call.Dv;
    const int64_t window = call.window, BQ = call.window_block;
    const float scale = call.scale;
    const int64_t q_start = Nk - Nq, G = H / Hkv, span = window - 1 + BQ;
    const auto s_buf = ak_buffer<float>(BQ * span), ob_buf = ak_buffer<float>(BQ * Dv), inv_buf = ak_buffer<float>(BQ);
    float *s = s_buf.get(), *ob = ob_buf.get(), *inv = inv_buf.get();
    if (!s || !ob || !inv) return 1;
    for (int64_t bh = bh0; bh < bh1; bh++) {
        const int64_t kvh = (bh / H) * Hkv + (bh % H) / G;
        const float *kh = k + kvh * Nk * D, *vh = v + kvh * Nk * Dv;
        for (int64_t i0 = 0; i0 < Nq; i0 += BQ) {
            const int64_t m = Nq - i0 < BQ ? Nq - i0 : BQ, first = q_start + i0;
            const int64_t j0 = first - window + 1 > 0 ? first - window + 1 : 0, n = first + m - j0;
            gemm_abt((int)m, (int)n, (int)D, scale, q + (bh * Nq + i0) * D, (int)D, kh + j0 * D, (int)D, 0.0f, s,
                     (int)n);
            for (int64_t i = 0; i < m; i++) {
                const int64_t pos = first + i, c0 = (pos - window + 1 > j0 ? pos - window + 1 : j0) - j0, c1 = pos + 1 - j0;
                float *x = s + i * n;
                const float mx = row_max(x + c0, c1 - c0), den = exp_sum(x + c0, c1 - c0, mx);
                zero_row(x, c0);
                zero_row(x + c1, n - c1);
                lse[bh * Nq + i0 + i] = mx + logf(den);
                inv[i] = 1.0f / den;
            }
            gemm_ab((int)m, (int)Dv, (int)n, s, (int)n, vh + j0 * Dv, (int)Dv, ob, (int)Dv);
            for (int64_t i = 0; i < m; i++) {
                const float w = gates[(bh * Nq + i0 + i) * 3 + 2] * inv[i];
                float *o = out + (bh * Nq + i0 + i) * Dv;
                for (int64_t d = 0; d < Dv; d++) o[d] += w * ob[i * Dv + d];  /* vectorised by the compiler */
            }
        }
    }
    return 0;
}
