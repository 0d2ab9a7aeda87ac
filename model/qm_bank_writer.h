/* qm_bank_writer.h - writing a bank file: the one writer of `qmoe-bank
 * create`, `import hf` and `import gguf`.
 *
 * The caller plans every tensor (dtype, shape) and the metadata before any
 * weight exists; the writer places the tensors (wider elements first, so
 * every tensor is aligned to its element size with no holes), checks that
 * the header it will write passes the bank loader (qm_bank_open_memory), and
 * only then creates OUT.partial. Tensor bytes arrive in any order and any
 * slice (qm_bank_writer_put), so memory stays at what the caller holds; a
 * layer recorded done is in a 32-byte trailer past the bank's last byte, so
 * an interrupted write can be resumed.
 *
 * OUT.partial is created exclusively without following a symbolic link, or,
 * when a file is already there, taken over only if it is a regular file that
 * no other process holds: the writer keeps an exclusive flock on it until
 * it is renamed or removed, so a second writer of the same OUT refuses
 * (QM_EIN_USE). Until finished, the partial file begins with the 8 bytes
 * "QMOEPART" instead of a header length, so no loader (the daemon's
 * model.load, `qmoe-bank inspect`) takes it for a bank. Finishing writes the
 * final header and its length, cuts the trailer, syncs, opens the result
 * through the loader, and renames it over OUT. */
#ifndef QM_BANK_WRITER_H
#define QM_BANK_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"
#include "qm_error.h"
#include "qm_st_header.h"

/* One tensor of a planned layer. */
typedef struct qm_bank_plan_tensor {
    int present;
    qm_dtype dtype;
    uint32_t ndim;
    uint64_t shape[3];
} qm_bank_plan_tensor;

/* Which optional tensors a layer has, and their dtypes. */
typedef struct qm_bank_layer_opts {
    qm_dtype scale_dtype;  /* fc*.scales */
    qm_dtype bias_dtype;   /* fc*.bias */
    qm_dtype router_dtype; /* router.weight, router.bias */
    int zero_points;       /* fc*.zero_points (asymmetric) */
    int fc1_bias, fc2_bias, fc3_bias;
    int router_weight, router_bias, correction_bias; /* correction bias: F32 [E] */
} qm_bank_layer_opts;

/* Fills t[QM_T_COUNT] with the shapes the loader expects for one layer of a
 * bank of config cfg (BANK_FORMAT.md), absent where opts leaves a tensor out
 * (fc3 only for swiglu with swiglu_fusion 0). */
void qm_bank_plan_layer(const qm_bank_config *cfg, const qm_bank_layer_opts *opts,
                        qm_bank_plan_tensor t[QM_T_COUNT]);

/* The qmoe.* keys every bank carries, from cfg, in the order `create` and
 * `import hf` write them: QM_BANK_STD_META rows into meta[], their values
 * formatted into values (which must outlive meta). */
#define QM_BANK_STD_META 14
void qm_bank_std_meta(const qm_bank_config *cfg, char values[12][32], qm_st_meta *meta);

typedef struct qm_bank_writer_spec {
    uint32_t layers, experts;
    const qm_bank_plan_tensor *tensors; /* [layers][QM_T_COUNT] */
    /* The per-layer order in which tensors are listed in the header and, per
     * element width, placed in the data; NULL = qm_bank_tensor order. */
    const qm_bank_tensor *order;
    size_t n_order;
    const qm_st_meta *meta; /* __metadata__, in order; copied */
    size_t n_meta;
    /* A metadata key whose value finish rewrites (same length: a
     * placeholder now, e.g. the measured error), or NULL. */
    const char *deferred_key;
    const char *tool; /* prefixes the progress line ("import hf") */
} qm_bank_writer_spec;

typedef struct qm_bank_writer qm_bank_writer;

/* Plans and checks the file, then takes OUT.partial. With resume set and a
 * partial file that continues this very header, *first_layer is the first
 * layer not yet recorded done and *value what qm_bank_writer_layer_done
 * last recorded; otherwise a new file starts at layer 0 (a partial file left
 * by a dead writer is replaced). Errors: QM_EINVALID_MODEL when the planned
 * header fails the loader (its sentence); QM_EINVAL when OUT is a
 * directory or not a regular file, or OUT.partial a symbolic link or not a
 * regular file; QM_EIN_USE when another process holds OUT.partial;
 * QM_ECONFLICT when resume finds a partial file of another header (it is
 * left alone); QM_EIO, QM_ENOMEM. The caller owns *out: qm_bank_writer_free. */
int qm_bank_writer_open(const qm_bank_writer_spec *spec, const char *out, int resume,
                        qm_bank_writer **out_writer, uint32_t *first_layer, double *value,
                        qm_status *st);
/* Bytes of one expert's slice of layer l's tensor t (0 when absent); for
 * router tensors, the whole tensor. */
uint64_t qm_bank_writer_slice_bytes(const qm_bank_writer *w, uint32_t layer, int t);
/* Bytes of layer l's tensor t (0 when absent). */
uint64_t qm_bank_writer_tensor_bytes(const qm_bank_writer *w, uint32_t layer, int t);
/* Writes n bytes at byte `at` of layer l's tensor t. */
int qm_bank_writer_put(qm_bank_writer *w, uint32_t layer, int t, uint64_t at, const void *buf,
                       uint64_t n, qm_status *st);
/* Records layer l done (its data flushed first) with `value` (the caller's
 * running figure, e.g. the largest error so far), then updates the progress
 * line (source_done of source_total bytes). QMOE_IMPORT_KILL_AFTER_LAYERS=N
 * in the environment sends the process QMOE_IMPORT_KILL_SIGNAL (KILL, TERM,
 * INT or STOP; default KILL) right after the Nth layer of this run is
 * recorded, or, for N = 0, as qm_bank_writer_open returns: the tests'
 * stand-in for a crash, a Ctrl-C or a second import racing this one. */
int qm_bank_writer_layer_done(qm_bank_writer *w, uint32_t layer, double value, uint64_t source_done,
                              uint64_t source_total, qm_status *st);
/* Layers recorded done so far (resumed ones included). */
uint32_t qm_bank_writer_layers_done(const qm_bank_writer *w);
/* Turns the progress line on; its rate counts from now, source_done being
 * what a resumed write had done before. */
void qm_bank_writer_progress(qm_bank_writer *w, int on, uint64_t source_done);
/* Finishes: the deferred key's final value (same length as planned; NULL
 * when the spec had none), the header length, the trailer cut, fsync, the
 * file opened through the loader, renamed over OUT. *file_bytes may be NULL. */
int qm_bank_writer_finish(qm_bank_writer *w, const char *deferred_value, uint64_t *file_bytes,
                          qm_status *st);
/* Releases the writer. keep_partial = 0 removes OUT.partial (nothing a
 * resume could use); a finished writer has nothing to remove. Accepts NULL. */
void qm_bank_writer_free(qm_bank_writer *w, int keep_partial);

#endif
