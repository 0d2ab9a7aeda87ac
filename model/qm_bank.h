/* qm_bank.h - expert bank files (safetensors, ../shared/BANK_FORMAT.md).
 *
 * A bank is opened by mmap (read-only) and validated completely at open:
 * after qm_bank_open succeeds every view below points at checked bytes. */
#ifndef QM_BANK_H
#define QM_BANK_H

#include <stddef.h>
#include <stdint.h>

#include "qm_error.h"
#include "qm_residency.h"

typedef enum qm_dtype {
    QM_DTYPE_F32 = 0,
    QM_DTYPE_F16,
    QM_DTYPE_BF16,
    QM_DTYPE_U8,
} qm_dtype;

size_t qm_dtype_size(qm_dtype dtype);
const char *qm_dtype_name(qm_dtype dtype); /* "f32", "f16", "bf16", "u8" */

typedef enum qm_activation {
    QM_ACT_RELU = 0,
    QM_ACT_GELU,
    QM_ACT_SILU,
    QM_ACT_SWIGLU,
    QM_ACT_IDENTITY,
} qm_activation;

const char *qm_activation_name(qm_activation act); /* "relu", ... */
int qm_activation_parse(const char *name, qm_activation *out);

/* The per-layer tensors, in the order used as qm_region.tensor in catalogs. */
typedef enum qm_bank_tensor {
    QM_T_FC1_WEIGHT = 0,
    QM_T_FC1_SCALES,
    QM_T_FC1_ZERO_POINTS,
    QM_T_FC1_BIAS,
    QM_T_FC2_WEIGHT,
    QM_T_FC2_SCALES,
    QM_T_FC2_ZERO_POINTS,
    QM_T_FC2_BIAS,
    QM_T_FC3_WEIGHT,
    QM_T_FC3_SCALES,
    QM_T_FC3_ZERO_POINTS,
    QM_T_FC3_BIAS,
    QM_T_EXPERT_COUNT, /* tensors above have a leading expert dimension */
    QM_T_ROUTER_WEIGHT = QM_T_EXPERT_COUNT,
    QM_T_ROUTER_BIAS,
    QM_T_ROUTER_CORRECTION_BIAS, /* F32 [E], added to scores for selection only */
    QM_T_COUNT
} qm_bank_tensor;

/* "fc1.weight", "fc1.scales", ..., "router.bias"; NULL when out of range. */
const char *qm_bank_tensor_suffix(qm_bank_tensor t);
/* Writes "layers.<layer>.<suffix>" into buf; QM_EINVAL if it does not fit. */
int qm_bank_tensor_name(uint32_t layer, qm_bank_tensor t, char *buf, size_t size);

/* How a token's experts and weights come from its router logits
 * (BANK_FORMAT.md "Banks imported from real models"). */
typedef enum qm_route_score {
    QM_ROUTE_SCORE_LEGACY = 0, /* no routing keys: top-k logits, softmax over the k */
    QM_ROUTE_SCORE_SOFTMAX,    /* softmax over all E logits */
    QM_ROUTE_SCORE_SIGMOID,    /* sigmoid of each logit */
} qm_route_score;

typedef enum qm_group_score {
    QM_GROUP_SCORE_MAX = 0,  /* a group's score is its best expert's (DeepSeek-V2) */
    QM_GROUP_SCORE_TOP2_SUM, /* the sum of its two best (DeepSeek-V3) */
} qm_group_score;

typedef struct qm_routing_rule {
    qm_route_score score;   /* LEGACY when the bank has no qmoe.routing.* keys */
    int normalize;          /* renormalise the k gathered scores to sum 1 */
    float scale;            /* multiplies the final weights */
    uint32_t groups;        /* 1 = no group-limited selection */
    uint32_t topk_groups;   /* groups kept per token, 1..groups */
    qm_group_score group_score;
} qm_routing_rule;

const char *qm_route_score_name(qm_route_score s);  /* "legacy", "softmax", "sigmoid" */
const char *qm_group_score_name(qm_group_score s);  /* "max", "top2_sum" */

/* The model's shape and semantics, from __metadata__. */
/* A 4-bit code book (`qmoe.codebook`, docs/BANK_FORMAT.md): the weight of
 * code q is scale * values[q] instead of scale * (q - zero point). */
typedef enum qm_codebook {
    QM_CODEBOOK_NONE = 0,
    QM_CODEBOOK_E2M1 = 1, /* MXFP4's E2M1 values doubled: 0 1 2 3 4 6 8 12, then negated */
} qm_codebook;
/* The 16 signed values of a code book's codes (NULL for none), its name. */
const int8_t *qm_codebook_values(qm_codebook cb);
const char *qm_codebook_name(qm_codebook cb);

typedef struct qm_bank_config {
    uint32_t layers, experts, hidden, inter, k;
    uint32_t bits;          /* 4 or 8 */
    qm_codebook codebook;   /* NONE, or a table of 4-bit codes (bits 4, no zero points) */
    uint32_t block_size;    /* 0 = one scale per row */
    qm_activation activation;
    uint32_t swiglu_fusion; /* 0 separate fc3, 1 interleaved, 2 concatenated */
    int normalize_routing;
    float alpha, beta, limit; /* swiglu; defaults (keys absent) as ORT's: 1.0, 0.0, +inf */
    qm_routing_rule routing;  /* zero-initialised = the legacy rule */
} qm_bank_config;

