/* Operators for a KV-cache policy's decoding step (attnkit/kv/): the policies that score
 * every decoded token and evict one entry per (row, KV head) per step, TOVA (arXiv
 * 2401.06104) and H2O (arXiv 2306.14048), and the write of the next token into the slot
 * that eviction left. In PyTorch each is some twenty small tensor operations per layer
 * and step on (B, Hkv, L) tensors; here each is one pass over them. Their attention steps
 * are in kv_attention.cpp; Python side of both: kv.py.
 *
 * Layouts: valid (B, H, L) bool, pos (B, H, L) int64, score (B, H, L) float64, keys and
 * values (B, H, L, D) of any dtype: any strides with a unit stride along the last
 * dimension (the cache's tensors are views of larger storage, ``kv/layer.Room``). */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "binding.h"

namespace {

using at::Tensor;

constexpr int64_t TOVA = 0, H2O = 1;

void check_slots(const Tensor &t, const char *name, at::ScalarType type, int64_t B, int64_t H, int64_t L) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type, "attnkit: ", name, " must be a ", type,
                " CPU tensor, got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == H && t.size(2) == L, "attnkit: ", name, " must be (", B,
                ", ", H, ", ", L, "), got ", t.sizes());
    TORCH_CHECK(L <= 1 || t.stride(2) == 1, "attnkit: ", name, " must have a unit stride along its last dimension");
}

/* Entries a (row, head) keeps beyond its capacity: candidates are the held entries
 * outside the ``recent`` latest ones, of which ``capacity - recent`` may stay. */
int64_t excess_of(int64_t held, int64_t capacity, int64_t recent) {
    return (held - std::min(held, recent)) - (capacity - recent);
}

template <typename T>
std::tuple<Tensor, int64_t, int64_t> evict_lowest(const Tensor &mass, const Tensor &valid, const Tensor &pos,
                                                  const Tensor &capacity, const std::optional<Tensor> &score, int64_t mode,
                                                  double recent_share) {
    const int64_t B = valid.size(0), H = valid.size(1), L = valid.size(2), Hq = mass.size(1);
    const int64_t g = Hq / H;
    bool *vp = valid.data_ptr<bool>();
    const int64_t *pp = pos.data_ptr<int64_t>();
    const T *mp = mass.data_ptr<T>();
    const Tensor cap = capacity.contiguous();
    const int64_t *cp = cap.data_ptr<int64_t>();
    double *sp = mode == H2O ? score->data_ptr<double>() : nullptr;
    const int64_t vb = valid.stride(0), vh = valid.stride(1), pb = pos.stride(0), ph = pos.stride(1);
    const int64_t mb = mass.stride(0), mh = mass.stride(1);
    const int64_t sb = sp ? score->stride(0) : 0, sh = sp ? score->stride(1) : 0;

    std::vector<int64_t> held(B * H), recent(B * H);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const bool *v = vp + b * vb + h * vh;
            int64_t n = 0;
            for (int64_t j = 0; j < L; ++j) n += v[j];
            const int64_t c = cp[b * H + h];
            // H2O's recent share, floor(capacity * recent) as the Python rule computes it
            const int64_t r = mode == H2O ? (int64_t)std::floor((double)c * recent_share) : 0;
            held[b * H + h] = n;
            recent[b * H + h] = r;
            if (excess_of(n, c, r) > 1) return {Tensor(), -1, -1};  // more than one to evict: the general path
        }

    Tensor slot = at::empty({B, H}, pos.options());
    int64_t *out = slot.data_ptr<int64_t>();
    std::vector<double> s(L);
    std::vector<int64_t> recent_pos;
    int64_t fewest = L, most = 0;
    for (int64_t b = 0; b < B; ++b) {
        if (mode == TOVA) {  // the current query's weights averaged over every head of the layer
            for (int64_t j = 0; j < L; ++j) s[j] = 0.0;
            for (int64_t i = 0; i < Hq; ++i) {
                const T *m = mp + b * mb + i * mh;
                for (int64_t j = 0; j < L; ++j) s[j] += (double)m[j];
            }
            for (int64_t j = 0; j < L; ++j) s[j] /= (double)Hq;
        }
        for (int64_t h = 0; h < H; ++h) {
            bool *v = vp + b * vb + h * vh;
            const int64_t *p = pp + b * pb + h * ph;
            const double *rank = s.data();
            if (mode == H2O) {  // accumulate the group's mean weight (in T, as torch's mean does), every slot
                double *acc = sp + b * sb + h * sh;
                for (int64_t j = 0; j < L; ++j) {
                    T sum = 0;
                    for (int64_t i = 0; i < g; ++i) sum += mp[b * mb + (h * g + i) * mh + j];
                    acc[j] += (double)(sum / (T)g);
                }
                rank = acc;
            }
            const int64_t n = held[b * H + h], r = recent[b * H + h];
            int64_t kept = n, evicted = -1;
            if (excess_of(n, cp[b * H + h], r) > 0) {
                // the r latest held positions stay (distinct positions: at or above the r-th latest)
                int64_t threshold = INT64_MAX;
                if (r > 0) {
                    recent_pos.clear();
                    for (int64_t j = 0; j < L; ++j)
                        if (v[j]) recent_pos.push_back(p[j]);
                    std::nth_element(recent_pos.begin(), recent_pos.begin() + (n - r), recent_pos.end());
                    threshold = recent_pos[n - r];
                }
                // the lowest score goes; among equal lowest the latest position (the earlier wins a tie)
                for (int64_t j = 0; j < L; ++j) {
                    if (!v[j] || p[j] >= threshold) continue;
                    if (evicted < 0 || rank[j] < rank[evicted] || (rank[j] == rank[evicted] && p[j] > p[evicted]))
                        evicted = j;
                }
                TORCH_CHECK(evicted >= 0, "attnkit: pos must hold distinct positions for the held entries (row ", b,
                            ", head ", h, " has none to evict below its recent window)");
                v[evicted] = false;
                kept = n - 1;
            }
            out[b * H + h] = evicted;
            fewest = std::min(fewest, kept);
            most = std::max(most, kept);
        }
    }
    return {slot, fewest, most};
}

