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
               const std::optional<Tensor> &pre, const std::optional<Tensor> &post, int64_t group, int64_t q_start,
               std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq, int64_t bk) {
    attnkit::check_attention(q, k, v);
    attnkit::check_band(q_start, lo, hi);
    //: the tile buffers hold about bq x bk floats per head of a group
    constexpr int64_t MAX_BLOCK = 4096;
    attnkit::check_range(bq, "block_q", 1, MAX_BLOCK);
    attnkit::check_range(bk, "block_k", 1, MAX_BLOCK);
    const int64_t H = q.size(1);
    attnkit::check_range(group, "group", 1, std::max<int64_t>(H, 1));
    TORCH_CHECK(H % group == 0, "attnkit: group must divide the heads (", H, "), got ", group);
    TORCH_CHECK(!(conv.has_value() && pre.has_value()), "attnkit: conv and pre are exclusive");
    if (conv.has_value()) {
        attnkit::check_float_shape(*conv, "conv", {H, -1, -1});
        attnkit::check_range(conv->size(1), "conv's query taps (conv.size(1))", 1, MAX_BLOCK);
        attnkit::check_range(conv->size(2), "conv's key taps (conv.size(2))", 1, MAX_BLOCK);
    }
    if (pre.has_value()) attnkit::check_float_shape(*pre, "pre", {H, H});
    if (post.has_value()) attnkit::check_float_shape(*post, "post", {H, H});
    const int64_t cq = conv.has_value() ? conv->size(1) : 1, ck = conv.has_value() ? conv->size(2) : 1;
    return {q.size(0), H, k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), cq, ck};
}

const float *ptr(const std::optional<Tensor> &t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

std::optional<Tensor> dense(const std::optional<Tensor> &t) {
    return t.has_value() ? std::optional<Tensor>(t->contiguous()) : std::nullopt;
}

ak_mixed_call call_of(const Shape &s, const Tensor &q, const Tensor &k, const Tensor &v, const std::optional<Tensor> &conv,
                      const std::optional<Tensor> &pre, const std::optional<Tensor> &post, int64_t group, int64_t q_start,
                      std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq, int64_t bk, int64_t chunks) {
    const Band bd = attnkit::band_of(lo, hi);
    return {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ptr(conv), ptr(pre), ptr(post),
            {s.H, s.Hkv, s.Nq, s.Nk, s.D, s.Dv}, s.cq, s.ck, group, {q_start, bd.has_lo, bd.has_hi, bd.lo, bd.hi},
            bq, bk, chunks};
}

std::tuple<Tensor, Tensor> mixed_softmax_attention(const Tensor &q_, const Tensor &k_, const Tensor &v_,
                                                   const std::optional<Tensor> &conv_, const std::optional<Tensor> &pre_,
                                                   const std::optional<Tensor> &post_, int64_t group, int64_t q_start,
                                                   std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq,
                                                   int64_t bk) {
    const Shape s = shape_of(q_, k_, v_, conv_, pre_, post_, group, q_start, lo, hi, bq, bk);
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    const auto conv = dense(conv_), pre = dense(pre_), post = dense(post_);
    Tensor out = at::empty({s.B, s.H, s.Nq, s.Dv}, q.options()), lse = at::empty({s.B, s.H, s.Nq}, q.options());
    const int64_t chunks = chunk_count(s.B * s.H / group, s.Nq, bq);  // each writes its own rows of out and lse
    const ak_mixed_call call = call_of(s, q, k, v, conv, pre, post, group, q_start, lo, hi, bq, bk, chunks);
    float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
    attnkit::over_units(s.B * s.H / group * chunks, 1,
                        [&](int64_t u0, int64_t u1) { return ak_mixed_softmax_attention(call, op, lp, u0, u1); });
    return {out, lse};
}

/* (dq of the scaled q, dk, dv, dconv (H, cq, ck), dpre and dpost per group
 * (H / group, group, group)); an absent transform's gradient is an empty tensor. */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mixed_softmax_attention_backward(
    const Tensor &grad_out_, const Tensor &q_, const Tensor &k_, const Tensor &v_, const Tensor &lse_,
    const std::optional<Tensor> &grad_lse_, const std::optional<Tensor> &conv_, const std::optional<Tensor> &pre_, const std::optional<Tensor> &post_, int64_t group,
    int64_t q_start, std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t bq, int64_t bk) {
    const Shape s = shape_of(q_, k_, v_, conv_, pre_, post_, group, q_start, lo, hi, bq, bk);
    attnkit::check_float_shape(grad_out_, "grad_out", {s.B, s.H, s.Nq, s.Dv});
    attnkit::check_float_shape(lse_, "lse", {s.B, s.H, s.Nq});
    if (grad_lse_.has_value()) attnkit::check_float_shape(*grad_lse_, "grad_lse", {s.B, s.H, s.Nq});
    const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), go = grad_out_.contiguous();
    const Tensor lse = lse_.contiguous();
    const auto grad_lse = dense(grad_lse_);
    const auto conv = dense(conv_), pre = dense(pre_), post = dense(post_);
    const std::optional<Tensor> flipped = conv.has_value() ? std::optional<Tensor>(conv->flip({-1, -2}).contiguous())
                                                           : std::nullopt;
    const int64_t chunks = chunk_count(s.B * s.H / group, s.Nq, bq), total = s.B * s.H / group * chunks;
    // Parts may share key heads (GQA) and, in chunks, groups: each adds into gradients of
    // its own, summed after.
    const int64_t parts = attnkit::part_count(total, 1);
    const auto f = q.options();
    std::vector<std::vector<Tensor>> grads(parts);
    for (auto &g : grads)
        g = {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v), at::zeros({s.B, s.H, s.cq, s.ck}, f),
             at::zeros({s.B, s.H / group, group, group}, f), at::zeros({s.B, s.H / group, group, group}, f)};
    const ak_mixed_call call = call_of(s, q, k, v, conv, pre, post, group, q_start, lo, hi, bq, bk, chunks);
    attnkit::run_parts(parts, [&](int64_t p) {
        int64_t u0, u1;
        attnkit::part_range(total, 1, parts, p, &u0, &u1);
        auto &g = grads[p];
        const ak_mixed_grads into = {go.data_ptr<float>(), lse.data_ptr<float>(), ptr(grad_lse), ptr(flipped),
                                     g[0].data_ptr<float>(), g[1].data_ptr<float>(), g[2].data_ptr<float>(),
                                     g[3].data_ptr<float>(), g[4].data_ptr<float>(), g[5].data_ptr<float>()};
        TORCH_CHECK(ak_mixed_softmax_attention_backward(call, into, u0, u1) == 0, "attnkit: out of memory for a tile buffer");
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
