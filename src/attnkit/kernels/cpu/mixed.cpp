/* Operators around loops_mixed.cpp: softmax attention with a transform of the logits (a
 * depthwise key-query convolution, multi-token attention, arXiv 2504.00927, or a head
 * mixing before the softmax, talking heads, arXiv 2003.02436) and head mixing after it,
 * forward and backward, for keys in a band. Python side: mixed.py. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "binding.h"
#include "common.h"
#include "parallel.h"

namespace {

using at::Tensor;
using attnkit::Band;

/* Query chunks per (batch, group) row, so that a call with fewer rows than torch has
 * threads (talking heads mixes all heads: one row per batch) still uses every thread. */
int64_t chunk_count(int64_t rows, int64_t nq, int64_t block) {
    const int64_t threads = at::get_num_threads();
    if (rows >= threads) return 1;
    return std::max<int64_t>(1, std::min((nq + block - 1) / block, (threads + rows - 1) / rows));
}

struct Shape {
    int64_t B, H, Hkv, Nq, Nk, D, Dv, cq, ck;
};

Shape shape_of(const Tensor &q, const Tensor &k, const Tensor &v, const std::optional<Tensor> &conv,
               const std::optional<Tensor> &pre, const std::optional<Tensor> &post, int64_t group) {
    attnkit::check_attention(q, k, v);
    TORCH_CHECK(k.size(1) == v.size(1), "attnkit: k and v must have the same heads");
    const int64_t H = q.size(1);
    TORCH_CHECK(group >= 1 && H % group == 0, "attnkit: group must divide the heads (", H, "), got ", group);
    TORCH_CHECK(!(conv.has_value() && pre.has_value()), "attnkit: conv and pre are exclusive");
    if (conv.has_value()) {
        attnkit::check_float(*conv, "conv", 3);
        TORCH_CHECK(conv->size(0) == H, "attnkit: conv must be (heads, cq, ck), got ", conv->sizes());
    }
    for (const auto *m : {&pre, &post})
        if (m->has_value()) {
            attnkit::check_float(**m, "head mixing", 2);
            TORCH_CHECK((*m)->size(0) == H && (*m)->size(1) == H, "attnkit: a head mixing must be (heads, heads), got ",
                        (*m)->sizes());
        }
    const int64_t cq = conv.has_value() ? conv->size(1) : 1, ck = conv.has_value() ? conv->size(2) : 1;
    return {q.size(0), H, k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), cq, ck};
}

