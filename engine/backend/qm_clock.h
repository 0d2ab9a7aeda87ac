/* qm_clock.h - the engine's monotonic clock, for timings that feed
 * statistics and models (never results). Private to engine/. */
#ifndef QM_CLOCK_H
#define QM_CLOCK_H

#include <stdint.h>

/* Microseconds on CLOCK_MONOTONIC (truncated). */
uint64_t qm__now_us(void);

#endif
