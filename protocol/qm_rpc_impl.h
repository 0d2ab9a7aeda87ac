/* qm_rpc_impl.h - private to protocol/: what the envelope decoder shares with
 * the per-method params decoders. Includes cJSON; never include it outside
 * protocol/. */
#ifndef QM_RPC_IMPL_H
#define QM_RPC_IMPL_H

#include <cJSON.h>

#include "qm_protocol.h"

/* Validates `params` (an object, or NULL when absent) for method `m` into
 * `out`. On failure returns QM_EINVAL (st names the field) or QM_ENOMEM;
 * whatever was filled stays in `out` for qm_request_free. */
int qm__params_decode(qm_method m, const cJSON *params, qm_params *out, qm_status *st);

/* session.infer's rules between its tensors (routing supplied by the engine
 * against router_logits, token counts, topk shapes), and a mapped region's
 * alignment (path "hidden": field "hidden.offset"): the JSON decoder's and
 * the call ring's (qm_ring_params.c), so both transports answer alike;
 * qm_params.c. */
int qm__infer_shapes_check(const qm_params *p, qm_status *st);

/* The budget's rows (qm_budget_param.c): `budget`'s value (a positive
 * integer, or a string of qm_budget_parse) into out->budget; then the rule
 * across it and budget_bytes: not both (0), or one of them (1, resize),
 * has_budget and budget_bytes set for whichever was given. QM_EINVAL
 * naming the member. */
int qm__decode_budget(const cJSON *v, qm_params *out, qm_status *st);
int qm__check_budget0(const cJSON *v, qm_params *out, qm_status *st);
int qm__check_budget1(const cJSON *v, qm_params *out, qm_status *st);
int qm__map_offset_check(const char *path, uint64_t offset, qm_status *st);

/* Releases what the rows of method m landed in p (strings, tensors, the
 * hot list), walking the same rows the decoder walks. */
void qm__params_free(qm_method m, qm_params *p);

/* 1 when s[0..n) is well-formed UTF-8 (no surrogates, no overlongs);
 * qm_frame.c. */
int qm__utf8_valid(const char *s, size_t n);
/* "a string", "an array", ... for messages; qm_params.c. */
const char *qm__json_type_name(const cJSON *v);

#endif
