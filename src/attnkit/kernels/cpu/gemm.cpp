/* The tile products of the loops (declared in common.h) on what libtorch exports to
 * extensions, never a scraped symbol:
 *   - A B (the P V products): oneDNN's brgemm ukernel, at::native::cpublas::brgemm
 *     (exported with TORCH_API), where it runs on this CPU; measured 20-40% faster than
 *     the BLAS sgemm on 256-key tiles (see cpu/__init__.py);
 *   - A B^T and A^T B (logits, gradients): ATen's addmm on views of the buffers, which
 *     lands in the BLAS that torch links (MKL in the x86 wheels) with a few microseconds
 *     of dispatch; brgemm has no transposed operands, and a transposed copy of the key
 *     tile measured slower than that overhead. Products of at most SMALL_PRODUCT
 *     multiply-adds, where that dispatch is most of the cost, are plain loops.
 * ``attnkit::_gemm_mode(1)`` sends every product above SMALL_PRODUCT through ATen (for A/B
 * measurements). */
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "common.h"
#include "parallel.h"

namespace {

std::atomic<int> brgemm_ok{-1};  // -1: not probed yet
std::atomic<int64_t> mode{0};    // 0: brgemm for A B where it runs; 1: ATen for every product

bool brgemm_runs() {
    int state = brgemm_ok.load();
    if (state < 0) {
        float a[2] = {2.0f, 1.0f}, b[2] = {3.0f, 5.0f}, c[1] = {1.0f};
        try {
            at::native::cpublas::brgemm(1, 1, 2, 2, 1, 1, true, a, b, c, false);
            state = c[0] == 12.0f;
        } catch (const std::exception &) {
            state = 0;
        }
        brgemm_ok.store(state);
    }
    return state == 1 && mode.load() == 0;
}

at::Tensor view(const float *p, int64_t rows, int64_t cols, int64_t ld) {
    return at::from_blob(const_cast<float *>(p), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

/* Products up to this many multiply-adds run as plain loops: ATen's dispatch and the
 * views of the buffers cost a few microseconds, more than such a product (the tiles of a
 * short prompt on a small model). */
constexpr int64_t SMALL_PRODUCT = int64_t(1) << 14;

/* c (m x n) = beta c + alpha sum_t a(i, t) b(j, t), with a(i, t) = a[i * sa + t * ta] and
 * b(j, t) = b[j * sb + t * tb]; beta 0 ignores what c held. */
void small_product(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t sa, int64_t ta, const float *b,
                   int64_t sb, int64_t tb, float beta, float *c, int64_t ldc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int64_t t = 0; t < k; t++) sum += a[i * sa + t * ta] * b[j * sb + t * tb];
            float &out = c[i * ldc + j];
            out = (beta == 0.0f ? 0.0f : beta * out) + alpha * sum;
        }
}

}  // namespace

void gemm_abt(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
              float beta, float *c, int64_t ldc) {
    if (m <= 0 || n <= 0) return;
    if (m * n * k <= SMALL_PRODUCT) {
        small_product(m, n, k, alpha, a, lda, 1, b, ldb, 1, beta, c, ldc);
        return;
    }
    at::Tensor out = view(c, m, n, ldc);
    at::addmm_out(out, out, view(a, m, k, lda), view(b, n, k, ldb).t(), beta, alpha);
}

void gemm_ab_acc(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                 int64_t ldc) {
    if (m <= 0 || n <= 0 || k <= 0) return;
    if (brgemm_runs()) {
        at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, true, a, b, c, false);
        return;
    }
    at::Tensor out = view(c, m, n, ldc);
    at::addmm_out(out, out, view(a, m, k, lda), view(b, k, n, ldb));
}

void gemm_ab(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
             int64_t ldc) {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
        for (int64_t i = 0; i < m; i++) std::memset(c + i * ldc, 0, sizeof(float) * n);
        return;
    }
    if (brgemm_runs()) {
        at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, false, a, b, c, false);
        return;
    }
    at::Tensor out = view(c, m, n, ldc);
    at::addmm_out(out, out, view(a, m, k, lda), view(b, k, n, ldb), 0.0f, 1.0f);
}

void gemm_atb_acc(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                  int64_t ldc) {
    if (m <= 0 || n <= 0 || k <= 0) return;
    if (m * n * k <= SMALL_PRODUCT) {  // a (k x m) read transposed, b (k x n)
        small_product(m, n, k, 1.0f, a, 1, lda, b, 1, ldb, 1.0f, c, ldc);
        return;
    }
    at::Tensor out = view(c, m, n, ldc);
    at::addmm_out(out, out, view(a, k, m, lda).t(), view(b, k, n, ldb));
}

int64_t set_gemm_mode(int64_t next) {
    TORCH_CHECK(next >= -1 && next <= 1, "attnkit: mode must be -1 (read only), 0 (brgemm) or 1 (ATen), got ", next);
    const int64_t previous = mode.load();
    if (next >= 0) mode.store(next);
    return previous;
}

/* How many distinct threads ran ``parts`` parts of run_parts (each part spins briefly so
 * that no thread can take them all): 1 means the operators' work splitting is serial,
 * as it was when this library was compiled without -fopenmp. For tests. */
int64_t threads_used(int64_t parts) {
    TORCH_CHECK(parts >= 1 && parts <= 1024, "attnkit: parts must be in [1, 1024], got ", parts);
    std::mutex lock;
    std::set<std::thread::id> seen;
    attnkit::run_parts(parts, [&](int64_t) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
        while (std::chrono::steady_clock::now() < until) {
        }
        std::lock_guard<std::mutex> hold(lock);
        seen.insert(std::this_thread::get_id());
    });
    return (int64_t)seen.size();
}

/* The namespace's one TORCH_LIBRARY block; the other files add fragments. */
TORCH_LIBRARY(attnkit, m) {
    m.def("_gemm_mode(int mode) -> int", &set_gemm_mode);
    m.def("_threads_used(int parts) -> int", &threads_used);
}
