// gather_meter.h — the bytes of gathered parameters held right now (stage 3 units,
// coalesced-gather staging, fp32 values while initializing) and the most held at once,
// for stats() (buffer_bytes: gathered_params, peak_gathered_params). The peak is taken
// where the engine says (note_peak), after a gather's buffers are all counted.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zx {

class GatherMeter {
public:
    void add(int64_t bytes) { now_ += bytes; }
    void sub(int64_t bytes) { now_ -= bytes; }
    void note_peak() { peak_ = std::max(peak_, now_); }
    void reset_peak() { peak_ = 0; }
    int64_t now() const { return now_; }
    int64_t peak() const { return peak_; }

private:
    int64_t now_ = 0, peak_ = 0;
};

}  // namespace zx
