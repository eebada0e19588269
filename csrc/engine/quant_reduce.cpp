// quant_reduce.cpp — quantized gradient reduce-scatter by all-to-all: see
// Note [Quantized gradient reduction] in quant_reduce.h.
#include "engine/quant_reduce.h"

#include <algorithm>
#include <atomic>

#include "kernels_binding.h"   // defines: zx_check

namespace zx {

QuantReduce::QuantReduce(int32_t bits, int64_t block_numel, bool error_feedback, zx_isa isa, int64_t parts)
    : bits_(bits), block_numel_(block_numel), error_feedback_(error_feedback), isa_(isa), parts_(parts) {
    TORCH_CHECK(bits == 0 || bits == 8 || bits == 4, "zero_ext: grad_quant must be int8 or int4");
    TORCH_CHECK(bits == 0 || (block_numel >= 2 && block_numel % 2 == 0),
                "zero_ext: quant_block_numel must be even and >= 2, got ", block_numel);
}

QuantReduce::Buffers &QuantReduce::buffers(int64_t slot, int64_t codes_bytes, int64_t nscales) {
    if ((int64_t)slots_.size() <= slot) slots_.resize(slot + 1);
    Buffers &bf = slots_[slot];
    // Sized by the largest bucket seen; grown at most a few times (buckets come in
    // plan order, the first one is the small one).
    if (!bf.codes_send.defined() || bf.codes_send.numel() < codes_bytes) {
        bf.codes_send = at::empty({codes_bytes}, at::kByte);
        bf.codes_recv = at::empty({codes_bytes}, at::kByte);
    }
    if (!bf.scales_send.defined() || bf.scales_send.numel() < nscales) {
        bf.scales_send = at::empty({nscales}, at::kFloat);
        bf.scales_recv = at::empty({nscales}, at::kFloat);
    }
    return bf;
}

WorkPtr QuantReduce::launch(Communicator &comm, int64_t b, const at::Tensor &send, int64_t slice_numel,
                            int64_t slot) {
    size_t slice_bytes = 0;
    zx_check(zx_quant_bytes(bits_, (size_t)block_numel_, (size_t)slice_numel, &slice_bytes), "grad_quant sizes");
    const int64_t slice_blocks = (int64_t)zx_quant_blocks((size_t)slice_numel, (size_t)block_numel_);
    Buffers &bf = buffers(slot, parts_ * (int64_t)slice_bytes, parts_ * slice_blocks);
    float *residual = nullptr;
    if (error_feedback_) {
        if ((int64_t)residual_.size() <= b) residual_.resize(b + 1);
        if (!residual_[b].defined()) residual_[b] = at::zeros({send.numel()}, at::kFloat);
        residual = residual_[b].data_ptr<float>();
    }
    const zx_dtype dt = send.scalar_type() == at::kFloat ? ZX_F32
                        : send.scalar_type() == at::kBFloat16 ? ZX_BF16 : ZX_F16;
    const char *src = static_cast<const char *>(send.data_ptr());
    const size_t esz = send.element_size();
    uint8_t *codes = bf.codes_send.data_ptr<uint8_t>();
    float *scales = bf.scales_send.data_ptr<float>();
    // one slice per task: blocks never cross slices (each owner gets whole blocks)
    std::atomic<int> status{ZX_OK};
    at::parallel_for(0, parts_, 1, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; j++) {
            const int64_t lo = j * slice_numel;
            zx_status s = zx_quantize(isa_, bits_, (size_t)block_numel_, (size_t)slice_numel,
                                      src + (size_t)lo * esz, dt, residual ? residual + lo : nullptr,
                                      codes + j * (int64_t)slice_bytes, scales + j * slice_blocks);
            if (s != ZX_OK) status.store((int)s);
        }
    });
    zx_check((zx_status)status.load(), "quantizing gradients (grad_quant)");
    const int64_t ns = parts_ * slice_blocks, nc = parts_ * (int64_t)slice_bytes;
    auto works = comm.all_to_all_quantized(bf.codes_recv.narrow(0, 0, nc), bf.codes_send.narrow(0, 0, nc),
                                           bf.scales_recv.narrow(0, 0, ns), bf.scales_send.narrow(0, 0, ns),
                                           send.numel(), send.element_size());
    bf.scales_work = works.first;
    return works.second;
}

void QuantReduce::finish(int64_t slot, int64_t slice_numel, at::Tensor dst, bool accumulate) {
    Buffers &bf = slots_.at(slot);
    Communicator::wait(bf.scales_work, "gradient reduce-scatter (scales)");
    bf.scales_work.reset();
    const int64_t slice_blocks = (int64_t)zx_quant_blocks((size_t)slice_numel, (size_t)block_numel_);
    // fp32 destination: sum straight into it; a bf16/fp16 shard gets the fp32 sum rounded once
    at::Tensor out = dst.scalar_type() == at::kFloat ? dst : at::empty({slice_numel}, at::kFloat);
    const bool acc_in_kernel = accumulate && dst.scalar_type() == at::kFloat;
    const uint8_t *codes = bf.codes_recv.data_ptr<uint8_t>();
    const float *scales = bf.scales_recv.data_ptr<float>();
    float *d = out.data_ptr<float>();
    const size_t bbytes = (size_t)(bits_ == 8 ? block_numel_ : block_numel_ / 2);
    std::atomic<int> status{ZX_OK};
    // tasks over whole blocks; each sums the N slices of its blocks
    at::parallel_for(0, slice_blocks, std::max<int64_t>(1, (1 << 16) / block_numel_), [&](int64_t b0, int64_t b1) {
        const int64_t lo = b0 * block_numel_, hi = std::min(slice_numel, b1 * block_numel_);
        zx_status s = zx_dequantize_sum(isa_, bits_, (size_t)block_numel_, (size_t)(hi - lo), (int32_t)parts_,
                                        (size_t)slice_blocks, codes + (size_t)b0 * bbytes, scales + b0, d + lo,
                                        acc_in_kernel ? 1 : 0, 1.0f);
        if (s != ZX_OK) status.store((int)s);
    });
    zx_check((zx_status)status.load(), "summing quantized gradient slices (grad_quant)");
    if (!out.is_same(dst)) {
        if (accumulate)
            dst.copy_(dst.to(at::kFloat).add_(out));
        else
            dst.copy_(out);
    }
}

int64_t QuantReduce::buffer_bytes() const {
    int64_t n = 0;
    for (const auto &bf : slots_) {
        if (bf.codes_send.defined()) n += bf.codes_send.nbytes() + bf.codes_recv.nbytes();
        if (bf.scales_send.defined()) n += bf.scales_send.nbytes() + bf.scales_recv.nbytes();
    }
    return n;
}

int64_t QuantReduce::residual_bytes() const {
    int64_t n = 0;
    for (const auto &r : residual_)
        if (r.defined()) n += r.nbytes();
    return n;
}

}  // namespace zx
