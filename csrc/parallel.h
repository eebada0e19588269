// parallel.h — how the binding splits element loops over torch's intra-op threads.
//
//   zx_parallel_for(n, fn)       fn(lo, hi) on disjoint ranges covering [0, n), at
//                                least kParallelGrainNumel elements a task, run by
//                                the threads torch.set_num_threads gives
//   zx_parallel_blocks(n, block, fn)  fn(first block, lo, hi) on ranges of whole
//                                blocks of `block` elements covering [0, n), about
//                                kParallelGrainNumel elements a task (blockwise
//                                quantization: a block depends on its elements alone)
//   zx_parallel_threads_seen(n)  how many distinct threads ran a task of such a loop
//                                over n elements (a probe for tests: proves the loop
//                                is not serial; see tests/test_threads.py)
// Whether at::parallel_for is parallel in this file is decided at build time by
// setup.py (Note [Intra-op threads]); the C core only ever sees [lo, hi) ranges.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>

constexpr int64_t kParallelGrainNumel = 1 << 16;  // elements per parallel task

template <class F>
inline void zx_parallel_for(int64_t n, F &&fn) {
    if (n <= 0) return;
    at::parallel_for(0, n, kParallelGrainNumel, [&](int64_t lo, int64_t hi) { fn(lo, hi); });
}

template <class F>
inline void zx_parallel_blocks(int64_t n, int64_t block, F &&fn) {
    const int64_t nb = (n + block - 1) / block;
    if (nb <= 0) return;
    at::parallel_for(0, nb, std::max<int64_t>(1, kParallelGrainNumel / block),
                     [&](int64_t b0, int64_t b1) { fn(b0, b0 * block, std::min(n, b1 * block)); });
}

inline int64_t zx_parallel_threads_seen(int64_t n) {
    std::mutex mu;
    std::set<std::thread::id> seen;
    zx_parallel_for(n, [&](int64_t, int64_t) {
        std::lock_guard<std::mutex> lock(mu);
        seen.insert(std::this_thread::get_id());
    });
    return (int64_t)seen.size();
}
