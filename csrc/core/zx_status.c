/* zx_status.c — names of status codes and sizes of dtypes (see zx_core.h). */
#include "zx_core.h"

const char *zx_status_string(zx_status s) {
    switch (s) {
    case ZX_OK: return "ok";
    case ZX_ERR_INVALID_ARG: return "invalid argument";
    case ZX_ERR_OUT_OF_MEMORY: return "out of memory";
    case ZX_ERR_UNSUPPORTED: return "unsupported (ISA or dtype not available)";
    case ZX_ERR_OVERFLOW: return "size overflow";
    case ZX_ERR_BUFFER_TOO_SMALL: return "output buffer too small";
    }
    return "unknown status";
}

size_t zx_dtype_size(zx_dtype d) {
    switch (d) {
    case ZX_F32: return 4;
    case ZX_BF16: return 2;
    case ZX_F16: return 2;
    }
    return 0;
}
