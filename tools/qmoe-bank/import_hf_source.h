/* import_hf_source.h - a Hugging Face checkpoint directory, mapped: config.json,
 * model.safetensors.index.json when sharded, and every shard's tensors by
 * name. Nothing is read from the tensors' data here; the importer touches
 * one layer's pages at a time and drops them (qm__hf_release). */
#ifndef QMOE_IMPORT_HF_SOURCE_H
#define QMOE_IMPORT_HF_SOURCE_H

#include <stdint.h>

#include "import_elements.h"
#include "qm_error.h"
#include "qm_hf_config.h"

typedef struct qm__hf_tensor {
    const char *name; /* borrowed from the shard's header */
    uint32_t shard;
    qm__elem elem;
    const char *dtype; /* as written */
    uint32_t ndim;
    uint64_t shape[8];
    const uint8_t *data; /* into the shard's mapping */
    uint64_t nbytes;
} qm__hf_tensor;

typedef struct qm__hf_checkpoint qm__hf_checkpoint;

/* One file of an in-memory checkpoint (fuzzing, tests): a base name and its bytes. */
typedef struct qm__hf_file {
    const char *name;
    const uint8_t *data;
    size_t size;
} qm__hf_file;

/* Opens DIR: reads config.json (required) and the index (when present; every
 * shard it names must exist), maps each shard and checks its header (offsets
 * inside the file, sizes = shape x dtype). Without an index the shards are
 * model.safetensors when it exists, else every *.safetensors file. Errors
 * name the file and what was wrong: QM_EINVALID_MODEL / QM_ENOT_FOUND /
 * QM_EPARSE for bad input, QM_EIO, QM_ENOMEM. The caller frees *out with qm__hf_close (accepts
 * NULL). */
int qm__hf_open(const char *dir, qm__hf_checkpoint **out, qm_status *st);
/* The same over files[n] instead of a directory; files and their bytes are
 * borrowed and must outlive *out. */
int qm__hf_open_memory(const qm__hf_file *files, size_t n, qm__hf_checkpoint **out, qm_status *st);
void qm__hf_close(qm__hf_checkpoint *ck);

const qm_hf_json *qm__hf_config(const qm__hf_checkpoint *ck);
/* The tensor called name, or NULL. Borrowed. */
const qm__hf_tensor *qm__hf_find(const qm__hf_checkpoint *ck, const char *name);
/* Where the index says a tensor lives (NULL when unsharded or not listed). */
const char *qm__hf_index_file(const qm__hf_checkpoint *ck, const char *name);
/* Shard file base names, in order. */
uint32_t qm__hf_shard_count(const qm__hf_checkpoint *ck);
const char *qm__hf_shard_name(const qm__hf_checkpoint *ck, uint32_t i);
/* Every tensor, sorted by name. */
const qm__hf_tensor *qm__hf_tensors(const qm__hf_checkpoint *ck, size_t *count);
/* Hints the kernel to read t's bytes soon (readahead). */
void qm__hf_prefetch(const qm__hf_checkpoint *ck, const qm__hf_tensor *t);
/* Drops every mapped page from this process (they stay in the page cache):
 * resident memory goes back to what the importer allocated. */
void qm__hf_release(qm__hf_checkpoint *ck);

#endif
