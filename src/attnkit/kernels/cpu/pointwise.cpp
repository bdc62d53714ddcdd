/* Operators around the pointwise tile steps of loops_pointwise.cpp, for the PyTorch tile
 * loops (kernels/tiled.py, kernels/engine.py, the mechanisms): sigmoid gates, softcap,
 * the online-softmax update, PAI's abs boost, stick-breaking weights and their backward (in place, on
 * contiguous float32 tiles), and the head mixing, top-k of rows and depthwise convolution
 * that torch runs slowly on CPU. Python side: pointwise.py. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "binding.h"
#include "common.h"

namespace {

using at::Tensor;

//: the head mixing keeps one row of coefficients on the stack
constexpr int64_t MAX_MIX_HEADS = 64;

/* (rows, cols) of t seen as rows of its last dimension. */
void rows_of(const Tensor &t, int64_t *rows, int64_t *cols) {
    *cols = t.dim() ? t.size(-1) : 1;
    *rows = *cols ? t.numel() / *cols : 0;
}

void sigmoid_(const Tensor &x, double bias) {
    attnkit::check_in_place(x, "x");
    ak_sigmoid(x.data_ptr<float>(), x.numel(), (float)bias);
}

void softcap_(const Tensor &x, double cap) {
    attnkit::check_in_place(x, "x");
    TORCH_CHECK(cap > 0, "attnkit: cap must be positive, got ", cap);
    ak_softcap(x.data_ptr<float>(), x.data_ptr<float>(), x.numel(), (float)cap);
}

Tensor online_softmax_(const Tensor &s, const Tensor &m, const Tensor &l) {
    attnkit::check_in_place(s, "s");
    attnkit::check_in_place(m, "m");
    attnkit::check_in_place(l, "l");
    int64_t rows, cols;
    rows_of(s, &rows, &cols);
    TORCH_CHECK(m.numel() == rows, "attnkit: m must hold one entry per row of s (", rows, "), got shape ", m.sizes());
    TORCH_CHECK(l.numel() == rows, "attnkit: l must hold one entry per row of s (", rows, "), got shape ", l.sizes());
    Tensor alpha = at::empty_like(m);
    ak_online_softmax(s.data_ptr<float>(), rows, cols, m.data_ptr<float>(), l.data_ptr<float>(), alpha.data_ptr<float>());
    return alpha;
}

void abs_boost_(const Tensor &s, const Tensor &t) {
    attnkit::check_in_place(s, "s");
    attnkit::check_float(t, "t", 2);
    TORCH_CHECK(t.is_contiguous(), "attnkit: t must be contiguous");
    const int64_t groups = t.size(0), cols = t.size(1);
    TORCH_CHECK(s.dim() >= 1 && s.size(-1) == cols, "attnkit: s must have t's ", cols, " columns, got shape ", s.sizes());
    TORCH_CHECK(groups > 0 && cols > 0 && s.numel() % (groups * cols) == 0, "attnkit: s ", s.sizes(),
                " is not groups of rows of t ", t.sizes());
    ak_abs_boost(s.data_ptr<float>(), t.data_ptr<float>(), groups, s.numel() / (groups * cols), cols);
}

void stick_breaking_(const Tensor &s, const Tensor &carry) {
    attnkit::check_in_place(s, "s");
    attnkit::check_in_place(carry, "carry");
    int64_t rows, cols;
    rows_of(s, &rows, &cols);
    TORCH_CHECK(carry.numel() == rows, "attnkit: carry must hold one entry per row of s");
    TORCH_CHECK(ak_stick_breaking(s.data_ptr<float>(), rows, cols, carry.data_ptr<float>()) == 0,
                "attnkit: out of memory for a tile buffer");
}

void stick_breaking_backward_(const Tensor &s, const Tensor &dw, const Tensor &carry, const Tensor &carry_w,
                              const Tensor &delta_) {
    for (const auto &[t, name] : {std::pair{&s, "s"}, {&dw, "dw"}, {&carry, "carry"}, {&carry_w, "carry_w"}})
        attnkit::check_in_place(*t, name);
    attnkit::check_float(delta_, "delta", -1);
    const Tensor delta = delta_.contiguous();
    int64_t rows, cols;
    rows_of(s, &rows, &cols);
    TORCH_CHECK(dw.sizes() == s.sizes(), "attnkit: dw must have s's shape ", s.sizes(), ", got ", dw.sizes());
    for (const auto &[t, name] : {std::pair{&carry, "carry"}, {&carry_w, "carry_w"}, {&delta, "delta"}})
        TORCH_CHECK(t->numel() == rows, "attnkit: ", name, " must hold one entry per row of s (", rows, "), got shape ",
                    t->sizes());
    TORCH_CHECK(ak_stick_breaking_backward(s.data_ptr<float>(), dw.data_ptr<float>(), rows, cols, carry.data_ptr<float>(),
                                           carry_w.data_ptr<float>(), delta.data_ptr<float>()) == 0,
                "attnkit: out of memory for a tile buffer");
}

