/* The operator around loops_sparse.cpp: Native Sparse Attention's inference forward
 * (Yuan et al. 2025, arXiv 2502.11089), three passes adding their gated branches into one
 * output. Python side: sparse.py. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "binding.h"
#include "common.h"
#include "parallel.h"

namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> nsa_forward(
    const Tensor &q_, const Tensor &k_, const Tensor &v_, const Tensor &k_cmp_, const Tensor &v_cmp_, const Tensor &gates_,
    double scale, int64_t compress_block, int64_t compress_stride, int64_t select_block, int64_t width, int64_t initial,
    int64_t local, int64_t window, double rescale_above, int64_t select_chunk, int64_t tile_rows, int64_t span_rows,
    int64_t window_block) {
    attnkit::check_attention(q_, k_, v_);
    const int64_t B = q_.size(0), Hq = q_.size(1), Nq = q_.size(2), D = q_.size(3), Hkv = k_.size(1), Nk = k_.size(2);
    const int64_t Dv = v_.size(3);
    TORCH_CHECK(Nq <= Nk, "attnkit: q must hold the last of k's positions: q's length ", Nq, " exceeds k's ", Nk);
    attnkit::check_float_shape(k_cmp_, "k_cmp", {B, Hkv, -1, D});
    attnkit::check_float_shape(v_cmp_, "v_cmp", {B, Hkv, k_cmp_.size(2), Dv});
    attnkit::check_float_shape(gates_, "gates", {B, Hq, Nq, 3});
    //: block sizes, chunks and tiles: their buffers are products of two of these
    constexpr int64_t MAX_BLOCK = int64_t(1) << 20;
    attnkit::check_range(compress_stride, "compress_stride", 1, MAX_BLOCK);
    attnkit::check_range(compress_block, "compress_block", 1, MAX_BLOCK);
    attnkit::check_range(select_block, "select_block", 1, MAX_BLOCK);
    TORCH_CHECK(compress_block % compress_stride == 0, "attnkit: compress_block must be a multiple of compress_stride (",
                compress_stride, "), got ", compress_block);
    TORCH_CHECK(select_block % compress_stride == 0, "attnkit: select_block must be a multiple of compress_stride (",
                compress_stride, "), got ", select_block);
    attnkit::check_range(width, "width", 1, MAX_BLOCK);
    attnkit::check_range(initial, "initial", 0, MAX_BLOCK);
    attnkit::check_range(local, "local", 1, MAX_BLOCK);
    // The forced blocks (the first ``initial`` and the last ``local`` up to a query's own)
    // go into its ``width`` slots: at most initial + local of them, and at most every block.
    const int64_t n_blocks = (Nk + select_block - 1) / select_block;
    TORCH_CHECK(std::min(initial + local, n_blocks) <= width, "attnkit: width must hold the forced blocks, min(initial + ",
                "local, blocks) = ", std::min(initial + local, n_blocks), ", got ", width);
    attnkit::check_range(window, "window", 1, MAX_BLOCK);
    attnkit::check_range(select_chunk, "select_chunk", 1, MAX_BLOCK);
    attnkit::check_range(tile_rows, "tile_rows", 1, MAX_BLOCK);
    attnkit::check_range(span_rows, "span_rows", 1, int64_t(1) << 30);
    attnkit::check_range(window_block, "window_block", 1, MAX_BLOCK);
    TORCH_CHECK(!std::isnan(rescale_above), "attnkit: rescale_above must be a number (-inf: rescale at every rise), got ",
                rescale_above);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const Tensor kc = k_cmp_.contiguous(), vc = v_cmp_.contiguous(), g = gates_.contiguous();
    const int64_t Ncmp = kc.size(2);
    const auto f = q.options();
    Tensor out = at::empty({B, Hq, Nq, Dv}, f), chosen = at::empty({B, Hkv, Nq, width}, f.dtype(at::kLong));
    Tensor lse_cmp = at::empty({B, Hq, Nq}, f), lse_slc = at::empty({B, Hq, Nq}, f), lse_win = at::empty({B, Hq, Nq}, f);
    const ak_nsa_call call = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kc.data_ptr<float>(),
                              vc.data_ptr<float>(), g.data_ptr<float>(), Hq, Hkv, Nq, Nk, Ncmp, D, Dv, (float)scale,
                              (float)rescale_above, compress_block, compress_stride, select_block, width, initial, local,
                              select_chunk, tile_rows, span_rows, window, window_block};
    float *op = out.data_ptr<float>();
    int64_t *cp = chosen.data_ptr<int64_t>();
    attnkit::over_units(B * Hkv, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_select(call, cp, op, lse_cmp.data_ptr<float>(), u0, u1);
    });
    attnkit::over_units(B * Hkv, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_selected(call, cp, op, lse_slc.data_ptr<float>(), u0, u1);
    });
    attnkit::over_units(B * Hq, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_window(call, op, lse_win.data_ptr<float>(), u0, u1);
    });
    return {out, chosen, lse_cmp, lse_slc, lse_win};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("nsa_forward(Tensor q, Tensor k, Tensor v, Tensor k_cmp, Tensor v_cmp, Tensor gates, float scale, "
          "int compress_block, int compress_stride, int select_block, int width, int initial, int local, int window, "
          "float rescale_above, int select_chunk, int tile_rows, int span_rows, int window_block) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("nsa_forward", &nsa_forward); }
