/* sim_readers.c - the trace files policy_sim reads besides its own .qmtr:
 *
 * - a NumPy .npy array [tokens, layers, k] of integers, C order: the shape
 *   of vLLM's `routed_experts` (dtype int8/int16/int32/int64, little-endian
 *   or single-byte; uint8/uint16 too). -1 = no expert. The expert count is
 *   not stored there: it is `experts` when given (> 0), else the largest id
 *   + 1.
 * - the JSON-lines form of docs/TRACES.md: a header line
 *   {"format": "qmoe-trace", "layers": L, "k": K, "experts": E, ...} then one
 *   {"token": t, "experts": [[...] x L]} per token.
 * Every error names the file and what is wrong. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

static int fail(char *err, size_t cap, const char *path, const char *what)
{
    snprintf(err, cap, "%s: %s", path, what);
    return -1;
}

/* The whole file, NUL-terminated, with *tr zeroed (NULL on error, said in err). */
static unsigned char *slurp(const char *path, sim_trace *tr, size_t *len, char *err, size_t cap)
{
    memset(tr, 0, sizeof *tr);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fail(err, cap, path, "cannot open");
        return NULL;
    }
    size_t n = 0, c = 1 << 16;
    unsigned char *buf = malloc(c + 1);
    while (buf) {
        size_t got = fread(buf + n, 1, c - n, f);
        n += got;
        if (n < c)
            break;
        unsigned char *g = realloc(buf, 2 * c + 1);
        if (!g) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = g;
        c *= 2;
    }
    fclose(f);
    if (!buf) {
        fail(err, cap, path, "out of memory");
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Fills tr->ids from raw ids and checks the range; E from `experts` or max + 1. */
static int finish(sim_trace *tr, const long long *v, size_t n, uint32_t experts, const char *path,
                  char *err, size_t cap)
{
    long long max = -1;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < -1 || v[i] > 32766) {
            snprintf(err, cap, "%s: expert id %lld at position %zu is outside [-1, 32767)", path,
                     v[i], i);
            return -1;
        }
        if (v[i] > max)
            max = v[i];
    }
    tr->experts = experts ? experts : (uint32_t)(max + 1);
    if (tr->experts == 0 || max >= (long long)tr->experts || tr->k > tr->experts)
        return fail(err, cap, path, "expert ids do not fit the expert count (give --experts)");
    tr->ids = malloc(n * sizeof *tr->ids + 1);
    if (!tr->ids)
        return fail(err, cap, path, "out of memory");
    for (size_t i = 0; i < n; i++)
        tr->ids[i] = (int16_t)v[i];
    return 0;
}

/* Frees a reader's buffers, and the trace when it failed; returns rc. */
static int done(sim_trace *tr, int rc, long long *v, unsigned char *b)
{
    free(v);
    free(b);
    if (rc)
        sim_trace_free(tr);
    return rc;
}

/* A reader's parse of the file's bytes b[0, len) (NUL-terminated, writable):
 * the trace's shape in *tr, the raw ids in *v (n of them; the caller frees
 * them, even on failure), the expert count in *experts when the file holds
 * it. 0, or -1 with err set. */
typedef int (*sim_parse_fn)(unsigned char *b, size_t len, const char *path, sim_trace *tr,
                            uint32_t *experts, long long **v, size_t *n, char *err, size_t cap);

/* Reads `path` with `parse`, then checks and keeps its ids (finish). */
static int load(const char *path, uint32_t experts, sim_parse_fn parse, sim_trace *tr, char *err,
                size_t cap)
{
    size_t len, n = 0;
    unsigned char *b = slurp(path, tr, &len, err, cap);
    if (!b)
        return -1;
    long long *v = NULL;
    int rc = parse(b, len, path, tr, &experts, &v, &n, err, cap);
    if (rc == 0)
        rc = finish(tr, v, n, experts, path, err, cap);
    return done(tr, rc, v, b);
}

