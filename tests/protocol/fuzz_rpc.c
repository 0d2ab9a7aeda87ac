/* fuzz_rpc.c - libFuzzer: arbitrary bytes through the framer (split into
 * pieces of at most 143 bytes, as a socket would deliver them), JSON-RPC
 * decoding with small limits, every method's params validation, and error
 * encoding of whatever comes out.
 *
 * Every byte goes through the framer, but only the first MAX_FRAMES frames
 * of one input are decoded and answered. Frames are independent (decoding
 * keeps no state between them), so a later frame only repeats paths an
 * earlier one reaches; without the cap the fuzzer grew inputs of ~800
 * one-byte frames (each answered with a ~140-byte error) because higher
 * hit counts count as new features, and ran at ~500 exec/s.
 *
 * The framer's cap is above the decoder's and both are below libFuzzer's
 * default max_len (4096), so both "too large" paths are reachable.
 *
 * Every answer must be what any client reads: one line (no raw newline) of
 * JSON that parses, in well-formed UTF-8 (an error message quotes the
 * peer's bytes, and may be cut inside a character). */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qm_json.h"
#include "qm_protocol.h"

static void check_answer(const qm_buf *out)
{
    for (size_t i = 0; i < out->len;) {
        size_t n = qm_utf8_valid_len((const unsigned char *)out->data + i, out->len - i);
        if (!n || out->data[i] == '\n')
            abort();
        i += n;
    }
    cJSON *j = cJSON_ParseWithLength(out->data, out->len);
    if (!j)
        abort();
    cJSON_Delete(j);
}

#define MAX_FRAMES 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    qm_proto_limits lim = {.max_request_bytes = 1536, .max_nesting = 16, .max_batch = 8};
    qm_framer f;
    qm_framer_init(&f, 2048);
    size_t frames = 0;
    qm_buf out;
    qm_buf_init(&out);
    size_t chunk = size ? (size_t)data[0] % 143 + 1 : 1;
    for (size_t off = 0; off < size; off += chunk) {
        size_t n = size - off < chunk ? size - off : chunk;
        if (qm_framer_push(&f, (const char *)data + off, n) < 0)
            break;
        const char *line;
        size_t len;
        int rc;
        while ((rc = qm_framer_next(&f, &line, &len)) == 1) {
            if (++frames > MAX_FRAMES)
                continue;
            qm_rpc_frame frame;
            if (qm_rpc_decode(line, len, &lim, &frame) < 0)
                continue;
            for (size_t i = 0; i < frame.n; i++) {
                qm_rpc_item *it = &frame.items[i];
                qm_jw w;
                qm_buf_reset(&out);
                qm_jw_init(&w, &out);
                if (it->ok) {
                    qm_rpc_result_begin(&w, it->req.id);
                    if (it->req.params.hidden.data)
                        qm_jw_tensor(&w, it->req.params.hidden.dtype, it->req.params.hidden.ndim,
                                     it->req.params.hidden.shape, it->req.params.hidden.data);
                    else
                        qm_jw_str(&w, qm_method_name(it->req.method));
                    qm_rpc_result_end(&w);
                } else {
                    qm_rpc_error(&w, it->req.id, it->rpc_code, it->status.msg, it->status.field);
                }
                if (!out.oom)
                    check_answer(&out);
            }
            qm_rpc_frame_free(&frame);
        }
        if (rc < 0)
            break;
    }
    qm_buf_free(&out);
    qm_framer_free(&f);
    return 0;
}
