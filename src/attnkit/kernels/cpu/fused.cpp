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

//: (query rows, keys) of a tile: one head's logits stay in L2
constexpr int64_t TILE_Q = 256, TILE_K = 256;
//: query rows per block of the top-k loop: their logits, rows x keys, stay in L2/L3
constexpr int64_t TOPK_BLOCK = 32;

Tensor sigmoid_attention(const Tensor &q_, const Tensor &k_, const Tensor &v_, double scale, double bias, int64_t q_start,
                         std::optional<int64_t> lo, std::optional<int64_t> hi) {
    attnkit::check_attention(q_, k_, v_);
    TORCH_CHECK(k_.size(1) == v_.size(1), "attnkit: k and v must have the same heads");
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    Tensor out = at::empty({B, H, Nq, Dv}, q.options());
    const Band bd = attnkit::band_of(lo, hi);
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    float *op = out.data_ptr<float>();
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        return ak_sigmoid_attention(qp, kp, vp, op, u0, u1, H, Hkv, Nq, Nk, D, Dv, (float)scale, (float)bias, q_start,
                                    bd.has_lo, bd.lo, bd.has_hi, bd.hi, TILE_Q, TILE_K);
    });
    return out;
}

std::tuple<Tensor, Tensor, Tensor> sigmoid_attention_backward(const Tensor &grad_out_, const Tensor &q_, const Tensor &k_,
                                                              const Tensor &v_, double scale, double bias, int64_t q_start,
                                                              std::optional<int64_t> lo, std::optional<int64_t> hi) {
    attnkit::check_attention(q_, k_, v_);
    attnkit::check_float(grad_out_, "grad_out", 4);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), go = grad_out_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    TORCH_CHECK(go.sizes() == at::IntArrayRef({B, H, Nq, Dv}), "attnkit: grad_out must have the output's shape");
    Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const Band bd = attnkit::band_of(lo, hi);
    // Parts take whole GQA groups: the query heads of a group add into the same dk, dv.
    attnkit::over_units(B * H, H / Hkv, [&](int64_t u0, int64_t u1) {
        return ak_sigmoid_attention_backward(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                             go.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(),
                                             dv.data_ptr<float>(), u0, u1, H, Hkv, Nq, Nk, D, Dv, (float)scale, (float)bias,
                                             q_start, bd.has_lo, bd.lo, bd.has_hi, bd.hi, TILE_Q, TILE_K);
    });
    return {dq, dk, dv};
}

/* Head maps: query head j reads key head k_heads[j] and value head v_heads[j] (default:
 * grouped-query attention). */
Tensor head_map(const std::optional<Tensor> &given, int64_t H, int64_t heads, const char *name) {
    if (!given.has_value()) {
        Tensor map = at::empty({H}, at::TensorOptions().dtype(at::kLong));
        int64_t *p = map.data_ptr<int64_t>();
        for (int64_t j = 0; j < H; j++) p[j] = j / (H / heads);
        return map;
    }
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
                                             const std::optional<Tensor> &v_heads) {
    attnkit::check_float(q_, "q", 4);
    attnkit::check_float(k_, "k", 4);
    attnkit::check_float(v_, "v", 4);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hk = k.size(1), Nk = k.size(2);
    const int64_t Hv = v.size(1), Dv = v.size(3);
    TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(2) == Nk,
                "attnkit: softmax_attention got mismatched shapes ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
    const Tensor kidx = head_map(k_heads, H, Hk, "k_heads"), vidx = head_map(v_heads, H, Hv, "v_heads");
    Tensor out = at::empty({B, H, Nq, Dv}, q.options()), lse = at::empty({B, H, Nq}, q.options());
    const Band bd = attnkit::band_of(lo, hi);
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        return ak_softmax_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                                    lse.data_ptr<float>(), u0, u1, H, Hk, Hv, kidx.data_ptr<int64_t>(),
                                    vidx.data_ptr<int64_t>(), Nq, Nk, D, Dv, (float)scale, (float)softcap, q_start,
                                    bd.has_lo, bd.lo, bd.has_hi, bd.hi, TILE_Q, TILE_K);
    });
    return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> topk_attention(const Tensor &q_, const Tensor &k_,
                                                                          const Tensor &v_, int64_t q_start,
                                                                          std::optional<int64_t> lo,
                                                                          std::optional<int64_t> hi, int64_t width) {
    attnkit::check_attention(q_, k_, v_);
    TORCH_CHECK(width >= 1, "attnkit: width must be at least 1, got ", width);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2), Dv = v.size(3);
    const auto f = q.options();
    Tensor out = at::empty({B, H, Nq, Dv}, f), lse = at::empty({B, H, Nq}, f);
    Tensor chosen = at::empty({B, H, Nq, width}, f.dtype(at::kLong)), weights = at::empty({B, H, Nq, width}, f);
    Tensor kept = at::empty({B, H, Nq}, f), visible = at::empty({B, H, Nq}, f);
    const Band bd = attnkit::band_of(lo, hi);
    attnkit::over_units(B * H, 1, [&](int64_t u0, int64_t u1) {
        return ak_topk_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                                 lse.data_ptr<float>(), chosen.data_ptr<int64_t>(), weights.data_ptr<float>(),
                                 kept.data_ptr<float>(), visible.data_ptr<float>(), u0, u1, H, Hkv, Nq, Nk, D, Dv, q_start,
                                 bd.has_lo, bd.lo, bd.has_hi, bd.hi, width, TOPK_BLOCK);
    });
    return {out, lse, chosen, weights, kept, visible};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("sigmoid_attention(Tensor q, Tensor k, Tensor v, float scale, float bias, int q_start, int? lo, int? hi) -> Tensor");
    m.def("sigmoid_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, float scale, float bias, int q_start, "
          "int? lo, int? hi) -> (Tensor, Tensor, Tensor)");
    m.def("softmax_attention(Tensor q, Tensor k, Tensor v, float scale, int q_start, int? lo, int? hi, float softcap, "
          "Tensor? k_heads, Tensor? v_heads) -> (Tensor, Tensor)");
    m.def("topk_attention(Tensor q, Tensor k, Tensor v, int q_start, int? lo, int? hi, int width) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("sigmoid_attention", &sigmoid_attention);
    m.impl("sigmoid_attention_backward", &sigmoid_attention_backward);
    m.impl("softmax_attention", &softmax_attention);
    m.impl("topk_attention", &topk_attention);
}
