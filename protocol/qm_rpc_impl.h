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

/* session.create's and session.resize's budget (qm_budget_param.c): `budget`
 * or `budget_bytes`, one of them, into out->budget (and has_budget,
 * budget_bytes for bytes). QM_EINVAL naming the member. */
int qm__params_budget(const cJSON *params, int required, qm_params *out, qm_status *st);

/* 1 when s[0..n) is well-formed UTF-8 (no surrogates, no overlongs). */
int qm__utf8_valid(const char *s, size_t n);
/* "a string", "an array", ... for messages. */
const char *qm__json_type_name(const cJSON *v);

#endif
