// quant_reduce.cpp — quantized gradient reduce-scatter by all-to-all: see
// Note [Quantized gradient reduction] in quant_reduce.h.
#include "engine/quant_reduce.h"

#include "engine/check.h"      // defines: zx_check

namespace zx {

QuantReduce::QuantReduce(int32_t bits, int64_t block_numel, bool error_feedback, Kernels *kern, at::Device device,
                         int64_t parts)
    : bits_(bits), block_numel_(block_numel), error_feedback_(error_feedback), kern_(kern), device_(device),
      partitions_(parts) {
    TORCH_CHECK(bits == 0 || bits == 8 || bits == 4, "zero_ext: grad_quant must be int8 or int4; pass "
                "grad_quant='int8', 'int4' or None");
    TORCH_CHECK(bits == 0 || (block_numel >= 2 && block_numel % 2 == 0),
                "zero_ext: quant_block_numel must be even and >= 2, got ", block_numel,
                "; pass an even quant_block_numel (the default is 256)");
}

QuantReduce::Buffers &QuantReduce::buffers(int64_t slot, int64_t codes_bytes, int64_t nscales) {
    if ((int64_t)slots_.size() <= slot) slots_.resize(slot + 1);
    Buffers &bf = slots_[slot];
    // Sized by the largest bucket seen; grown at most a few times (buckets come in
    // plan order, the first one is the small one).
    if (!bf.codes_send.defined() || bf.codes_send.numel() < codes_bytes) {
        const auto u8 = at::TensorOptions().dtype(at::kByte).device(device_);
        bf.codes_send = at::empty({codes_bytes}, u8);
        bf.codes_recv = at::empty({codes_bytes}, u8);
    }
    if (!bf.scales_send.defined() || bf.scales_send.numel() < nscales) {
        const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
        bf.scales_send = at::empty({nscales}, f32);
        bf.scales_recv = at::empty({nscales}, f32);
    }
    return bf;
}

WorkPtr QuantReduce::launch(Communicator &comm, int64_t b, const at::Tensor &send, int64_t slice_numel,
                            int64_t slot) {
    size_t slice_bytes = 0;
    zx_check(zx_quant_bytes(bits_, (size_t)block_numel_, (size_t)slice_numel, &slice_bytes), "grad_quant sizes");
    const int64_t slice_blocks = (int64_t)zx_quant_blocks((size_t)slice_numel, (size_t)block_numel_);
    Buffers &bf = buffers(slot, partitions_ * (int64_t)slice_bytes, partitions_ * slice_blocks);
    float *residual = nullptr;
    if (error_feedback_) {
        if ((int64_t)residual_.size() <= b) residual_.resize(b + 1);
        if (!residual_[b].defined())
            residual_[b] = at::zeros({send.numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
        residual = residual_[b].data_ptr<float>();
    }
    const zx_dtype dt = send.scalar_type() == at::kFloat ? ZX_F32
                        : send.scalar_type() == at::kBFloat16 ? ZX_BF16 : ZX_F16;
    const char *src = static_cast<const char *>(send.data_ptr());
    const size_t esz = send.element_size();
    uint8_t *codes = bf.codes_send.data_ptr<uint8_t>();
    float *scales = bf.scales_send.data_ptr<float>();
    // slice by slice: blocks never cross slices (each owner gets whole blocks)
    for (int64_t j = 0; j < partitions_; j++) {
        const int64_t lo = j * slice_numel;
        kern_->quantize(bits_, block_numel_, slice_numel, src + (size_t)lo * esz, dt,
                        residual ? residual + lo : nullptr, codes + j * (int64_t)slice_bytes,
                        scales + j * slice_blocks);
    }
    const int64_t ns = partitions_ * slice_blocks, nc = partitions_ * (int64_t)slice_bytes;
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
    at::Tensor out = dst.scalar_type() == at::kFloat
                         ? dst
                         : at::empty({slice_numel}, at::TensorOptions().dtype(at::kFloat).device(device_));
    const bool acc_in_kernel = accumulate && dst.scalar_type() == at::kFloat;
    kern_->dequantize_sum(bits_, block_numel_, slice_numel, (int32_t)partitions_, slice_blocks,
                          bf.codes_recv.data_ptr<uint8_t>(), bf.scales_recv.data_ptr<float>(), out.data_ptr<float>(),
                          acc_in_kernel);
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
