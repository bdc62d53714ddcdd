/* Argument checks shared by the operator bindings (fused.cpp, mixed.cpp, sparse.cpp,
 * pointwise.cpp): the schema checks types, these check what the loops assume. */
#ifndef ATTNKIT_CPU_BINDING_H
#define ATTNKIT_CPU_BINDING_H

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace attnkit {

inline void check_float(const at::Tensor &t, const char *name, int64_t dim) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "attnkit: ", name,
                " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK(dim < 0 || t.dim() == dim, "attnkit: ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_in_place(const at::Tensor &t, const char *name) {
    check_float(t, name, -1);
    TORCH_CHECK(t.is_contiguous(), "attnkit: ", name, " must be contiguous (the loop writes it in place)");
}

/* q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hv, Nk, Dv) with H a multiple of Hk and Hv. */
inline void check_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    check_float(q, "q", 4);
    check_float(k, "k", 4);
    check_float(v, "v", 4);
    TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "attnkit: q, k, v must share the batch size, got ",
                q.sizes(), ", ", k.sizes(), ", ", v.sizes());
    TORCH_CHECK(k.size(1) > 0 && v.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.size(1) % v.size(1) == 0,
                "attnkit: the query heads must be a multiple of the key and value heads, got ", q.size(1), ", ",
                k.size(1), ", ", v.size(1));
    TORCH_CHECK(k.size(2) == v.size(2), "attnkit: k and v must have the same length, got ", k.size(2), " and ", v.size(2));
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
