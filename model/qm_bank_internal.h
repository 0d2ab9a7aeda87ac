/* qm_bank_internal.h - shared between the model/ sources only. */
#ifndef QM_BANK_INTERNAL_H
#define QM_BANK_INTERNAL_H

#include "qm_bank.h"
#include "qm_st_header.h"

/* Metadata bounds: large enough for any real MoE, small enough that every
 * product of them fits comfortably in 64 bits. */
#define QM_BANK_MAX_LAYERS 65536u
#define QM_BANK_MAX_EXPERTS 65536u
#define QM_BANK_MAX_DIM (1u << 20)

/* Frees a header's lists as qm_st_header_free does (each tensor's name,
 * each metadata key and value, both arrays), for holders of such lists
 * outside a qm_st_header (the bank writer). */
void qm__st_lists_free(qm_st_tensor *tensors, size_t n_tensors, qm_st_meta *meta,
                       size_t n_meta);

int qm__dtype_from_st(const char *st_name, qm_dtype *out);
const char *qm__dtype_st_name(qm_dtype dtype);
int qm__parse_tensor_name(const char *name, uint32_t n_layers, uint32_t *layer,
                          qm_bank_tensor *t);
int qm__config_from_metadata(const qm_st_header *h, qm_bank_config *cfg, qm_status *st);
int qm__gated_fused(const qm_bank_config *cfg);
int qm__needs_fc3(const qm_bank_config *cfg);
/* Checks dtype and shape of layer tensor `t` against cfg; message names `name`. */
int qm__check_layer_tensor(const qm_bank_config *cfg, const char *name, qm_bank_tensor t,
                           const qm_tensor_view *tv, qm_status *st);
/* qm_bank_meta.c: the keys of imported banks. Routing keys into cfg->routing
 * (cfg's other fields already filled); layer map into *map (caller frees,
 * NULL when absent); qmoe.source checked to be a JSON object of the known
 * fields, and into *compact (caller frees, NULL when absent) as one line
 * of compact JSON in well-formed UTF-8. QM_EINVALID_MODEL naming the key
 * on any violation. */
int qm__routing_from_metadata(const qm_st_header *h, qm_bank_config *cfg, qm_status *st);
int qm__layer_map_from_metadata(const qm_st_header *h, uint32_t layers, uint32_t **map,
                                qm_status *st);
int qm__source_check(const qm_st_header *h, char **compact, qm_status *st);
void qm__format_shape(char *buf, size_t size, const uint64_t *shape, uint32_t ndim);

/* qm_st_header.c: the scan every JSON text of an untrusted file gets before
 * cJSON sees it (a header of a million '[' must cost a scan, not a stack;
 * cJSON would silently cut a string at an escaped NUL). 0, or one of these
 * with *at the byte where it was found. */
enum { QM__JSON_TOO_DEEP = 1, QM__JSON_ESCAPED_NUL = 2 };
int qm__json_prescan(const char *s, size_t len, int max_depth, size_t *at);

#endif
