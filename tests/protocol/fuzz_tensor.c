/* fuzz_tensor.c - libFuzzer: the base64 codec and the tensor decoder. Raw
 * bytes must survive decode; whatever decodes must re-encode to the input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qm_protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *dec = malloc(size + 1);
    size_t n;
    if (qm_base64_decode((const char *)data, size, dec, size, &n) == 0) {
        char *enc = malloc(qm_base64_encoded_len(n) + 1);
        qm_base64_encode(dec, n, enc);
        if (qm_base64_encoded_len(n) != size)
            abort();
        /* Non-canonical trailing bits decode leniently, so compare decodes. */
        uint8_t *again = malloc(n + 1);
        size_t m;
        if (qm_base64_decode(enc, size, again, n, &m) != 0 || m != n || memcmp(again, dec, n))
            abort();
        free(again);
        free(enc);
    }
    free(dec);
    qm_tensor t;
    qm_status st;
    if (qm_tensor_decode_json((const char *)data, size, &t, &st) == 0) {
        uint64_t count = 1;
        for (uint32_t i = 0; i < t.ndim; i++)
            count *= t.shape[i];
        if (count * qm_wire_dtype_size(t.dtype) != t.nbytes)
            abort();
    }
    qm_tensor_free(&t);
    return 0;
}
