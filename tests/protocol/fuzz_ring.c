/* fuzz_ring.c - libFuzzer: a call ring's request slot (protocol/qm_ring_wire.h)
 * through the daemon's decoder (qm_ring_params_decode), and the answer
 * slot through the client's reader. The slot is shared memory a client can
 * fill with anything: whatever decodes must be a session.infer the rest of
 * the daemon can trust (every tensor mapped, 2-D, aligned, its byte size
 * exact; routing rules kept), whatever does not must be an invalid_params
 * naming its field; the codecs must read back what they wrote. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qm_protocol.h"
#include "qm_ring_params.h"
#include "qm_ring_wire.h"

static void check_tensor(const qm_tensor *t, int i32)
{
    if (!t->mapped || t->data || t->ndim != 2 || t->offset % QM_MAP_ALIGN)
        abort();
    if ((t->dtype == QM_WIRE_I32) != i32)
        abort();
    unsigned long long n;
    if (__builtin_mul_overflow((unsigned long long)t->shape[0], t->shape[1], &n) ||
        __builtin_mul_overflow(n, (unsigned long long)qm_wire_dtype_size(t->dtype), &n) ||
        n != t->nbytes)
        abort();
}

static void check_decoded(const qm_params *p)
{
    check_tensor(&p->hidden, 0);
    if (!p->has_output_to || p->output_offset % QM_MAP_ALIGN)
        abort();
    if (p->has_router_logits) {
        check_tensor(&p->router_logits, 0);
        if (p->has_topk || p->router_logits.shape[0] != p->hidden.shape[0])
            abort();
    }
    if (p->has_topk) {
        check_tensor(&p->topk_ids, 1);
        check_tensor(&p->topk_weights, 0);
        const uint64_t *is = p->topk_ids.shape, *ws = p->topk_weights.shape;
        if (is[0] != p->hidden.shape[0] || is[1] == 0 || ws[0] != is[0] || ws[1] != is[1])
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t slot[QM_RING_REQUEST_BYTES] = {0};
    memcpy(slot, data, size < sizeof slot ? size : sizeof slot);
    qm_params p;
    qm_status st;
    qm_status_clear(&st);
    uint64_t rung;
    int rc = qm_ring_params_decode(slot, &p, &rung, &st);
    if (rc == 0)
        check_decoded(&p);
    else if (rc != QM_EINVAL || st.code != QM_EINVAL || !st.field[0] || !st.msg[0])
        abort();
    qm_request req = {.method = QM_METHOD_SESSION_INFER, .params = p};
    qm_request_free(&req);

    /* The request codec reads back what it writes. */
    qm_ring_request r, again;
    qm_ring_request_read(slot, &r);
    uint8_t out[QM_RING_REQUEST_BYTES];
    qm_ring_request_write(out, &r);
    qm_ring_request_read(out, &again);
    if (memcmp(&r, &again, sizeof r) != 0)
        abort();

    /* Any answer slot reads into strings that end inside their fields. */
    uint8_t ans[QM_RING_ANSWER_BYTES] = {0};
    memcpy(ans, data, size < sizeof ans ? size : sizeof ans);
    qm_ring_answer a, b;
    qm_ring_answer_read(ans, &a);
    if (strnlen(a.field, sizeof a.field) == sizeof a.field ||
        strnlen(a.reason, sizeof a.reason) == sizeof a.reason)
        abort();
    qm_ring_answer_write(ans, &a);
    qm_ring_answer_read(ans, &b);
    if (a.code != b.code || memcmp(a.stats, b.stats, sizeof a.stats) ||
        (a.code && (strcmp(a.field, b.field) || strcmp(a.reason, b.reason))))
        abort();
    return 0;
}
