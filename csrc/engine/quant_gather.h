// quant_gather.h — quantized parameter all-gather (param_quant).
//
// Note [Quantized parameter gather]
//   With param_quant = int8 a bucket's parameters are not gathered as values:
//   each rank quantizes its slice of the fp32 master (slice_numel elements;
//   zx_quantize in whole blocks of block_numel elements, one fp32 scale each,
//   padded per slice, so blocks never cross slices) into one packed record,
//       [scales: slice_blocks fp32][codes: slice_blocks * block_numel int8][pad to 4 bytes]
//   one all-gather moves every rank's record to every rank, and every rank, the
//   owner included, dequantizes all N records into the full bucket (flat_param,
//   in param_dtype). So all ranks compute with the same dequantized values, bit
//   for bit (the kernels are deterministic and every ISA is bit-identical), and
//   each element is within half a quantization step of its master (plus the
//   rounding to param_dtype). The fp32 master itself is never replaced by its
//   dequantized value: stages 1/2 then keep a separate fp32 master shard even
//   with fp32 parameters (the owned slice of flat_param is no longer the master),
//   stage 3 quantizes its persistent master shard at every unit gather (forward
//   and backward re-gather). Edits of gathered parameters (gathered_parameters)
//   are folded into the master only where an element differs from what the
//   gather produced (roundtrip()).
//   Counted in stats()["comm"]["all_gather"]: `bytes` stays the logical size
//   (the gathered bucket in param_dtype, as an exact run counts it), `wire_bytes`
//   is the N records. The records live only while a gather is in flight
//   (buffer_bytes.quant_gather_buffers reports the most held at once).
#pragma once

#include <ATen/ATen.h>

#include <map>

#include "core/zx_core.h"
#include "engine/comm.h"      // defines: Communicator, WorkPtr
#include "engine/kernels.h"   // defines: Kernels

namespace zx {

class QuantGather {
public:
    // bits: 8. block_numel: elements per scale (even).
    // kern: the engine's kernel table (its device holds every buffer here).
    QuantGather(int32_t bits, int64_t block_numel, Kernels *kern, at::Device device, int64_t parts);

    // Quantize `master` (this rank's fp32 slice of bucket b) and start the
    // all-gather of every rank's record; `dst` (parts * slice, param dtype) is
    // filled by finish(b) once the returned work is done.
    WorkPtr launch(Communicator &comm, int64_t b, const at::Tensor &master, at::Tensor dst);
    // After bucket b's work is done: dequantize the N records into its dst and
    // drop the records. Nothing to do when b has no gather pending.
    void finish(int64_t b);
    void finish_all();
    // What a gather makes of `master` (a whole fp32 slice): its dequantized value in dtype.
    at::Tensor roundtrip(const at::Tensor &master, at::ScalarType dtype) const;

    int64_t buffer_bytes() const { return held_; }        // records held now
    int64_t peak_buffer_bytes() const { return peak_; }   // most held at once

private:
    struct Pending {
        at::Tensor send, recv;   // one record / N records, uint8
        at::Tensor dst;
    };
    int64_t slice_blocks(int64_t slice_numel) const;
    int64_t record_bytes(int64_t slice_numel) const;
    void quantize_into(const at::Tensor &master, at::Tensor record) const;
    void dequantize_from(const at::Tensor &record, int64_t slice_numel, at::Tensor dst) const;

    int32_t bits_;
    int64_t block_numel_;
    Kernels *kern_;
    at::Device device_;
    int64_t partitions_;
    std::map<int64_t, Pending> pending_;   // bucket -> its gather in flight
    int64_t held_ = 0, peak_ = 0;
};

}  // namespace zx
