/* qm_ring_params.c - a call ring's request as session.infer's params
 * (qm_ring_params.h). Reads only the caller's copy of the slot. */
#include "qm_ring_params.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"
#include "qm_ring_wire.h"
#include "qm_rpc_impl.h"

#define QM__RING_FLOAT 1u
#define QM__RING_I32 2u

/* The field names are written only for an error: a call decodes in well
 * under a microsecond. */
static int ring_tensor(const qm_ring_tensor *w, const char *path, unsigned dtypes, qm_tensor *out,
                       qm_status *st)
{
    char field[64];
    memset(out, 0, sizeof *out);
    int is_float = w->dtype <= QM_WIRE_BF16, is_i32 = w->dtype == QM_WIRE_I32;
    if (!((dtypes & QM__RING_FLOAT) && is_float) && !((dtypes & QM__RING_I32) && is_i32)) {
        snprintf(field, sizeof field, "%s.dtype", path);
        if (dtypes == QM__RING_I32)
            return qm_status_set_field(st, QM_EINVAL, field, "%s is %u; it must be i32 (3)",
                                       field, w->dtype);
        return qm_status_set_field(st, QM_EINVAL, field,
                                   "%s is %u; it must be f32 (0), f16 (1) or bf16 (2)", field,
                                   w->dtype);
    }
    out->dtype = (qm_wire_dtype)w->dtype;
    out->ndim = 2;
    out->shape[0] = w->rows;
    out->shape[1] = w->cols;
    unsigned long long count, nbytes;
    int count_over = qm_mul_u64(w->rows, w->cols, &count) < 0;
    if (count_over || qm_mul_u64(count, qm_wire_dtype_size(out->dtype), &nbytes) < 0) {
        snprintf(field, sizeof field, "%s.shape", path);
        return qm_status_set_field(st, QM_EINVAL, field, "%s: %s overflows 64 bits", field,
                                   count_over ? "element count" : "byte size");
    }
    out->nbytes = nbytes;
    out->mapped = 1;
    out->map = w->map;
    out->offset = w->offset;
    return w->offset % QM_MAP_ALIGN ? qm__map_offset_check(path, w->offset, st) : 0;
}

int qm_ring_params_decode(const uint8_t *copy, qm_params *out, uint64_t *rung_ns, qm_status *st)
{
    qm_ring_request r;
    memset(out, 0, sizeof *out);
    qm_ring_request_read(copy, &r);
    *rung_ns = r.rung_ns;
    const uint32_t known = QM_RING_F_ROUTER_LOGITS | QM_RING_F_TOPK;
    if (r.flags & ~known)
        return qm_status_set_field(st, QM_EINVAL, "flags",
                                   "flags is 0x%x; only router_logits (0x1) and topk (0x2) "
                                   "exist",
                                   r.flags);
    out->layer = r.layer;
    int rc = ring_tensor(&r.hidden, "hidden", QM__RING_FLOAT, &out->hidden, st);
    if (rc == 0 && (r.flags & QM_RING_F_ROUTER_LOGITS)) {
        out->has_router_logits = 1;
        rc = ring_tensor(&r.router_logits, "router_logits", QM__RING_FLOAT, &out->router_logits,
                         st);
    }
    if (rc == 0 && (r.flags & QM_RING_F_TOPK)) {
        out->has_topk = 1;
        rc = ring_tensor(&r.topk_ids, "topk_ids", QM__RING_I32, &out->topk_ids, st);
        if (rc == 0)
            rc = ring_tensor(&r.topk_weights, "topk_weights", QM__RING_FLOAT, &out->topk_weights,
                             st);
    }
    if (rc == 0)
        rc = qm__infer_shapes_check(out, st);
    if (rc == 0 && r.output_offset % QM_MAP_ALIGN)
        rc = qm__map_offset_check("output_to", r.output_offset, st);
    out->has_output_to = 1;
    out->output_map = r.output_map;
    out->output_offset = r.output_offset;
    return rc;
}
