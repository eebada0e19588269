// master_split.cpp — the split master's storage (MasterSplit; Note [Split master in the
// engine], master_split.h; the engine enables, joins and settles it in engine.cpp).
#include "engine/master_split.h"

#include <cstdlib>

namespace zx {

int64_t MasterSplit::chunk_numel(int64_t max_slice_numel, bool cuda) {
    int64_t c = cuda ? (int64_t(1) << 24) : (int64_t(1) << 15);
    // Tests only: chunks of this size, so that small models cross chunk boundaries
    // (tests/test_gpu_engine.py).
    if (const char *env = std::getenv("ZX_SPLIT_MASTER_CHUNK")) c = std::max<int64_t>(8, std::atoll(env) & ~int64_t(7));
    return std::max<int64_t>(8, std::min(c, (max_slice_numel + 7) & ~int64_t(7)));
}

MasterSplit::MasterSplit(const std::vector<int64_t> &slice_numel, const std::vector<int64_t> &shard_offset,
                         int64_t shard_numel, const at::Device &dev)
    : slice_numel_(slice_numel), shard_offset_(shard_offset) {
    int64_t bytes = 0, largest = 0;
    for (int64_t n : slice_numel) {
        tie_offset_.push_back(bytes);
        bytes += (n + 7) / 8;
        largest = std::max(largest, n);
    }
    const auto on = at::TensorOptions().device(dev);
    rem_ = at::zeros({shard_numel}, on.dtype(at::kShort));
    ties_ = at::zeros({bytes}, on.dtype(at::kByte));
    chunk_ = chunk_numel(largest, dev.is_cuda());
}

void MasterSplit::join(Kernels &k, int64_t b, const uint16_t *hi, int64_t at, int64_t n, float *out) {
    TORCH_CHECK(at % 8 == 0, "zero_ext: internal: a split-master chunk must start on a tie byte");
    k.master_join(n, hi + at, rem_.data_ptr<int16_t>() + shard_offset_[b] + at,
                  ties_.data_ptr<uint8_t>() + tie_offset_[b] + at / 8, out);
}

void MasterSplit::split(Kernels &k, int64_t b, const float *m, const uint16_t *hi, int64_t at, int64_t n) {
    TORCH_CHECK(at % 8 == 0, "zero_ext: internal: a split-master chunk must start on a tie byte");
    k.master_split(n, m, hi + at, rem_.data_ptr<int16_t>() + shard_offset_[b] + at,
                   ties_.data_ptr<uint8_t>() + tie_offset_[b] + at / 8);
}

}  // namespace zx
