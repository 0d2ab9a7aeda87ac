/* import_hf_source.c - mapping a Hugging Face checkpoint directory. */
#include "import_hf_source.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_st_header.h"
#include "tool_input.h"

typedef struct shard {
    char *name, *path;
    uint8_t *map;
    size_t size;
    int mapped; /* 1: map is ours to unmap */
    qm_st_header *header;
} shard;

struct qm__hf_checkpoint {
    char *dir;
    const qm__hf_file *mem; /* an in-memory checkpoint (qm__hf_open_memory), else NULL */
    size_t n_mem;
    qm_hf_json *config, *index;
    const char **index_names, **index_files;
    size_t n_index;
    shard *shards;
    uint32_t n_shards;
    qm__hf_tensor *tensors; /* sorted by name */
    size_t n_tensors;
};

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = qm_malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* Reads a whole small file (config, index) into a NUL-terminated buffer:
 * at most 64 MiB, and no more than the file's size says it holds. */
static int slurp(const char *path, const char *what, char **text, size_t *len, qm_status *st)
{
    *text = NULL;
    int fd = -1;
    uint64_t size = 0;
    int rc = qm__open_input(path, what, &fd, &size, st);
    if (rc) return rc;
    if (size > (64u << 20)) {
        close(fd);
        return qm_status_set(st, QM_EPARSE, "%.200s: larger than 64 MiB", what);
    }
    char *buf = qm_malloc((size_t)size + 1);
    if (!buf) {
        close(fd);
        return qm_status_set(st, QM_ENOMEM, "out of memory reading %.200s", what);
    }
    size_t n = 0;
    while (n < size) {
        ssize_t k = read(fd, buf + n, (size_t)size - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            rc = qm_status_set(st, QM_EIO, "%.200s: read error: %s", what, strerror(errno));
            break;
        }
        if (k == 0) break; /* shrank while read: what is there is the file */
        n += (size_t)k;
    }
    close(fd);
    if (rc) {
        qm_free(buf);
        return rc;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;
}

static const qm__hf_file *mem_file(const qm__hf_checkpoint *ck, const char *name)
{
    for (size_t i = 0; i < ck->n_mem; i++)
        if (strcmp(ck->mem[i].name, name) == 0) return &ck->mem[i];
    return NULL;
}

/* Whether the checkpoint has a file called name (a directory entry of any
 * kind: opening it decides whether it is usable). */
static int has_file(const qm__hf_checkpoint *ck, const char *name)
{
    if (ck->mem) return mem_file(ck, name) != NULL;
    char *p = join(ck->dir, name);
    struct stat sb;
    int ok = p && lstat(p, &sb) == 0;
    qm_free(p);
    return ok;
}

static int load_json(qm__hf_checkpoint *ck, const char *name, qm_hf_json **out, qm_status *st)
{
    if (ck->mem) {
        const qm__hf_file *f = mem_file(ck, name);
        if (!f) return qm_status_set(st, QM_ENOT_FOUND, "%.200s: no such file", name);
        return qm_hf_json_parse((const char *)f->data, f->size, name, out, st);
    }
    char *path = join(ck->dir, name), *text = NULL;
    size_t len = 0;
    if (!path) return qm_status_set(st, QM_ENOMEM, "out of memory");
    int rc = slurp(path, path, &text, &len, st);
    if (rc == 0) rc = qm_hf_json_parse(text, len, name, out, st);
    qm_free(text);
    qm_free(path);
    return rc;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp(((const qm__hf_tensor *)a)->name, ((const qm__hf_tensor *)b)->name);
}

/* A shard named by the index must be a file directly inside the checkpoint
 * directory: no path separator, not empty, not "." or "..". */
static int plain_file_name(const char *name)
{
    return name[0] != '\0' && !strchr(name, '/') && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0;
}

/* The shard file names: the index's distinct values, or *.safetensors in dir. */
static int list_shards(qm__hf_checkpoint *ck, char ***names, size_t *n, qm_status *st)
{
    *names = NULL;
    *n = 0;
    char **list = NULL;
    size_t count = 0, cap = 0;
    if (ck->index) {
        const char **sorted = qm_calloc(ck->n_index ? ck->n_index : 1, sizeof *sorted);
        if (!sorted) return qm_status_set(st, QM_ENOMEM, "out of memory");
        memcpy(sorted, ck->index_files, ck->n_index * sizeof *sorted);
        qsort(sorted, ck->n_index, sizeof *sorted, cmp_str);
        list = qm_calloc(ck->n_index ? ck->n_index : 1, sizeof *list);
        if (!list) {
            qm_free(sorted);
            return qm_status_set(st, QM_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < ck->n_index; i++) {
            if (count && strcmp(list[count - 1], sorted[i]) == 0) continue;
            if (!plain_file_name(sorted[i])) {
                /* The message is written before the list it quotes is freed. */
                int rc = qm_status_set(st, QM_EINVALID_MODEL,
                                       "model.safetensors.index.json: shard \"%.100s\" is not a "
                                       "file name in the checkpoint directory",
                                       sorted[i]);
                qm_free(sorted);
                for (size_t j = 0; j < count; j++)
                    qm_free(list[j]);
                qm_free(list);
                return rc;
            }
            list[count++] = qm_strdup(sorted[i]);
        }
        qm_free(sorted);
    } else if (has_file(ck, "model.safetensors")) {
        /* save_pretrained's single file: other *.safetensors beside it
         * (a consolidated copy, someone's outputs) are not the checkpoint. */
        list = qm_calloc(1, sizeof *list);
        if (!list) return qm_status_set(st, QM_ENOMEM, "out of memory");
        list[count++] = qm_strdup("model.safetensors");
    } else {
        DIR *d = ck->mem ? NULL : opendir(ck->dir);
        if (!ck->mem && !d)
            return qm_status_set(st, QM_ENOT_FOUND, "cannot open directory %.200s: %s", ck->dir,
                                 strerror(errno));
        struct dirent *de;
        for (size_t i = 0;; i++) {
            const char *fn = NULL;
            if (ck->mem) {
                if (i == ck->n_mem) break;
                fn = ck->mem[i].name;
            } else {
                if ((de = readdir(d)) == NULL) break;
                fn = de->d_name;
            }
            size_t len = strlen(fn);
            if (len <= 12 || strcmp(fn + len - 12, ".safetensors") != 0) continue;
            if (count == cap) {
                cap = cap ? 2 * cap : 8;
                char **nl = qm_realloc(list, cap * sizeof *nl);
                if (!nl) break;
                list = nl;
            }
            list[count++] = qm_strdup(fn);
        }
        if (d) closedir(d);
        if (count) qsort(list, count, sizeof *list, cmp_str);
    }
    for (size_t i = 0; i < count; i++)
        if (!list[i]) {
            for (size_t j = 0; j < count; j++)
                qm_free(list[j]);
            qm_free(list);
            return qm_status_set(st, QM_ENOMEM, "out of memory listing shards");
        }
    if (!count) {
        qm_free(list);
        return qm_status_set(st, QM_ENOT_FOUND,
                             "%.200s: no *.safetensors file (and no "
                             "model.safetensors.index.json)",
                             ck->dir);
    }
    *names = list;
    *n = count;
    return 0;
}

static int by_begin(const void *a, const void *b)
{
    const qm_st_tensor *x = *(const qm_st_tensor *const *)a, *y = *(const qm_st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Every tensor's bytes are its own: tensors sharing data would let a small
 * shard claim a large model. */
static int check_overlaps(const shard *s, qm_status *st)
{
    size_t n = s->header->n_tensors;
    const qm_st_tensor **order = qm_calloc(n ? n : 1, sizeof *order);
    if (!order) return qm_status_set(st, QM_ENOMEM, "out of memory checking %.100s", s->name);
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (s->header->tensors[i].end > s->header->tensors[i].begin)
            order[m++] = &s->header->tensors[i];
    qsort(order, m, sizeof *order, by_begin);
    int rc = 0;
    for (size_t i = 1; i < m && rc == 0; i++)
        if (order[i]->begin < order[i - 1]->end)
            rc = qm_status_set(st, QM_EINVALID_MODEL,
                               "%.100s: tensor %.100s: data_offsets [%llu, %llu] overlap tensor "
                               "%.100s's [%llu, %llu]",
                               s->name, order[i]->name, (unsigned long long)order[i]->begin,
                               (unsigned long long)order[i]->end, order[i - 1]->name,
                               (unsigned long long)order[i - 1]->begin,
                               (unsigned long long)order[i - 1]->end);
    qm_free(order);
    return rc;
}

static int map_shard(qm__hf_checkpoint *ck, shard *s, qm_status *st)
{
    int fd = -1;
    uint64_t size = 0;
    const qm__hf_file *mf = ck->mem ? mem_file(ck, s->name) : NULL;
    int rc = ck->mem ? (mf ? 0 : qm_status_set(st, QM_ENOT_FOUND, "%.200s: no such file", s->name))
                     : qm__open_input(s->path, s->path, &fd, &size, st);
    if (mf) size = mf->size;
    if (rc == QM_ENOT_FOUND && ck->index) {
        const char *example = "";
        for (size_t i = 0; i < ck->n_index; i++)
            if (strcmp(ck->index_files[i], s->name) == 0) {
                example = ck->index_names[i];
                break;
            }
        return qm_status_set(st, QM_ENOT_FOUND,
                             "missing shard %.120s: model.safetensors.index.json puts tensors "
                             "there (e.g. %.100s)",
                             s->path, example);
    }
    if (rc) return rc;
    if (size < 8) {
        if (fd >= 0) close(fd);
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.200s: not a safetensors file (shorter than 8 bytes)", s->path);
    }
    s->size = (size_t)size;
    if (mf) {
        s->map = (uint8_t *)mf->data;
    } else {
        void *m = mmap(NULL, s->size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (m == MAP_FAILED)
            return qm_status_set(st, QM_EIO, "cannot map %.200s: %s", s->path, strerror(errno));
        s->map = m;
        s->mapped = 1;
    }
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)s->map[i] << (8 * i);
    if (hlen > s->size - 8 || hlen > QM_ST_DEFAULT_MAX_HEADER_BYTES)
        return qm_status_set(st, QM_EINVALID_MODEL,
                             "%.200s: header length %llu does not fit in the file (%zu bytes)",
                             s->path, (unsigned long long)hlen, s->size);
    qm_status hst;
    qm_status_clear(&hst);
    if (qm_st_header_parse((const char *)s->map + 8, hlen, NULL, &s->header, &hst) != 0)
        return qm_status_set(st, QM_EINVALID_MODEL, "%.120s: %s", s->name, hst.msg);
    uint64_t data = 8 + hlen, avail = s->size - data;
    for (size_t i = 0; i < s->header->n_tensors; i++) {
        const qm_st_tensor *t = &s->header->tensors[i];
        qm__elem e = qm__elem_from_st(t->dtype);
        size_t es = e == QM__ELEM_OTHER ? qm_st_dtype_size(t->dtype) : qm__elem_size(e);
        unsigned long long want = es;
        for (uint32_t d = 0; d < t->ndim && es; d++)
            if (qm_mul_u64(want, t->shape[d], &want) != 0) want = ~0ull;
        if (t->end > avail || (es && want != t->end - t->begin))
            return qm_status_set(
                st, QM_EINVALID_MODEL,
                "%.100s: tensor %.120s: data_offsets [%llu, %llu] do not hold its "
                "shape and dtype %s inside the file's %llu data bytes (truncated?)",
                s->name, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                t->dtype, (unsigned long long)avail);
    }
    return check_overlaps(s, st);
}

/* The rest of an open, for a directory and an in-memory set alike. */
static int open_common(qm__hf_checkpoint *ck, qm_status *st)
{
    const char *dir = ck->dir;
    char **names = NULL;
    size_t n_names = 0;
    int rc;
    if ((rc = load_json(ck, "config.json", &ck->config, st)) != 0) goto fail;
    if (has_file(ck, "model.safetensors.index.json")) {
        if ((rc = load_json(ck, "model.safetensors.index.json", &ck->index, st)) != 0) goto fail;
        rc = qm_hf_json_string_map(ck->index, "weight_map", &ck->index_names, &ck->index_files,
                                   &ck->n_index, st);
        if (rc == QM_ENOT_FOUND)
            rc = qm_status_set(st, QM_EINVALID_MODEL,
                               "model.safetensors.index.json: no \"weight_map\" object");
        if (rc) goto fail;
    }
    if ((rc = list_shards(ck, &names, &n_names, st)) != 0) goto fail;
    ck->shards = qm_calloc(n_names, sizeof *ck->shards);
    if (!ck->shards) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory");
        goto fail;
    }
    ck->n_shards = (uint32_t)n_names;
    size_t total = 0;
    for (uint32_t i = 0; i < ck->n_shards; i++) {
        shard *s = &ck->shards[i];
        s->name = names[i];
        names[i] = NULL;
        if (!(s->path = join(dir, s->name))) {
            rc = qm_status_set(st, QM_ENOMEM, "out of memory");
            goto fail;
        }
        if ((rc = map_shard(ck, s, st)) != 0) goto fail;
        total += s->header->n_tensors;
    }
    ck->tensors = qm_calloc(total ? total : 1, sizeof *ck->tensors);
    if (!ck->tensors) {
        rc = qm_status_set(st, QM_ENOMEM, "out of memory indexing %zu tensors", total);
        goto fail;
    }
    for (uint32_t i = 0; i < ck->n_shards; i++) {
        shard *s = &ck->shards[i];
        uint64_t data = 8;
        for (int b = 0; b < 8; b++)
            data += (uint64_t)s->map[b] << (8 * b);
        for (size_t j = 0; j < s->header->n_tensors; j++) {
            const qm_st_tensor *t = &s->header->tensors[j];
            qm__hf_tensor *h = &ck->tensors[ck->n_tensors++];
            h->name = t->name;
            h->shard = i;
            h->elem = qm__elem_from_st(t->dtype);
            h->dtype = t->dtype;
            h->ndim = t->ndim;
            memcpy(h->shape, t->shape, sizeof h->shape);
            h->data = s->map + data + t->begin;
            h->nbytes = t->end - t->begin;
        }
    }
    qsort(ck->tensors, ck->n_tensors, sizeof *ck->tensors, cmp_tensor);
    for (size_t i = 1; i < ck->n_tensors; i++)
        if (strcmp(ck->tensors[i - 1].name, ck->tensors[i].name) == 0) {
            rc = qm_status_set(st, QM_EINVALID_MODEL, "tensor %.120s is in both %.80s and %.80s",
                               ck->tensors[i].name, ck->shards[ck->tensors[i - 1].shard].name,
                               ck->shards[ck->tensors[i].shard].name);
            goto fail;
        }
    qm_free(names);
    return 0;
fail:
    for (size_t i = 0; names && i < n_names; i++)
        qm_free(names[i]);
    qm_free(names);
    return rc;
}

int qm__hf_open(const char *dir, qm__hf_checkpoint **out, qm_status *st)
{
    *out = NULL;
    qm__hf_checkpoint *ck = qm_calloc(1, sizeof *ck);
    if (!ck || !(ck->dir = qm_strdup(dir))) {
        qm_free(ck);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    int rc = open_common(ck, st);
    if (rc) {
        qm__hf_close(ck);
        return rc;
    }
    *out = ck;
    return 0;
}

int qm__hf_open_memory(const qm__hf_file *files, size_t n, qm__hf_checkpoint **out, qm_status *st)
{
    *out = NULL;
    qm__hf_checkpoint *ck = qm_calloc(1, sizeof *ck);
    if (!ck || !(ck->dir = qm_strdup("(memory)"))) {
        qm_free(ck);
        return qm_status_set(st, QM_ENOMEM, "out of memory");
    }
    ck->mem = files;
    ck->n_mem = n;
    int rc = open_common(ck, st);
    if (rc) {
        qm__hf_close(ck);
        return rc;
    }
    *out = ck;
    return 0;
}

void qm__hf_close(qm__hf_checkpoint *ck)
{
    if (!ck) return;
    for (uint32_t i = 0; i < ck->n_shards; i++) {
        shard *s = &ck->shards[i];
        if (s->mapped) munmap(s->map, s->size);
        qm_st_header_free(s->header);
        qm_free(s->name);
        qm_free(s->path);
    }
    qm_free(ck->shards);
    qm_free(ck->tensors);
    qm_free(ck->index_names);
    qm_free(ck->index_files);
    qm_hf_json_free(ck->index);
    qm_hf_json_free(ck->config);
    qm_free(ck->dir);
    qm_free(ck);
}

const qm_hf_json *qm__hf_config(const qm__hf_checkpoint *ck)
{
    return ck->config;
}

const qm__hf_tensor *qm__hf_find(const qm__hf_checkpoint *ck, const char *name)
{
    qm__hf_tensor key = {.name = name};
    return bsearch(&key, ck->tensors, ck->n_tensors, sizeof key, cmp_tensor);
}

const char *qm__hf_index_file(const qm__hf_checkpoint *ck, const char *name)
{
    for (size_t i = 0; i < ck->n_index; i++)
        if (strcmp(ck->index_names[i], name) == 0) return ck->index_files[i];
    return NULL;
}

uint32_t qm__hf_shard_count(const qm__hf_checkpoint *ck)
{
    return ck->n_shards;
}

const char *qm__hf_shard_name(const qm__hf_checkpoint *ck, uint32_t i)
{
    return i < ck->n_shards ? ck->shards[i].name : NULL;
}

const qm__hf_tensor *qm__hf_tensors(const qm__hf_checkpoint *ck, size_t *count)
{
    *count = ck->n_tensors;
    return ck->tensors;
}

static void page_range(const qm__hf_tensor *t, uintptr_t *lo, size_t *len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)t->data & ~(page - 1);
    *lo = a;
    *len = (size_t)((uintptr_t)t->data + t->nbytes - a);
}

void qm__hf_prefetch(const qm__hf_checkpoint *ck, const qm__hf_tensor *t)
{
    if (ck->mem) return;
    uintptr_t lo;
    size_t len;
    page_range(t, &lo, &len);
    if (len) madvise((void *)lo, len, MADV_WILLNEED);
}

void qm__hf_release(qm__hf_checkpoint *ck)
{
    for (uint32_t i = 0; i < ck->n_shards; i++)
        if (ck->shards[i].mapped) madvise(ck->shards[i].map, ck->shards[i].size, MADV_DONTNEED);
}