Tensor depthwise_conv2d(const Tensor &x_, const Tensor &weight_) {
    attnkit::check_float(x_, "x", 4);
    attnkit::check_float(weight_, "weight", 3);
    const Tensor x = x_.contiguous(), w = weight_.contiguous();
    const int64_t N = x.size(0), H = x.size(1), R = x.size(2), C = x.size(3), cq = w.size(1), ck = w.size(2);
    TORCH_CHECK(w.size(0) == H, "attnkit: weight must be (heads, cq, ck) with ", H, " heads, got ", w.sizes());
    TORCH_CHECK(cq >= 1 && ck >= 1, "attnkit: weight must have at least one tap each way, got shape ", w.sizes());
    Tensor y = at::empty({N, H, std::max<int64_t>(R - cq + 1, 0), std::max<int64_t>(C - ck + 1, 0)}, x.options());
    ak_depthwise_conv2d(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), N, H, R, C, cq, ck);
    return y;
}

Tensor depthwise_conv2d_weight_grad(const Tensor &x_, const Tensor &dy_, int64_t cq, int64_t ck) {
    attnkit::check_float(x_, "x", 4);
    attnkit::check_range(cq, "cq", 1, int64_t(1) << 20);
    attnkit::check_range(ck, "ck", 1, int64_t(1) << 20);
    const int64_t N = x_.size(0), H = x_.size(1), R = x_.size(2), C = x_.size(3);
    attnkit::check_float_shape(dy_, "dy", {N, H, std::max<int64_t>(R - cq + 1, 0), std::max<int64_t>(C - ck + 1, 0)});
    const Tensor x = x_.contiguous(), dy = dy_.contiguous();
    Tensor dw = at::empty({H, cq, ck}, x.options());
    ak_depthwise_conv2d_weight_grad(x.data_ptr<float>(), dy.data_ptr<float>(), dw.data_ptr<float>(), N, H, R, C, cq, ck);
    return dw;
}

std::tuple<Tensor, Tensor> topk_rows(const Tensor &s_, int64_t k) {
    attnkit::check_float(s_, "s", -1);
    TORCH_CHECK(s_.dim() >= 1, "attnkit: s must have at least one dimension");
    const Tensor s = s_.contiguous();
    int64_t rows, cols;
    rows_of(s, &rows, &cols);
    TORCH_CHECK(k >= 1 && k <= cols, "attnkit: k must be in [1, ", cols, "], got ", k);
    auto shape = s.sizes().vec();
    shape.back() = k;
    Tensor values = at::empty(shape, s.options()), columns = at::empty(shape, s.options().dtype(at::kLong));
    TORCH_CHECK(ak_topk_rows(s.data_ptr<float>(), rows, cols, k, values.data_ptr<float>(), columns.data_ptr<int64_t>()) == 0,
                "attnkit: out of memory for a candidate buffer");
    return {values, columns};
}

Tensor mix_heads(const Tensor &mix_, const Tensor &x_, const std::optional<Tensor> &row_scale_) {
    attnkit::check_float(mix_, "mix", 2);
    attnkit::check_float(x_, "x", 4);
    const Tensor mix = mix_.contiguous(), x = x_.contiguous();
    const int64_t bt = x.size(0), h = x.size(1), r = x.size(2), c = x.size(3), g = mix.size(0);
    TORCH_CHECK(mix.size(1) == h && h <= MAX_MIX_HEADS, "attnkit: mix must be (G, ", h, ") with at most ", MAX_MIX_HEADS,
                " heads, got ", mix.sizes());
    Tensor scale;
    if (row_scale_.has_value()) {
        attnkit::check_float(*row_scale_, "row_scale", 3);
        scale = row_scale_->contiguous();
        TORCH_CHECK(scale.size(0) == bt && scale.size(1) == h && scale.size(2) == r, "attnkit: row_scale must be (", bt,
                    ", ", h, ", ", r, "), got ", scale.sizes());
    }
    Tensor out = at::empty({bt, g, r, c}, x.options());
    ak_mix_heads_scaled(mix.data_ptr<float>(), x.data_ptr<float>(), scale.defined() ? scale.data_ptr<float>() : nullptr,
                        out.data_ptr<float>(), bt, g, h, r, c);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("sigmoid_(Tensor(a!) x, float bias) -> ()");
    m.def("softcap_(Tensor(a!) x, float cap) -> ()");
    m.def("online_softmax_(Tensor(a!) s, Tensor(b!) m, Tensor(c!) l) -> Tensor");
    m.def("abs_boost_(Tensor(a!) s, Tensor t) -> ()");
    m.def("stick_breaking_(Tensor(a!) s, Tensor(b!) carry) -> ()");
    m.def("stick_breaking_backward_(Tensor(a!) s, Tensor(b!) dw, Tensor(c!) carry, Tensor(d!) carry_w, Tensor delta) -> ()");
    m.def("depthwise_conv2d(Tensor x, Tensor weight) -> Tensor");
    m.def("depthwise_conv2d_weight_grad(Tensor x, Tensor dy, int cq, int ck) -> Tensor");
    m.def("topk_rows(Tensor s, int k) -> (Tensor, Tensor)");
    m.def("mix_heads(Tensor mix, Tensor x, Tensor? row_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("sigmoid_", &sigmoid_);
    m.impl("softcap_", &softcap_);
    m.impl("online_softmax_", &online_softmax_);
    m.impl("abs_boost_", &abs_boost_);
    m.impl("stick_breaking_", &stick_breaking_);
    m.impl("stick_breaking_backward_", &stick_breaking_backward_);
    m.impl("depthwise_conv2d", &depthwise_conv2d);
    m.impl("depthwise_conv2d_weight_grad", &depthwise_conv2d_weight_grad);
    m.impl("topk_rows", &topk_rows);
    m.impl("mix_heads", &mix_heads);
}
