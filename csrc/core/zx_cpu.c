/* zx_cpu.c — run-time instruction-set detection for the CPU kernels.
 *
 * Asks the CPU (through the compiler's __builtin_cpu_supports, which also checks
 * that the OS saves the wide registers) every time; there is no cached state. The
 * caller keeps the chosen zx_isa in its handle (STYLE: no globals).
 *
 * Note [ISA cap]
 *   ZX_ISA=scalar|avx2|avx512 in the environment caps what this CPU is said to
 *   support, as ATEN_CPU_CAPABILITY does for torch: with ZX_ISA=avx2 an AVX-512
 *   machine runs every kernel (isa="auto", best_isa(), isa_supported()) as an
 *   AVX2-only one would, so the suite can be run as on such a machine:
 *     ATEN_CPU_CAPABILITY=avx2 ZX_ISA=avx2 python -m pytest tests
 *   Unset, empty or any other value: no cap. It is read on every call (no cached
 *   state); a cap never adds an ISA the CPU lacks.
 */
#include "zx_kernels_internal.h"

#include <stdlib.h>
#include <string.h>

/* The widest ISA ZX_ISA allows (Note [ISA cap]); ZX_ISA_AVX512 when unset. */
static zx_isa isa_cap(void) {
    const char *env = getenv("ZX_ISA");
    if (env == NULL) return ZX_ISA_AVX512;
    if (strcmp(env, "scalar") == 0) return ZX_ISA_SCALAR;
    if (strcmp(env, "avx2") == 0) return ZX_ISA_AVX2;
    return ZX_ISA_AVX512;
}

int zx_cpu_supports(zx_isa isa) {
    if ((int)isa > (int)isa_cap()) return 0;
    switch (isa) {
    case ZX_ISA_SCALAR:
        return 1;
#if ZX_HAVE_X86_SIMD
    case ZX_ISA_AVX2:
        __builtin_cpu_init();  /* idempotent; needed if we run before constructors */
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case ZX_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#endif
    default:
        return 0;  /* an ISA this build cannot run, or not an ISA at all */
    }
}

zx_isa zx_cpu_best_isa(void) {
    if (zx_cpu_supports(ZX_ISA_AVX512)) return ZX_ISA_AVX512;
    if (zx_cpu_supports(ZX_ISA_AVX2)) return ZX_ISA_AVX2;
    return ZX_ISA_SCALAR;
}

const char *zx_isa_name(zx_isa isa) {
    switch (isa) {
    case ZX_ISA_SCALAR: return "scalar";
    case ZX_ISA_AVX2: return "avx2";
    case ZX_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

int zx_cpu_has_avx512_bf16(void) {
#if ZX_HAVE_X86_SIMD
    if (!zx_cpu_supports(ZX_ISA_AVX512)) return 0;
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return 0;
#endif
}
