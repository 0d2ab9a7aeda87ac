/* qm_ring_params.h - a call ring's request read as session.infer's params
 * (qm_ring_params.c): the daemon's side of qm_ring_wire.h. */
#ifndef QM_RING_PARAMS_H
#define QM_RING_PARAMS_H

#include <stdint.h>

#include "qm_protocol.h"

/* Decodes `copy`, a private copy of a ring's request slot
 * (QM_RING_REQUEST_BYTES; never the shared slot itself), into `out` as the
 * params of a session.infer whose tensors are all mapped and whose output
 * goes to output_to: the JSON decoder's checks with its fields and
 * sentences where the two say the same thing (alignment, routing rules,
 * shapes), and the ring's own for what only it can say (a dtype number,
 * unknown flags). *rung_ns gets the client's stamp. QM_EINVAL with st
 * naming the field; `out` holds no memory either way (qm_request_free is
 * still safe). The session's `session` member is left NULL: a ring belongs
 * to one session. */
int qm_ring_params_decode(const uint8_t *copy, qm_params *out, uint64_t *rung_ns, qm_status *st);

#endif