const float *ptr(const std::optional<Tensor> &t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

std::optional<Tensor> dense(const std::optional<Tensor> &t) {
    return t.has_value() ? std::optional<Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<Tensor, Tensor> mixed_softmax_attention(const Tensor &q_, const Tensor &k_, const Tensor &v_,
                                                   const std::optional<Tensor> &conv_, const std::optional<Tensor> &pre_,
                                                   const std::optional<Tensor> &post_, int64_t group, int64_t q_start,
                                                   std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq,
                                                   int64_t bk) {
    const Shape s = shape_of(q_, k_, v_, conv_, pre_, post_, group);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const auto conv = dense(conv_), pre = dense(pre_), post = dense(post_);
    Tensor out = at::empty({s.B, s.H, s.Nq, s.Dv}, q.options()), lse = at::empty({s.B, s.H, s.Nq}, q.options());
    TORCH_CHECK(bq > 0 && bk > 0, "attnkit: blocks must be positive");
    const int64_t chunks = chunk_count(s.B * s.H / group, s.Nq, bq);  // each writes its own rows of out and lse
    const Band bd = attnkit::band_of(lo, hi);
    attnkit::over_units(s.B * s.H / group * chunks, 1, [&](int64_t u0, int64_t u1) {
        return ak_mixed_softmax_attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ptr(conv), ptr(pre),
                                          ptr(post), out.data_ptr<float>(), lse.data_ptr<float>(), u0, u1, chunks, s.H, s.Hkv,
                                          s.Nq, s.Nk, s.D, s.Dv, s.cq, s.ck, group, q_start, bd.has_lo, bd.lo, bd.has_hi,
                                          bd.hi, bq, bk);
    });
    return {out, lse};
}

/* (dq of the scaled q, dk, dv, dconv (H, cq, ck), dpre and dpost per group
 * (H / group, group, group)); an absent transform's gradient is an empty tensor. */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mixed_softmax_attention_backward(
    const Tensor &grad_out_, const Tensor &q_, const Tensor &k_, const Tensor &v_, const Tensor &lse_,
    const std::optional<Tensor> &grad_lse_, const std::optional<Tensor> &conv_, const std::optional<Tensor> &pre_, const std::optional<Tensor> &post_, int64_t group,
    int64_t q_start, std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq, int64_t bk) {
    const Shape s = shape_of(q_, k_, v_, conv_, pre_, post_, group);
    attnkit::check_float(grad_out_, "grad_out", 4);
    attnkit::check_float(lse_, "lse", 3);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), go = grad_out_.contiguous();
    const Tensor lse = lse_.contiguous();
    const auto grad_lse = dense(grad_lse_);
    if (grad_lse.has_value())
        TORCH_CHECK(grad_lse->sizes() == lse.sizes() && grad_lse->scalar_type() == at::kFloat,
                    "attnkit: grad_lse must be float32 with lse's shape ", lse.sizes());
    const auto conv = dense(conv_), pre = dense(pre_), post = dense(post_);
    const std::optional<Tensor> flipped = conv.has_value() ? std::optional<Tensor>(conv->flip({-1, -2}).contiguous())
                                                           : std::nullopt;
    TORCH_CHECK(bq > 0 && bk > 0, "attnkit: blocks must be positive");
    const int64_t chunks = chunk_count(s.B * s.H / group, s.Nq, bq), total = s.B * s.H / group * chunks;
    // Parts may share key heads (GQA) and, in chunks, groups: each adds into gradients of
    // its own, summed after.
    const int64_t parts = attnkit::part_count(total, 1);
    const auto f = q.options();
    std::vector<std::vector<Tensor>> grads(parts);
    for (auto &g : grads)
        g = {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v), at::zeros({s.B, s.H, s.cq, s.ck}, f),
             at::zeros({s.B, s.H / group, group, group}, f), at::zeros({s.B, s.H / group, group, group}, f)};
    const Band bd = attnkit::band_of(lo, hi);
    attnkit::run_parts(parts, [&](int64_t p) {
        int64_t u0, u1;
        attnkit::part_range(total, 1, parts, p, &u0, &u1);
        auto &g = grads[p];
        TORCH_CHECK(ak_mixed_softmax_attention_backward(
                        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), go.data_ptr<float>(),
                        lse.data_ptr<float>(), ptr(grad_lse), ptr(conv), ptr(flipped), ptr(pre), ptr(post), g[0].data_ptr<float>(),
                        g[1].data_ptr<float>(), g[2].data_ptr<float>(), g[3].data_ptr<float>(), g[4].data_ptr<float>(),
                        g[5].data_ptr<float>(), u0, u1, chunks, s.H, s.Hkv, s.Nq, s.Nk, s.D, s.Dv, s.cq, s.ck, group,
                        q_start, bd.has_lo, bd.lo, bd.has_hi, bd.hi, bq, bk) == 0,
                    "attnkit: out of memory for a tile buffer");
    });
    for (int64_t p = 1; p < parts; p++)
        for (size_t i = 0; i < grads[0].size(); i++) grads[0][i].add_(grads[p][i]);
    auto &g = grads[0];
    const Tensor empty = at::empty({0}, f);
    return {g[0], g[1], g[2], conv.has_value() ? g[3].sum(0) : empty, pre.has_value() ? g[4].sum(0) : empty,
            post.has_value() ? g[5].sum(0) : empty};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("mixed_softmax_attention(Tensor q, Tensor k, Tensor v, Tensor? conv, Tensor? pre, Tensor? post, int group, "
          "int q_start, int? lo, int? hi, int block_q, int block_k) -> (Tensor, Tensor)");
    m.def("mixed_softmax_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor? grad_lse, Tensor? conv, "
          "Tensor? pre, Tensor? post, int group, int q_start, int? lo, int? hi, int block_q, int block_k) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("mixed_softmax_attention", &mixed_softmax_attention);
    m.impl("mixed_softmax_attention_backward", &mixed_softmax_attention_backward);
}
