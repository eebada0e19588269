// quant_gather.cpp — quantized parameter all-gather: see
// Note [Quantized parameter gather] in quant_gather.h.
#include "engine/quant_gather.h"

#include "engine/check.h"      // defines: zx_check

namespace zx {

namespace {

zx_dtype zx_dtype_of(at::ScalarType t) {
    if (t == at::kFloat) return ZX_F32;
    if (t == at::kBFloat16) return ZX_BF16;
    TORCH_CHECK(t == at::kHalf, "zero_ext: internal: param_quant dequantizes into float32, bfloat16 or float16, "
                "not ", t);
    return ZX_F16;
}

}  // namespace

QuantGather::QuantGather(int32_t bits, int64_t block_numel, Kernels *kern, at::Device device, int64_t parts)
    : bits_(bits), block_numel_(block_numel), kern_(kern), device_(device), partitions_(parts) {
    TORCH_CHECK(bits == 8, "zero_ext: param_quant must be int8 (the supported bit width); pass param_quant='int8' "
                "or None");
    TORCH_CHECK(block_numel >= 2 && block_numel % 2 == 0, "zero_ext: quant_block_numel must be even and >= 2, got ",
                block_numel, "; pass an even quant_block_numel (the default is 256)");
}

int64_t QuantGather::slice_blocks(int64_t slice_numel) const {
    return (int64_t)zx_quant_blocks((size_t)slice_numel, (size_t)block_numel_);
}

int64_t QuantGather::record_bytes(int64_t slice_numel) const {
    size_t codes = 0;
    zx_check(zx_quant_bytes(bits_, (size_t)block_numel_, (size_t)slice_numel, &codes), "param_quant sizes");
    // scales first (4-byte aligned at every record start), codes padded to 4 bytes
    return 4 * slice_blocks(slice_numel) + (((int64_t)codes + 3) & ~(int64_t)3);
}

// record: [scales][codes][pad], a uint8 tensor on the table's device.
void QuantGather::quantize_into(const at::Tensor &master, at::Tensor record) const {
    TORCH_CHECK(master.scalar_type() == at::kFloat && master.is_contiguous() && master.device() == device_,
                "zero_ext: internal: param_quant quantizes a contiguous float32 master slice on ", device_);
    const int64_t n = master.numel(), nb = slice_blocks(n);
    uint8_t *r = record.data_ptr<uint8_t>();
    kern_->quantize(bits_, block_numel_, n, master.data_ptr<float>(), ZX_F32, nullptr, r + 4 * nb,
                    reinterpret_cast<float *>(r));
}

void QuantGather::dequantize_from(const at::Tensor &record, int64_t slice_numel, at::Tensor dst) const {
    const int64_t nb = slice_blocks(slice_numel);
    const uint8_t *r = record.data_ptr<uint8_t>();
    kern_->dequantize(bits_, block_numel_, slice_numel, r + 4 * nb, reinterpret_cast<const float *>(r),
                      dst.data_ptr(), zx_dtype_of(dst.scalar_type()));
}

WorkPtr QuantGather::launch(Communicator &comm, int64_t b, const at::Tensor &master, at::Tensor dst) {
    const int64_t n = master.numel(), rb = record_bytes(n);
    TORCH_CHECK(dst.numel() == partitions_ * n && dst.is_contiguous(), "zero_ext: internal: param_quant gathers ",
                partitions_, " slices of ", n, " elements into a contiguous bucket");
    TORCH_CHECK(!pending_.count(b), "zero_ext: internal: bucket ", b, " already has a quantized gather in flight");
    Pending p;
    const auto u8 = at::TensorOptions().dtype(at::kByte).device(device_);
    p.send = at::zeros({rb}, u8);   // the 4-byte padding is sent too: keep it defined
    p.recv = at::empty({partitions_ * rb}, u8);
    p.dst = dst;
    quantize_into(master, p.send);
    held_ += p.send.nbytes() + p.recv.nbytes();
    peak_ = std::max(peak_, held_);
    WorkPtr work = comm.all_gather_quantized(p.recv, p.send, dst.numel(), dst.element_size());
    pending_.emplace(b, std::move(p));
    return work;
}

void QuantGather::finish(int64_t b) {
    auto it = pending_.find(b);
    if (it == pending_.end()) return;
    Pending &p = it->second;
    const int64_t n = p.dst.numel() / partitions_, rb = p.send.numel();
    for (int64_t j = 0; j < partitions_; j++)
        dequantize_from(p.recv.narrow(0, j * rb, rb), n, p.dst.narrow(0, j * n, n));
    held_ -= p.send.nbytes() + p.recv.nbytes();
    pending_.erase(it);
}

void QuantGather::finish_all() {
    while (!pending_.empty()) finish(pending_.begin()->first);
}

at::Tensor QuantGather::roundtrip(const at::Tensor &master, at::ScalarType dtype) const {
    const at::Tensor m = master.contiguous();
    at::Tensor record = at::zeros({record_bytes(m.numel())}, at::TensorOptions().dtype(at::kByte).device(device_));
    quantize_into(m, record);
    at::Tensor out = at::empty({m.numel()}, at::TensorOptions().dtype(dtype).device(device_));
    dequantize_from(record, m.numel(), out);
    return out;
}

}  // namespace zx