/* After a decoding step: per (row, KV head), drop the lowest-scoring entry when the head
 * holds one more than it may keep. mode 0 (TOVA): the score is ``mass`` averaged over all
 * query heads; mode 1 (H2O): ``mass`` averaged over the head's group is added to ``score``
 * (in place, every slot), and the floor(capacity * recent) latest entries are exempt.
 * Ties go to the earlier position. ``valid`` is updated in place. Returns the evicted slot
 * per (row, head) (-1: none) and the fewest and most entries now kept; when some head
 * would evict more than one entry it changes nothing and returns an empty tensor. */
std::tuple<Tensor, int64_t, int64_t> kv_evict_lowest(const Tensor &mass, const Tensor &valid, const Tensor &pos,
                                                     const Tensor &capacity, const std::optional<Tensor> &score,
                                                     int64_t mode, double recent) {
    TORCH_CHECK(mode == TOVA || mode == H2O, "attnkit: mode must be 0 (TOVA) or 1 (H2O), got ", mode);
    TORCH_CHECK(recent >= 0.0 && recent <= 1.0, "attnkit: recent must be a share in [0, 1], got ", recent);
    TORCH_CHECK(valid.dim() == 3, "attnkit: valid must be (B, H, L), got ", valid.sizes());
    const int64_t B = valid.size(0), H = valid.size(1), L = valid.size(2);
    check_slots(valid, "valid", at::kBool, B, H, L);
    check_slots(pos, "pos", at::kLong, B, H, L);
    TORCH_CHECK(mass.dim() == 3 && mass.size(0) == B && mass.size(2) == L && H > 0 && mass.size(1) % H == 0,
                "attnkit: mass must be (", B, ", a multiple of ", H, ", ", L, "), got ", mass.sizes());
    TORCH_CHECK(L <= 1 || mass.stride(2) == 1, "attnkit: mass must have a unit stride along its last dimension");
    TORCH_CHECK(mass.device().is_cpu(), "attnkit: mass must be on the CPU, got ", mass.device());
    attnkit::check_tensor(capacity, "capacity", at::kLong, 2);
    attnkit::check_shape(capacity, "capacity", {B, H});
    {
        const Tensor cap = capacity.contiguous();
        const int64_t *cp = cap.data_ptr<int64_t>();
        for (int64_t i = 0; i < cap.numel(); ++i)
            TORCH_CHECK(cp[i] >= 0, "attnkit: capacity must be >= 0 everywhere, got ", cp[i], " at ", i);
    }
    if (mode == H2O) {
        TORCH_CHECK(score.has_value(), "attnkit: H2O needs the accumulated score");
        check_slots(*score, "score", at::kDouble, B, H, L);
    }
    if (mass.scalar_type() == at::kFloat) return evict_lowest<float>(mass, valid, pos, capacity, score, mode, recent);
    TORCH_CHECK(mass.scalar_type() == at::kDouble, "attnkit: mass must be float32 or float64, got ", mass.scalar_type());
    return evict_lowest<double>(mass, valid, pos, capacity, score, mode, recent);
}

