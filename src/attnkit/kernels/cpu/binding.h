/* Argument checks shared by the operator bindings (fused.cpp, mixed.cpp, sparse.cpp,
 * pointwise.cpp, kv.cpp, kv_attention.cpp). torch.ops.attnkit.* are public: the schema
 * checks only types, so every binding checks here what its loop assumes (device, dtype,
 * every dimension, the layout it reads, the range of every integer) and names the
 * argument in the message. The loops (loops_*.cpp) trust what passed. */
#ifndef ATTNKIT_CPU_BINDING_H
#define ATTNKIT_CPU_BINDING_H

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

namespace attnkit {

//: |q_start|, |lo|, |hi| above this could overflow the position sums of the loops
constexpr int64_t MAX_POSITION = int64_t(1) << 48;

/* "(2, 4, -, 8)" for an expected shape; -1 stands for any size. */
inline std::string shape_text(std::initializer_list<int64_t> sizes) {
    std::ostringstream s;
    s << "(";
    const char *sep = "";
    for (int64_t n : sizes) {
        s << sep;
        if (n < 0) s << "any";
        else s << n;
        sep = ", ";
    }
    s << ")";
    return s.str();
}

/* t is a CPU tensor of ``type`` with ``dim`` dimensions (dim < 0: any). */
inline void check_tensor(const at::Tensor &t, const char *name, at::ScalarType type, int64_t dim) {
    TORCH_CHECK(t.defined(), "attnkit: ", name, " must be a tensor, got an undefined one");
    TORCH_CHECK(t.device().is_cpu(), "attnkit: ", name, " must be on the CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == type, "attnkit: ", name, " must be ", type, ", got ", t.scalar_type());
    TORCH_CHECK(dim < 0 || t.dim() == dim, "attnkit: ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_float(const at::Tensor &t, const char *name, int64_t dim) { check_tensor(t, name, at::kFloat, dim); }

/* t has exactly the sizes given (-1: any size in that place); dtype and device checked before. */
inline void check_shape(const at::Tensor &t, const char *name, std::initializer_list<int64_t> sizes) {
    bool ok = t.dim() == (int64_t)sizes.size();
    int64_t i = 0;
    for (int64_t n : sizes) {
        if (!ok) break;
        ok = n < 0 || t.size(i) == n;
        i++;
    }
    TORCH_CHECK(ok, "attnkit: ", name, " must have shape ", shape_text(sizes), ", got ", t.sizes());
}

/* A float32 CPU tensor of exactly the given shape. */
inline void check_float_shape(const at::Tensor &t, const char *name, std::initializer_list<int64_t> sizes) {
    check_float(t, name, (int64_t)sizes.size());
    check_shape(t, name, sizes);
}

/* A float32 CPU tensor the loop writes in place through a raw pointer: contiguous. */
inline void check_in_place(const at::Tensor &t, const char *name) {
    check_float(t, name, -1);
    TORCH_CHECK(t.is_contiguous(), "attnkit: ", name, " must be contiguous (the loop writes it in place)");
}

/* lo <= value <= hi for an integer argument. */
inline void check_range(int64_t value, const char *name, int64_t lo, int64_t hi) {
    TORCH_CHECK(value >= lo && value <= hi, "attnkit: ", name, " must be in [", lo, ", ", hi, "], got ", value);
}

inline void check_at_least(int64_t value, const char *name, int64_t lo) {
    TORCH_CHECK(value >= lo, "attnkit: ", name, " must be at least ", lo, ", got ", value);
}

/* A float argument that must be finite (NaN and inf refused). */
inline void check_finite(double value, const char *name) {
    TORCH_CHECK(value == value && value - value == 0.0, "attnkit: ", name, " must be finite, got ", value);
}

/* q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with Hkv >= 1 dividing H: the
 * layout of the grouped-query loops (one key-value head for each group of query heads). */
inline void check_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    check_float(q, "q", 4);
    check_float(k, "k", 4);
    check_float(v, "v", 4);
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), Nk = k.size(2);
    TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "attnkit: k must have a number of heads >= 1 that divides q's ", H,
                ", got shape ", k.sizes());
    check_shape(k, "k", {B, Hkv, Nk, D});
    check_shape(v, "v", {B, Hkv, Nk, -1});
}

/* The position arguments of a banded loop: each small enough that position sums cannot
 * overflow (the loops clamp the band to the keys, so any sign is safe). */
inline void check_band(int64_t q_start, std::optional<int64_t> lo, std::optional<int64_t> hi) {
    check_range(q_start, "q_start", -MAX_POSITION, MAX_POSITION);
    if (lo.has_value()) check_range(*lo, "lo", -MAX_POSITION, MAX_POSITION);
    if (hi.has_value()) check_range(*hi, "hi", -MAX_POSITION, MAX_POSITION);
}

/* A diagonal band lo <= key - query position <= hi; an absent bound is unbounded. */
struct Band {
    int has_lo, has_hi;
    int64_t lo, hi;
};

inline Band band_of(std::optional<int64_t> lo, std::optional<int64_t> hi) {
    return {lo.has_value(), hi.has_value(), lo.value_or(0), hi.value_or(0)};
}

}  // namespace attnkit

#endif
