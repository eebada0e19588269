// master_split.cpp — the split master's storage (MasterSplit) and the engine's side
// of it: enable, join on demand, settle (Note [Split master in the engine],
// master_split.h).
#include "engine/engine.h"

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
    : shard_offset_(shard_offset) {
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

void Engine::enable_split_master() {
    if (shard_.split) return;
    TORCH_CHECK(layout_.opts.stage <= 2 && layout_.dtypes.param == at::kBFloat16 && !gather_.quantized() && !off_ &&
                    shard_.master.defined(),
                "zero_ext: master_remainder needs param_dtype='bf16' in stage 0, 1 or 2 without param_quant or "
                "offload; pass master_remainder=False");
    for (const auto &bk : buckets_)
        TORCH_CHECK(!bk.atomic, "zero_ext: master_remainder is for element-granular buckets (one fused "
                    "optimizer); pass master_remainder=False");
    std::vector<int64_t> slices, offsets;
    for (const auto &bk : buckets_) {
        slices.push_back(bk.slice_numel);
        offsets.push_back(bk.shard_offset);
    }
    shard_.split = std::make_unique<MasterSplit>(slices, offsets, layout_.shard_numel, layout_.dev);
    settle_masters();
}

void Engine::join_masters() {
    if (!shard_.split || shard_.master.defined()) return;
    wait_params();
    shard_.master = at::empty({layout_.shard_numel}, on_device(at::kFloat));
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        Bucket &bk = buckets_[b];
        shard_.split->join(*kernels_.device, b, view().hi_bits(bk), 0, bk.slice_numel,
                           shard_.master.data_ptr<float>() + bk.shard_offset);
    }
}

void Engine::settle_masters() {
    if (!shard_.split || !shard_.master.defined()) return;
    wait_params();
    for (int64_t b = 0; b < (int64_t)buckets_.size(); b++) {
        Bucket &bk = buckets_[b];
        const float *m = shard_.master.data_ptr<float>() + bk.shard_offset;
        // the step's rounding
        kernels_.device->cast_from_f32(bk.slice_numel, m, view().lp(bk).data_ptr(), layout_.dtypes.param_zx);
        shard_.split->split(*kernels_.device, b, m, view().hi_bits(bk), 0, bk.slice_numel);
    }
    shard_.master = at::Tensor();
}

}  // namespace zx
