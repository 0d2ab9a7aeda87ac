/* qm_clock.c - see qm_clock.h. */
#include "qm_clock.h"

#include <time.h>

uint64_t qm__now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}
