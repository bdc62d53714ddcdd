/* The operator around loops_sparse.cpp: Native Sparse Attention's inference forward
 * (Yuan et al. 2025, arXiv 2502.11089), three passes adding their gated branches into one
 * output. Python side: sparse.py. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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
    attnkit::check_float(k_cmp_, "k_cmp", 4);
    attnkit::check_float(v_cmp_, "v_cmp", 4);
    attnkit::check_float(gates_, "gates", 4);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const Tensor kc = k_cmp_.contiguous(), vc = v_cmp_.contiguous(), g = gates_.contiguous();
    const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2);
    const int64_t Dv = v.size(3), Ncmp = kc.size(2);
    TORCH_CHECK(Nq <= Nk, "attnkit: the queries must be the last of the keys' positions");
    TORCH_CHECK(g.size(0) == B && g.size(1) == Hq && g.size(2) == Nq && g.size(3) == 3, "attnkit: gates must be (",
                B, ", ", Hq, ", ", Nq, ", 3), got ", g.sizes());
    TORCH_CHECK(compress_stride > 0 && select_block % compress_stride == 0 && compress_block % compress_stride == 0,
                "attnkit: the compression stride must divide the compression and selection blocks");
    const auto f = q.options();
    Tensor out = at::empty({B, Hq, Nq, Dv}, f), chosen = at::empty({B, Hkv, Nq, width}, f.dtype(at::kLong));
    Tensor lse_cmp = at::empty({B, Hq, Nq}, f), lse_slc = at::empty({B, Hq, Nq}, f), lse_win = at::empty({B, Hq, Nq}, f);
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *gp = g.data_ptr<float>();
    float *op = out.data_ptr<float>();
    int64_t *cp = chosen.data_ptr<int64_t>();
    attnkit::over_units(B * Hkv, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_select(qp, kc.data_ptr<float>(), vc.data_ptr<float>(), gp, cp, op, lse_cmp.data_ptr<float>(), u0, u1,
                             Hq, Hkv, Nq, Nk, Ncmp, D, Dv, (float)scale, compress_block, compress_stride, select_block,
                             width, initial, local, select_chunk);
    });
    attnkit::over_units(B * Hkv, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_selected(qp, kp, vp, cp, gp, op, lse_slc.data_ptr<float>(), u0, u1, Hq, Hkv, Nq, Nk, D, Dv, width,
                               select_block, (float)scale, (float)rescale_above, tile_rows, span_rows);
    });
    attnkit::over_units(B * Hq, 1, [&](int64_t u0, int64_t u1) {
        return ak_nsa_window(qp, kp, vp, gp, op, lse_win.data_ptr<float>(), u0, u1, Hq, Hkv, Nq, Nk, D, Dv, (float)scale,
                             window, window_block);
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
