/* check.h — the core tests' one assertion: CHECK(cond, printf-style message).
 * Counts passes and failures (g_passed, g_failed; main prints them and exits 1 on
 * any failure) and reports the first 40 failures with file and line. */
#ifndef ZX_TESTS_CHECK_H
#define ZX_TESTS_CHECK_H

#include <stdio.h>

static long g_passed, g_failed;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) {                                                       \
            g_passed++;                                                   \
        } else {                                                          \
            g_failed++;                                                   \
            if (g_failed <= 40) {                                         \
                fprintf(stderr, "FAIL %s:%d: CHECK(%s): ", __FILE__, __LINE__, #cond); \
                fprintf(stderr, __VA_ARGS__);                             \
                fputc('\n', stderr);                                      \
            }                                                             \
        }                                                                 \
    } while (0)

#endif /* ZX_TESTS_CHECK_H */
