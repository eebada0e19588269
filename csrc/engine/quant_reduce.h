// quant_reduce.h — quantized gradient reduce-scatter by all-to-all (grad_quant).
//
// Note [Quantized gradient reduction]
//   With grad_quant = int8/int4 a bucket's padded gradient (parts slices of
//   slice_numel elements, reduce_dtype) is not sent as values: each slice j is
//   quantized on its own (zx_quantize: whole blocks of block_numel elements, one
//   fp32 scale each, padded per slice) into codes + scales, and two equal-split
//   all-to-alls (codes as bytes, scales as floats) move slice j to rank j. The
//   owner then sums the N dequantized slices in fp32 in rank order, straight into
//   its gradient shard (zx_dequantize_sum). Every element is quantized exactly
//   once per step, by its producer; nothing is re-quantized on the way (a ring
//   reduce-scatter would quantize once per hop). An inf/NaN gradient makes its
//   block's scale NaN, so the owner's sum is NaN there and the fp16 inf/nan scan
//   skips the step as without quantization.
//   Error feedback (grad_quant_error_feedback): each rank keeps, per bucket, the
//   fp32 residual of what it sent (padded_numel floats, reported in stats() as
//   buffer_bytes.quant_residual) and adds it to the next step's gradient before
//   quantizing (zx_quantize's residual argument); a block with inf/NaN keeps its
//   residual.
//   Counted in stats()["comm"]["reduce_scatter"]: `bytes` stays the logical size
//   (the bucket in reduce_dtype, as an exact run counts it), `wire_bytes` is what
//   the two all-to-alls carry: parts * (codes + 4 * scales) per bucket.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "core/zx_core.h"
#include "engine/comm.h"      // defines: Communicator, WorkPtr
#include "engine/kernels.h"   // defines: Kernels

namespace zx {

class QuantReduce {
public:
    // bits: 0 (off), 8 or 4. block_numel: elements per scale (even).
    // kern: the engine's kernel table (its device holds every buffer here).
    QuantReduce(int32_t bits, int64_t block_numel, bool error_feedback, Kernels *kern, at::Device device,
                int64_t parts);

    bool enabled() const { return bits_ != 0; }

    // Quantize bucket b's padded gradient `send` (parts * slice_numel elements of
    // reduce_dtype, on the table's device) through the buffers of ring slot `slot`, start the scales'
    // and the codes' all-to-alls and return the codes' one (wait on it, then finish()).
    WorkPtr launch(Communicator &comm, int64_t b, const at::Tensor &send, int64_t slice_numel, int64_t slot);

    // After the codes' all-to-all of slot `slot` is done: wait for its scales (with
    // `wait`), then dst (slice_numel, fp32 or the reduce dtype) = (accumulate ? dst : 0)
    // + the sum of the N dequantized slices.
    void finish(int64_t slot, int64_t slice_numel, at::Tensor dst, bool accumulate);

    int64_t buffer_bytes() const;      // codes/scales send + receive buffers of all slots
    int64_t residual_bytes() const;    // error-feedback residuals of all buckets

private:
    struct Buffers {
        at::Tensor codes_send, codes_recv;    // (parts * slice bytes,) uint8
        at::Tensor scales_send, scales_recv;  // (parts * slice blocks,) fp32
        WorkPtr scales_work;                  // the scales' all-to-all in flight
    };
    Buffers &buffers(int64_t slot, int64_t codes_bytes, int64_t nscales);

    int32_t bits_;
    int64_t block_numel_;
    bool error_feedback_;
    Kernels *kern_;
    at::Device device_;
    int64_t partitions_;
    std::vector<Buffers> slots_;          // parallel to the engine's ring slots
    std::vector<at::Tensor> residual_;    // per bucket, (padded_numel,) fp32, when error_feedback
};

}  // namespace zx