/* The next token into each (row, KV head)'s first empty slot: its key and value (B, H, 1,
 * D), position ``seen``, RoPE position ``rope_new`` (B,) and a zero score. Every head must
 * have an empty slot. */
void kv_fill_hole(const Tensor &keys, const Tensor &values, const Tensor &valid, const Tensor &pos,
                  const std::optional<Tensor> &rope, const std::optional<Tensor> &score, const Tensor &key_new,
                  const Tensor &value_new, const Tensor &rope_new, int64_t seen) {
    TORCH_CHECK(valid.dim() == 3, "attnkit: valid must be (B, H, L), got ", valid.sizes());
    const int64_t B = valid.size(0), H = valid.size(1), L = valid.size(2);
    check_slots(valid, "valid", at::kBool, B, H, L);
    check_slots(pos, "pos", at::kLong, B, H, L);
    if (rope) check_slots(*rope, "rope", at::kLong, B, H, L);
    if (score) check_slots(*score, "score", at::kDouble, B, H, L);
    attnkit::check_tensor(rope_new, "rope_new", at::kLong, -1);
    TORCH_CHECK(rope_new.numel() == B, "attnkit: rope_new must be (B,) int64, got shape ", rope_new.sizes());
    for (const auto &[t, name] : {std::pair{&keys, "keys"}, {&values, "values"}, {&key_new, "key_new"}, {&value_new, "value_new"}})
        TORCH_CHECK(t->device().is_cpu(), "attnkit: ", name, " must be on the CPU, got ", t->device());
    const Tensor rn = rope_new.contiguous();
    const Tensor *pairs[2][2] = {{&keys, &key_new}, {&values, &value_new}};
    for (auto &pair : pairs) {
        const Tensor &dst = *pair[0], &src = *pair[1];
        TORCH_CHECK(dst.dim() == 4 && dst.size(0) == B && dst.size(1) == H && dst.size(2) == L && dst.stride(3) == 1,
                    "attnkit: keys and values must be (", B, ", ", H, ", ", L, ", D) with a unit last stride, got ",
                    dst.sizes());
        TORCH_CHECK(src.dim() == 4 && src.size(0) == B && src.size(1) == H && src.size(2) == 1 &&
                        src.size(3) == dst.size(3) && src.stride(3) == 1 && src.scalar_type() == dst.scalar_type(),
                    "attnkit: the new key and value must be (", B, ", ", H, ", 1, ", dst.size(3), ") of the cache's dtype, got ",
                    src.sizes(), " ", src.scalar_type());
    }
    bool *vp = valid.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            bool *v = vp + b * valid.stride(0) + h * valid.stride(1);
            int64_t j = 0;
            while (j < L && v[j]) ++j;
            TORCH_CHECK(j < L, "attnkit: row ", b, " head ", h, " has no empty slot to fill");
            for (auto &pair : pairs) {
                const Tensor &dst = *pair[0], &src = *pair[1];
                const int64_t bytes = dst.size(3) * dst.element_size();
                char *d = (char *)dst.data_ptr() + (b * dst.stride(0) + h * dst.stride(1) + j * dst.stride(2)) * dst.element_size();
                const char *s = (const char *)src.data_ptr() + (b * src.stride(0) + h * src.stride(1)) * src.element_size();
                std::memcpy(d, s, bytes);
            }
            v[j] = true;
            pos.data_ptr<int64_t>()[b * pos.stride(0) + h * pos.stride(1) + j] = seen;
            if (rope) rope->data_ptr<int64_t>()[b * rope->stride(0) + h * rope->stride(1) + j] = rn.data_ptr<int64_t>()[b];
            if (score) score->data_ptr<double>()[b * score->stride(0) + h * score->stride(1) + j] = 0.0;
        }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.def("kv_evict_lowest(Tensor mass, Tensor(a!) valid, Tensor pos, Tensor capacity, Tensor(b!)? score, int mode, "
          "float recent) -> (Tensor, int, int)");
    m.def("kv_fill_hole(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) valid, Tensor(d!) pos, Tensor(e!)? rope, "
          "Tensor(f!)? score, Tensor key_new, Tensor value_new, Tensor rope_new, int seen) -> ()");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("kv_evict_lowest", &kv_evict_lowest);
    m.impl("kv_fill_hole", &kv_fill_hole);
}