/* A tensor inside the mapping. present = 0 for absent optional tensors. */
typedef struct qm_tensor_view {
    int present;
    qm_dtype dtype;
    uint32_t ndim;
    uint64_t shape[4];
    uint64_t nbytes;
    uint64_t offset; /* from the start of the data section */
    const void *data; /* into the mapping */
} qm_tensor_view;

typedef struct qm_layer_view {
    uint32_t index;
    qm_tensor_view t[QM_T_COUNT];
    uint64_t bytes_per_expert; /* one expert's unit: sum of its slices of t[0..EXPERT_COUNT) */
} qm_layer_view;

typedef struct qm_bank qm_bank;

/* Opens and validates `path`. On failure returns QM_EINVALID_MODEL (or
 * QM_EIO / QM_ENOMEM) with st->msg naming the tensor and rule. The caller
 * owns the bank; close it with qm_bank_close (accepts NULL). */
int qm_bank_open(const char *path, qm_bank **out, qm_status *st);
/* Same over a caller-owned buffer (fuzzing, tests); the buffer must outlive the bank. */
int qm_bank_open_memory(const void *data, size_t size, qm_bank **out, qm_status *st);
void qm_bank_close(qm_bank *bank);

const qm_bank_config *qm_bank_get_config(const qm_bank *bank);
const char *qm_bank_path(const qm_bank *bank); /* "" for memory banks */
uint64_t qm_bank_file_bytes(const qm_bank *bank);
/* Start of the data section in the mapping (region offsets are relative to it). */
const uint8_t *qm_bank_data(const qm_bank *bank);
/* Borrowed, valid while the bank is open. NULL if layer is out of range. */
const qm_layer_view *qm_bank_layer(const qm_bank *bank, uint32_t layer);
/* Sum over layers of every expert tensor's bytes (not router). */
uint64_t qm_bank_expert_bytes_total(const qm_bank *bank);
/* The whole mapped file (or memory buffer) and its size at open. */
const void *qm_bank_mapping(const qm_bank *bank, uint64_t *bytes);
/* Maps the pages of [p, p + n) of a file bank into this process now
 * (madvise MADV_POPULATE_READ, Linux 5.14 and later; MADV_WILLNEED's
 * readahead where the kernel refuses that), so kernels that read a
 * whole-resident bank in place take no page faults on their first calls.
 * Returns the bytes populated: 0 for memory banks, ranges outside the
 * mapping, or a kernel that refuses both. Raises no signal: pages past the
 * end of a file truncated under the mapping make madvise fail, not SIGBUS. */
uint64_t qm_bank_prefault(const qm_bank *bank, const void *p, uint64_t n);
/* Lets go of this process's mapping of the pages of [p, p + n) of a file
 * bank (madvise MADV_DONTNEED: they leave the RSS, stay in the page cache,
 * and a later read maps them again), for a range copied elsewhere. */
void qm_bank_release_pages(const qm_bank *bank, const void *p, uint64_t n);
/* For a bank opened from a file: fstat()s the file (kept open) and fails
 * with QM_EINVALID_MODEL "bank file <path> was truncated on disk (N < M
 * bytes)" when it is now shorter than the mapping, whose pages past the new
 * end would raise SIGBUS. 0 for memory banks and intact files. */
int qm_bank_check_file(const qm_bank *bank, qm_status *st);
/* qmoe.layer_map: the model layer index of each bank layer ([layers],
 * strictly ascending), or NULL when the bank has no map (bank layer l is model
 * layer l). Borrowed, valid while the bank is open. */
const uint32_t *qm_bank_layer_map(const qm_bank *bank);
/* qmoe.source (a JSON object, checked at open) as one line of compact
 * JSON in well-formed UTF-8 (what the file holds may be pretty-printed;
 * the daemon splices this into its answers), or NULL when absent.
 * Borrowed, valid while the bank is open. */
const char *qm_bank_source_json(const qm_bank *bank);
/* Unknown tensors seen at open, as "name" strings. Borrowed. */
const char *const *qm_bank_warnings(const qm_bank *bank, size_t *count);

/* Builds layer `layer`'s region catalog (bank id = layer). Offsets are
 * relative to qm_bank_data(). Caller frees it with qm_catalog_free. */
int qm_bank_build_catalog(const qm_bank *bank, uint32_t layer, qm_region_catalog **out,
                          qm_status *st);
/* Same, but marks the catalog MISALIGNED when a tensor's offset or per-expert
 * slice is not a multiple of `alignment` (a backend's copy granularity;
 * 0 or 1 = no requirement). */
int qm_bank_build_catalog_aligned(const qm_bank *bank, uint32_t layer, uint64_t alignment,
                                  qm_region_catalog **out, qm_status *st);

/* One expert's slice of a per-expert tensor: [data, data + qm_expert_slice_bytes). */
uint64_t qm_expert_slice_bytes(const qm_tensor_view *tv, uint32_t n_experts);

#endif