static int parse_npy(unsigned char *b, size_t len, const char *path, sim_trace *tr,
                     uint32_t *experts, long long **vp, size_t *np, char *err, size_t cap)
{
    (void)experts; /* not in a .npy: given, or the largest id + 1 */
    if (len < 10 || memcmp(b, "\x93NUMPY", 6) != 0)
        return fail(err, cap, path, "not a .npy file (bad magic)");
    size_t hlen, hoff;
    if (b[6] == 1) {
        hlen = (size_t)b[8] | (size_t)b[9] << 8;
        hoff = 10;
    } else if ((b[6] == 2 || b[6] == 3) && len >= 12) {
        hlen = (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
        hoff = 12;
    } else {
        return fail(err, cap, path, "unsupported .npy version");
    }
    if (hoff + hlen > len)
        return fail(err, cap, path, "truncated .npy header");
    char hdr[1024];
    snprintf(hdr, sizeof hdr, "%.*s", (int)(hlen < sizeof hdr - 1 ? hlen : sizeof hdr - 1),
             (const char *)b + hoff);
    const char *d = strstr(hdr, "'descr'"), *fo = strstr(hdr, "'fortran_order'"),
               *sh = strstr(hdr, "'shape'");
    if (!d || !fo || !sh)
        return fail(err, cap, path, ".npy header lacks descr, fortran_order or shape");
    char descr[8] = "";
    if (sscanf(d, "'descr' : '%7[^']'", descr) != 1 && sscanf(d, "'descr': '%7[^']'", descr) != 1)
        return fail(err, cap, path, "cannot read the .npy descr");
    if (strstr(fo, "True"))
        return fail(err, cap, path, "Fortran-order arrays are not supported (save C order)");
    unsigned long long s0, s1, s2;
    const char *paren = strchr(sh, '(');
    if (!paren || sscanf(paren, "(%llu, %llu, %llu)", &s0, &s1, &s2) != 3)
        return fail(err, cap, path, "shape must be 3-D: [tokens, layers, k]");
    int size = 0, is_signed = 1;
    char kind = descr[1];
    if ((descr[0] != '<' && descr[0] != '|' && descr[0] != '=') || (kind != 'i' && kind != 'u')) {
        snprintf(err, cap, "%s: dtype %s; expected little-endian integers (<i2, <i4, <i8, ...)",
                 path, descr);
        return -1;
    }
    size = atoi(descr + 2);
    is_signed = kind == 'i';
    if (size != 1 && size != 2 && size != 4 && size != 8) {
        snprintf(err, cap, "%s: dtype %s has an unsupported width", path, descr);
        return -1;
    }
    if (!s0 || !s1 || !s2 || s1 > 65535 || s2 > 256 || s0 > 100000000ull)
        return fail(err, cap, path, "shape out of range (tokens, layers <= 65535, 1 <= k <= 256)");
    size_t n = (size_t)(s0 * s1 * s2), off = hoff + hlen;
    if (len - off != n * (size_t)size) {
        snprintf(err, cap, "%s: %zu data bytes, the shape needs %zu", path, len - off,
                 n * (size_t)size);
        return -1;
    }
    long long *v = *vp = malloc(n * sizeof *v + 1);
    if (!v)
        return fail(err, cap, path, "out of memory");
    const unsigned char *p = b + off;
    for (size_t i = 0; i < n; i++, p += size) {
        unsigned long long u = 0;
        for (int j = 0; j < size; j++)
            u |= (unsigned long long)p[j] << (8 * j);
        if (is_signed && size < 8 && (u >> (8 * size - 1)) & 1)
            u |= ~0ull << (8 * size); /* sign-extend */
        v[i] = is_signed ? (long long)u : (u > 32766 ? 32767 : (long long)u);
    }
    tr->tokens = (uint32_t)s0;
    tr->layers = (uint32_t)s1;
    tr->k = (uint32_t)s2;
    *np = n;
    return 0;
}

int sim_trace_load_npy(const char *path, uint32_t experts, sim_trace *tr, char *err, size_t cap)
{
    return load(path, experts, parse_npy, tr, err, cap);
}

static int json_uint(const cJSON *o, const char *key, uint32_t max, uint32_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > max ||
        v->valuedouble != (double)(uint32_t)v->valuedouble)
        return -1;
    *out = (uint32_t)v->valuedouble;
    return 0;
}

