/* import_common.h - what every `qmoe-bank import` path shares: element
 * conversions (quantisation is model/qm_quant.h's) and the
 * streaming bank writer (header first, FILE.partial, resume, progress).
 *
 * The writer plans the whole file from a qmi_bank_spec before any weight is
 * read, writes the safetensors header, then takes each layer's tensors as the
 * importer produces them (any order, any slice), so memory stays at what the
 * importer holds for one layer. Layer completion is recorded in a small
 * trailer past the bank's last byte of FILE.partial; finishing rewrites the
 * header's qmoe.source with the measured error (same length), drops the
 * trailer and renames FILE.partial to FILE. */
#ifndef QMOE_IMPORT_COMMON_H
#define QMOE_IMPORT_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"
#include "qm_error.h"
#include "qm_st_header.h"

/* ---- elements ------------------------------------------------------------ */

/* Source element types an importer meets (safetensors names in comments). */
typedef enum qmi_elem {
    QMI_ELEM_F32 = 0, /* F32 */
    QMI_ELEM_F16,     /* F16 */
    QMI_ELEM_BF16,    /* BF16 */
    QMI_ELEM_F8_E4M3, /* F8_E4M3 (e4m3fn: no infinities, 0x7f/0xff NaN) */
    QMI_ELEM_U8,      /* U8 */
    QMI_ELEM_OTHER,
} qmi_elem;

qmi_elem qmi_elem_from_st(const char *st_dtype);
size_t qmi_elem_size(qmi_elem e); /* 0 for QMI_ELEM_OTHER */
const char *qmi_elem_name(qmi_elem e);

float qmi_e4m3_to_f32(uint8_t v);

/* Element i of a float array of type e (F32/F16/BF16/F8_E4M3) as f32. */
float qmi_load(const void *src, qmi_elem e, size_t i);
/* Converts n elements to f32 (unaligned sources are fine). */
void qmi_load_row(const void *src, qmi_elem e, size_t n, float *dst);
/* ---- the bank writer ----------------------------------------------------- */

#define QMI_META_MAX 24

typedef struct qmi_bank_spec {
    uint32_t layers, experts, hidden, inter, k;
    unsigned bits, block_size; /* 4|8; 0 or a power of two >= 16 */
    qm_dtype scale_dtype;      /* fc1/fc2 scales */
    unsigned swiglu_fusion;    /* 0 (unfused: fc3), 1 or 2 */
    qm_activation activation;
    float alpha, beta, limit;
    int normalize_routing;                           /* qmoe.normalize_routing_weights */
    int fc1_bias, fc2_bias;                          /* F32 [E, N] */
    int router_weight, router_bias, correction_bias; /* F32 [E, H], [E], [E] */
    /* Extra metadata (qmoe.layer_map, qmoe.routing.*), borrowed until the
     * writer is freed; qmoe.source is composed by the writer. */
    const char *meta_keys[QMI_META_MAX];
    const char *meta_values[QMI_META_MAX];
    size_t n_meta;
    /* qmoe.source without its closing brace, e.g.
     * {"format":"hf","family":"mixtral","files":["model.safetensors"]
     * The writer appends ,"exact":...,"max_rel_err":...} */
    const char *source_prefix;
} qmi_bank_spec;

/* The per-layer tensors of a bank; router.correction_bias is the extra one. */
enum { QMI_T_CORRECTION_BIAS = QM_T_COUNT, QMI_T_COUNT };

/* ---- the bank's layout, shared with `qmoe-bank create` ------------------- */

/* One tensor of the file being planned. */
typedef struct qmi_planned {
    int present;
    qm_dtype dtype;
    uint32_t ndim;
    uint64_t shape[3];
    uint64_t nbytes, begin; /* begin: from the start of the data */
} qmi_planned;

/* Sets nbytes of every present tensor of t[n] from its dtype and shape. */
void qmi_plan_sizes(qmi_planned *t, int n);
/* Places the present tensors of plan[layers][per_layer] the way
 * tools/qmoebank.py does: wider elements first, so every tensor is aligned
 * to its element size with no holes. Returns the data's bytes. */
uint64_t qmi_plan_place(qmi_planned *plan, uint32_t layers, int per_layer);
/* Lists the present tensors of plan[layers][per_layer], layer by layer, as
 * header entries in tensors[] (room for layers * per_layer) and sets *n.
 * Names are allocated (qm_free each, also after a failure: *n counts
 * them); index QMI_T_CORRECTION_BIAS is router.correction_bias. */
int qmi_plan_header_tensors(const qmi_planned *plan, uint32_t layers, int per_layer,
                            qm_st_tensor *tensors, size_t *n, qm_status *st);

/* The qmoe.* metadata every bank carries, from the spec: QMI_STD_META rows
 * written to meta[], their values kept in v (which must outlive meta). */
#define QMI_STD_META 14
void qmi_std_meta(const qmi_bank_spec *s, char v[12][32], qm_st_meta *meta);

typedef struct qmi_writer qmi_writer;

/* Plans the file and opens out.partial. With resume set and a partial file
 * whose header is byte for byte the one this spec gives, continues it:
 * *first_layer is the first layer not yet recorded complete and *max_rel_err
 * the error measured so far. Otherwise (no partial, or !resume) starts a new
 * one at layer 0; a resume whose partial file does not match fails with
 * QM_ECONFLICT naming why, and leaves the partial alone. `tool` prefixes
 * progress lines ("import hf"). The caller owns *out: qmi_writer_free. */
int qmi_writer_open(const qmi_bank_spec *spec, const char *out, int resume, const char *tool,
                    qmi_writer **out_writer, uint32_t *first_layer, double *max_rel_err,
                    qm_status *st);
/* Bytes of one expert's slice of tensor t (0 when the tensor is absent). */
uint64_t qmi_writer_slice_bytes(const qmi_writer *w, int t);
/* Writes n bytes at byte `at` of layer l's tensor t. */
int qmi_writer_put(qmi_writer *w, uint32_t layer, int t, uint64_t at, const void *buf, uint64_t n,
                   qm_status *st);
/* Records layer l complete (data flushed first), with the error so far; then
 * updates the progress line (source_bytes_done of source_bytes_total).
 * QMOE_IMPORT_KILL_AFTER_LAYERS=N in the environment SIGKILLs the process
 * right after the Nth layer is recorded: the tests' stand-in for a crash. */
int qmi_writer_layer_done(qmi_writer *w, uint32_t layer, double max_rel_err,
                          uint64_t source_bytes_done, uint64_t source_bytes_total, qm_status *st);
/* Turns the progress line on (a terminal, not --quiet); the rate counts from
 * now, bytes_done being what a resumed import had done before. */
void qmi_writer_progress(qmi_writer *w, int on, uint64_t bytes_done);
/* Writes the final qmoe.source (exact, max_rel_err), drops the trailer,
 * renames out.partial to out. */
int qmi_writer_finish(qmi_writer *w, int exact, double max_rel_err, uint64_t *file_bytes,
                      qm_status *st);
/* Closes the writer; keep_partial = 0 unlinks out.partial (a failure that a
 * resume could not continue). Accepts NULL. */
void qmi_writer_free(qmi_writer *w, int keep_partial);

#endif
