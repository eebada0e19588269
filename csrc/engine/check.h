// check.h — the C core's statuses and ISA names on the C++ side (engine and bindings).
//
//   zx_check(s, what)    throws a c10::Error (Python RuntimeError) for a non-OK zx_status
//   parse_isa(name)      "scalar" / "avx2" / "avx512" -> zx_isa (throws otherwise)
//   plan_fragments(plan, b, r)  rank r's fragments of bucket b, as the plan lists them
//   plan_pieces(plan, i)        parameter i's pieces (one, or several when it is cut)
#pragma once

#include <c10/util/Exception.h>   // TORCH_CHECK

#include <string>
#include <vector>

#include "core/zx_core.h"

// Turn a non-OK status from the C core into an exception naming the call.
inline void zx_check(zx_status s, const char *what) {
    TORCH_CHECK(s == ZX_OK, "zero_ext: ", what, " failed: ", zx_status_string(s));
}

// An ISA name as zx_isa_name() spells it. ("auto" is the caller's to resolve,
// with zx_cpu_best_isa().)
inline zx_isa parse_isa(const std::string &name) {
    if (name == "scalar") return ZX_ISA_SCALAR;
    if (name == "avx2") return ZX_ISA_AVX2;
    if (name == "avx512") return ZX_ISA_AVX512;
    TORCH_CHECK(false, "zero_ext: unknown isa '", name,
                "'; use 'scalar', 'avx2', 'avx512' (or 'auto' where accepted)");
    return ZX_ISA_SCALAR;  // not reached
}

// Rank r's fragments of bucket b (zx_plan_fragments: count, then fill).
inline std::vector<zx_fragment> plan_fragments(const zx_plan *plan, int64_t b, int32_t r) {
    int64_t count = 0;
    zx_plan_fragments(plan, b, r, nullptr, 0, &count);
    std::vector<zx_fragment> fr((size_t)count);
    zx_check(zx_plan_fragments(plan, b, r, fr.data(), count, &count), "reading the plan");
    return fr;
}

// Parameter i's pieces in bucket order (zx_plan_param_pieces: count, then fill).
inline std::vector<zx_piece> plan_pieces(const zx_plan *plan, int64_t i) {
    int64_t count = 0;
    zx_plan_param_pieces(plan, i, nullptr, 0, &count);
    std::vector<zx_piece> pieces((size_t)count);
    zx_check(zx_plan_param_pieces(plan, i, pieces.data(), count, &count), "reading the plan");
    return pieces;
}