static int parse_jsonl(unsigned char *b, size_t len, const char *path, sim_trace *tr,
                       uint32_t *experts, long long **vp, size_t *np, char *err, size_t cap)
{
    (void)len; /* NUL-terminated: read line by line */
    long long *v = NULL;
    size_t n = 0, vcap = 0;
    uint32_t line_no = 0, tokens = 0;
    *experts = 0;
    char *save = NULL;
    for (char *line = strtok_r((char *)b, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        if (strspn(line, " \t\r") == strlen(line))
            continue;
        cJSON *o = cJSON_Parse(line);
        if (!cJSON_IsObject(o)) {
            snprintf(err, cap, "%s: line %u is not a JSON object", path, line_no);
            cJSON_Delete(o);
            return -1;
        }
        if (!tr->layers) { /* the header */
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, "format");
            int ok = cJSON_IsString(f) && !strcmp(f->valuestring, "qmoe-trace") &&
                     !json_uint(o, "layers", 65535, &tr->layers) &&
                     !json_uint(o, "k", 256, &tr->k) && !json_uint(o, "experts", 32767, experts);
            cJSON_Delete(o);
            if (!ok) {
                snprintf(err, cap, "%s: line %u: expected the header {\"format\": \"qmoe-trace\", "
                         "\"layers\", \"k\", \"experts\"} (positive integers)", path, line_no);
                tr->layers = 0;
                return -1;
            }
            continue;
        }
        const cJSON *ex = cJSON_GetObjectItemCaseSensitive(o, "experts");
        const cJSON *tok = cJSON_GetObjectItemCaseSensitive(o, "token");
        int bad = !cJSON_IsArray(ex) || cJSON_GetArraySize(ex) != (int)tr->layers ||
                  (tok && (!cJSON_IsNumber(tok) || tok->valuedouble != (double)tokens));
        if (!bad && n + (size_t)tr->layers * tr->k > vcap) {
            size_t nc = vcap ? 2 * vcap : (size_t)tr->layers * tr->k * 64;
            long long *g = realloc(v, nc * sizeof *v);
            if (!g) {
                cJSON_Delete(o);
                return fail(err, cap, path, "out of memory");
            }
            *vp = v = g;
            vcap = nc;
        }
        for (const cJSON *row = bad ? NULL : ex->child; row && !bad; row = row->next) {
            bad = !cJSON_IsArray(row) || cJSON_GetArraySize(row) != (int)tr->k;
            for (const cJSON *x = bad ? NULL : row->child; x && !bad; x = x->next) {
                bad = !cJSON_IsNumber(x) || x->valuedouble != (double)(long long)x->valuedouble;
                if (!bad)
                    v[n++] = (long long)x->valuedouble;
            }
        }
        cJSON_Delete(o);
        if (bad) {
            snprintf(err, cap, "%s: line %u: expected {\"token\": %u, \"experts\": [%u rows of %u "
                     "integers]}", path, line_no, tokens, tr->layers, tr->k);
            return -1;
        }
        tokens++;
    }
    if (!tr->layers || !tokens)
        return fail(err, cap, path, "no header or no token records");
    tr->tokens = tokens;
    *np = n;
    return 0;
}

int sim_trace_load_jsonl(const char *path, sim_trace *tr, char *err, size_t cap)
{
    return load(path, 0, parse_jsonl, tr, err, cap);
}


int sim_trace_load_any(const char *path, uint32_t experts, sim_trace *tr, char *err, size_t cap)
{
    unsigned char head[8] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) {
        memset(tr, 0, sizeof *tr);
        return fail(err, cap, path, "cannot open");
    }
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    if (got >= 6 && !memcmp(head, "\x93NUMPY", 6))
        return sim_trace_load_npy(path, experts, tr, err, cap);
    size_t i = 0;
    while (i < got && (head[i] == ' ' || head[i] == '\n' || head[i] == '\r' || head[i] == '\t'))
        i++;
    if (i < got && head[i] == '{')
        return sim_trace_load_jsonl(path, tr, err, cap);
    return sim_trace_load(path, tr, err, cap);
}
