/* Operators around the whole-call loops of loops_fused.cpp: sigmoid attention forward and
 * backward (FlashSigmoid, arXiv 2409.04431), a softmax forward with free head sizes, head
 * maps and softcap (FlashAttention-2's loop, arXiv 2307.08691), and the top-k forward
 * (arXiv 2106.06899). Keys lie in a band lo <= key - (q_start + query) <= hi (None:
 * unbounded). Python side: fused.py (fake kernels, autograd, wrappers). */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include "binding.h"
#include "common.h"
#include "parallel.h"

namespace {

using at::Tensor;
using attnkit::Band;


ak_band band_call(int64_t q_start, std::optional<int64_t> lo, std::optional<int64_t> hi) {
    const Band bd = attnkit::band_of(lo, hi);
    return {q_start, bd.has_lo, bd.has_hi, bd.lo, bd.hi};
}

//: (query rows, keys) of a tile: one head's logits stay in L2
constexpr int64_t TILE_Q = 256, TILE_K = 256;
//: query rows per block of the top-k loop: their logits, rows x keys, stay in L2/L3
constexpr int64_t TOPK_BLOCK = 32;

Tensor sigmoid_attention(const Tensor &q_, const Tensor &k_, const Tensor &v_, double scale, double bias, int64_t q_start,
                         std::optional<int64_t> lo, std::optional<int64_t> hi) {
    attnkit::check_attention(q_, k_, v_);
    attnkit::check_band(q_start, lo, hi);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    Tensor out = at::empty({B, H, Nq, Dv}, q.options());
    const ak_sigmoid_call call = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), {H, Hkv, Nq, Nk, D, Dv},
                                  band_call(q_start, lo, hi), (float)scale, (float)bias, TILE_Q, TILE_K};
    float *op = out.data_ptr<float>();
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) { return ak_sigmoid_attention(call, op, u0, u1); });
    return out;
}

std::tuple<Tensor, Tensor, Tensor> sigmoid_attention_backward(const Tensor &grad_out_, const Tensor &q_, const Tensor &k_,
                                                              const Tensor &v_, double scale, double bias, int64_t q_start,
                                                              std::optional<int64_t> lo, std::optional<int64_t> hi) {
    attnkit::check_attention(q_, k_, v_);
    attnkit::check_band(q_start, lo, hi);
    attnkit::check_float_shape(grad_out_, "grad_out", {q_.size(0), q_.size(1), q_.size(2), v_.size(3)});
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), go = grad_out_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const ak_sigmoid_call call = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), {H, Hkv, Nq, Nk, D, Dv},
                                  band_call(q_start, lo, hi), (float)scale, (float)bias, TILE_Q, TILE_K};
    // Parts take whole GQA groups: the query heads of a group add into the same dk, dv.
    attnkit::over_units(B * H, H / Hkv, [&](int64_t u0, int64_t u1) {
        return ak_sigmoid_attention_backward(call, go.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(),
                                             dv.data_ptr<float>(), u0, u1);
    });
    return {dq, dk, dv};
}

/* Head maps: query head j reads key head k_heads[j] and value head v_heads[j] (default:
 * grouped-query attention). */
Tensor head_map(const std::optional<Tensor> &given, int64_t H, int64_t heads, const char *name) {
    if (!given.has_value()) {
        TORCH_CHECK(heads >= 1 && H % heads == 0, "attnkit: without ", name, " the query heads (", H,
                    ") must be a multiple of the heads they read (", heads, ")");
        Tensor map = at::empty({H}, at::TensorOptions().dtype(at::kLong));
        int64_t *p = map.data_ptr<int64_t>();
        for (int64_t j = 0; j < H; j++) p[j] = j / (H / heads);
        return map;
    }
    TORCH_CHECK(given->device().is_cpu() && (given->scalar_type() == at::kLong || given->scalar_type() == at::kInt),
                "attnkit: ", name, " must be an int64 or int32 CPU tensor, got ", given->scalar_type(), " on ",
                given->device());
    const Tensor map = given->to(at::kLong).contiguous();
    TORCH_CHECK(map.dim() == 1 && map.size(0) == H, "attnkit: ", name, " must hold one head per query head (", H,
                "), got shape ", map.sizes());
    const int64_t *p = map.data_ptr<int64_t>();
    for (int64_t j = 0; j < H; j++)
        TORCH_CHECK(p[j] >= 0 && p[j] < heads, "attnkit: ", name, " names head ", p[j], " of ", heads);
    return map;
}

