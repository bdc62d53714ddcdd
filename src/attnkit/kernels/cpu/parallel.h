/* Work split for the operators: torch's intra-op pool (at::parallel_for follows
 * torch.set_num_threads and is safe across fork), one contiguous range of work units per
 * part. Inside the parallel region the BLAS runs each tile product on its own thread:
 * splitting a small tile across every core again is many times slower. */
#ifndef ATTNKIT_CPU_PARALLEL_H
#define ATTNKIT_CPU_PARALLEL_H

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace attnkit {

/* fn(part) for part in [0, parts), spread over torch's threads. A single part still runs
 * inside a parallel region (the other threads idle), so that its products stay
 * single-threaded as they are when there are several. */
template <class F>
void run_parts(int64_t parts, const F &fn) {
    const int64_t threads = at::get_num_threads();
    if (parts == 1 && (threads <= 1 || at::in_parallel_region())) {
        fn(0);
        return;
    }
    const int64_t span = parts == 1 ? threads : parts;
    at::parallel_for(0, span, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1 && p < parts; p++) fn(p);
    });
}

/* How many parts [0, total) work units in multiples of ``granule`` split into: one per
 * thread, at most one per granule. */
inline int64_t part_count(int64_t total, int64_t granule) {
    const int64_t threads = at::get_num_threads(), units = total / granule;
    return threads <= 1 || units <= 1 ? 1 : std::min(threads, units);
}

/* The range [u0, u1) of part p of part_count(total, granule) parts. */
inline void part_range(int64_t total, int64_t granule, int64_t parts, int64_t p, int64_t *u0, int64_t *u1) {
    const int64_t units = total / granule;
    *u0 = granule * (units * p / parts);
    *u1 = granule * (units * (p + 1) / parts);
}

/* run(u0, u1) (a loop returning 0, or 1 when out of memory) over [0, total) in ranges
 * aligned to ``granule``, one per thread. */
template <class F>
void over_units(int64_t total, int64_t granule, const F &run) {
    if (total <= 0) return;
    const int64_t parts = part_count(total, granule);
    run_parts(parts, [&](int64_t p) {
        int64_t u0, u1;
        part_range(total, granule, parts, p, &u0, &u1);
        TORCH_CHECK(run(u0, u1) == 0, "attnkit: out of memory for a tile buffer");
    });
}

/* Calls below this many multiply-adds run on the calling thread: waking torch's pool
 * costs more than such work (a decoding step or a short prompt of a small model). */
constexpr int64_t SMALL_CALL_WORK = int64_t(1) << 16;

/* over_units, or run(0, total) on the calling thread when the whole call (``work``
 * multiply-adds per unit) is a small one. Its tile products then run outside a parallel
 * region; at these sizes the BLAS keeps them on one thread anyway. */
template <class F>
void over_units_sized(int64_t total, int64_t granule, int64_t work, const F &run) {
    if (total > 0 && total * work < SMALL_CALL_WORK) {
        TORCH_CHECK(run(0, total) == 0, "attnkit: out of memory for a tile buffer");
        return;
    }
    over_units(total, granule, run);
}

}  // namespace attnkit

#endif
