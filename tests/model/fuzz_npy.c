/* fuzz_npy.c - libFuzzer over the .npy reader. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qm_npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    qm_npy npy;
    qm_status st;
    if (qm_npy_parse(buf, size, &npy, &st) == 0) {
        if (npy.nbytes != npy.count * qm_npy_dtype_size(npy.dtype))
            abort();
        qm_npy_free(&npy);
    }
    free(buf);
    return 0;
}