std::tuple<Tensor, Tensor> softmax_attention(const Tensor &q_, const Tensor &k_, const Tensor &v_, double scale,
                                             int64_t q_start, std::optional<int64_t> lo, std::optional<int64_t> hi,
                                             double softcap, const std::optional<Tensor> &k_heads,
                                             const std::optional<Tensor> &v_heads, const std::optional<Tensor> &boost_) {
    // Free head maps: k and v may have any number of heads >= 1 (the maps say which each
    // query head reads), k q's head size, v k's length.
    attnkit::check_float(q_, "q", 4);
    attnkit::check_float(k_, "k", 4);
    attnkit::check_float(v_, "v", 4);
    attnkit::check_shape(k_, "k", {q_.size(0), -1, -1, q_.size(3)});
    attnkit::check_shape(v_, "v", {q_.size(0), -1, k_.size(2), -1});
    attnkit::check_at_least(k_.size(1), "k's heads", 1);
    attnkit::check_at_least(v_.size(1), "v's heads", 1);
    attnkit::check_band(q_start, lo, hi);
    TORCH_CHECK(softcap >= 0.0 && softcap < INFINITY, "attnkit: softcap must be finite and >= 0 (0: none), got ", softcap);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hk = k.size(1), Nk = k.size(2);
    const int64_t Hv = v.size(1), Dv = v.size(3);
    const Tensor kidx = head_map(k_heads, H, Hk, "k_heads"), vidx = head_map(v_heads, H, Hv, "v_heads");
    Tensor boost;
    if (boost_.has_value()) {
        attnkit::check_float_shape(*boost_, "boost", {B, H, Nk});
        boost = boost_->contiguous();
    }
    Tensor out = at::empty({B, H, Nq, Dv}, q.options()), lse = at::empty({B, H, Nq}, q.options());
    const ak_softmax_call call = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kidx.data_ptr<int64_t>(),
                                  vidx.data_ptr<int64_t>(), {H, Hk, Nq, Nk, D, Dv}, Hv, band_call(q_start, lo, hi),
                                  (float)scale, (float)softcap, boost.defined() ? boost.data_ptr<float>() : nullptr,
                                  TILE_Q, TILE_K};
    float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
    attnkit::over_units_sized(B * H, 1, Nq * Nk * (D + Dv),
                              [&](int64_t u0, int64_t u1) { return ak_softmax_attention(call, op, lp, u0, u1); });
    return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> topk_attention(const Tensor &q_, const Tensor &k_,
                                                                          const Tensor &v_, int64_t q_start,
                                                                          std::optional<int64_t> lo,
                                                                          std::optional<int64_t> hi, int64_t width) {
    attnkit::check_attention(q_, k_, v_);
    attnkit::check_band(q_start, lo, hi);
    attnkit::check_range(width, "width", 1, int64_t(1) << 31);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    const auto f = q.options();
    Tensor out = at::empty({B, H, Nq, Dv}, f), lse = at::empty({B, H, Nq}, f);
    Tensor chosen = at::empty({B, H, Nq, width}, f.dtype(at::kLong)), weights = at::empty({B, H, Nq, width}, f);
    Tensor kept = at::empty({B, H, Nq}, f), visible = at::empty({B, H, Nq}, f);
    const ak_topk_call call = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), {H, Hkv, Nq, Nk, D, Dv},
                               band_call(q_start, lo, hi), width, TOPK_BLOCK};
    const ak_topk_outputs outs = {out.data_ptr<float>(), lse.data_ptr<float>(), chosen.data_ptr<int64_t>(),
                                  weights.data_ptr<float>(), kept.data_ptr<float>(), visible.data_ptr<float>()};
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) { return ak_topk_attention(call, outs, u0, u1); });
    return {out, lse, chosen, weights, kept, visible};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("sigmoid_attention(Tensor q, Tensor k, Tensor v, float scale, float bias, int q_start, int? lo, int? hi) -> Tensor");
    m.def("sigmoid_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, float scale, float bias, int q_start, "
          "int? lo, int? hi) -> (Tensor, Tensor, Tensor)");
    m.def("softmax_attention(Tensor q, Tensor k, Tensor v, float scale, int q_start, int? lo, int? hi, float softcap, "
          "Tensor? k_heads, Tensor? v_heads, Tensor? boost=None) -> (Tensor, Tensor)");
    m.def("topk_attention(Tensor q, Tensor k, Tensor v, int q_start, int? lo, int? hi, int width) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("sigmoid_attention", &sigmoid_attention);
    m.impl("sigmoid_attention_backward", &sigmoid_attention_backward);
    m.impl("softmax_attention", &softmax_attention);
    m.impl("topk_attention", &topk_attention);
}
