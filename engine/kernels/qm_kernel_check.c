/* qm_kernel_check.c - the kernels' self-check at start (qm_kernel_check.h).
 *
 * The fixed shapes, chosen to reach every path a kernel has in few
 * microseconds of work each (a call owns 16 rows, so N = 24 and 19 give a
 * full tile and a partial one):
 *   fast:  4-bit, blocks of 32, no zero point, f32 scales, K 256, N 24 (the
 *          decode GEMV's common case: Q4_0 and every symmetric bank);
 *          8-bit, blocks of 64, zero points, f16 scales, K 200 (a partial
 *          sub-block), N 19; 4-bit row-wise, zero points along rows, bf16
 *          scales, K 130, N 17; and where the kernel reads r8, the first
 *          shape's codes in the r8 layout; each at 1, 3 and 9 inputs (the
 *          decode paths, and the GEMM every kernel runs from 8 inputs on);
 *          and where the kernel reads 4-bit r8, that shape as an e2m1 code
 *          book read in 4 bits (qm__qmat.cb), against the specification of
 *          the int8 matrix of the same weights;
 *   exact: the same three shapes at 1 and 3 inputs (GEMV) and 9 (GEMM).
 * Inputs: deterministic, every sub-block with a different range, some
 * zero. The specification runs once per shape and input count, then every
 * kernel still unrefused is compared with it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qm_alloc.h"
#include "qm_kernel_check.h"
#include "qm_kernel_isa.h"
#include "qm_r8.h"

#define QM__KC_ROWS 24u
#define QM__KC_MAXK 256u
#define QM__KC_NX 9u /* the most inputs a shape runs with */
#define QM__KC_ZP_BYTES 256u /* the most any shape's zero points take */

typedef struct qm__kc_shape {
    uint32_t bits, block, k, n; /* block 0: row-wise */
    int zp;                     /* 1: zero points (blockwise, or along rows when row-wise) */
    qm_dtype dt;
    int r8;                     /* 1: the codes in the r8 layout (blocks of 32) */
    int cb;                     /* 1: an e2m1 code book read in 4 bits (r8, bits 4) */
} qm__kc_shape;

static const qm__kc_shape qm__kc_shapes[] = {
    {4, 32, 256, 24, 0, QM_DTYPE_F32, 0, 0},
    {8, 64, 200, 19, 1, QM_DTYPE_F16, 0, 0},
    {4, 0, 130, 17, 1, QM_DTYPE_BF16, 0, 0},
    {4, 32, 256, 24, 0, QM_DTYPE_F32, 1, 0},
    {8, 32, 256, 24, 0, QM_DTYPE_F16, 1, 0},
    {4, 32, 256, 24, 0, QM_DTYPE_F16, 1, 1},
};
#define QM__KC_NSHAPES (sizeof qm__kc_shapes / sizeof qm__kc_shapes[0])

/* One shape's matrix and inputs; everything in one allocation. */
typedef struct qm__kc_case {
    qm__qmat m;
    float *x;        /* QM__KC_NX inputs of k */
    float *ys, *y;   /* the specification's outputs, the kernel's */
    float *xp;       /* prepared inputs (ld floats apart) */
    float *scratch;
    size_t ld;       /* fast mode's; an exact kernel's rows are its own (qm__kc_exact_run) */
    void *mem;
} qm__kc_case;

static uint32_t qm__kc_next(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* The weights, scales, zero points and inputs of shape sh (r8: interleaved). */
static void qm__kc_fill(const qm__kc_shape *sh, qm__kc_case *c, uint8_t *w, uint8_t *zp,
                        uint16_t *sc)
{
    uint32_t s = 0x9e3779b9u ^ (sh->bits << 8) ^ sh->k;
    size_t wbytes = (size_t)sh->n * c->m.row_bytes, nsc = (size_t)sh->n * c->m.nblk;
    for (size_t i = 0; i < wbytes; i++)
        w[i] = (uint8_t)qm__kc_next(&s);
    for (size_t i = 0; i < QM__KC_ZP_BYTES; i++)
        zp[i] = (uint8_t)qm__kc_next(&s);
    for (size_t i = 0; i < nsc; i++) {
        float v = (float)(1 + qm__kc_next(&s) % 1000) * 1e-4f * (qm__kc_next(&s) % 8 ? 1.f : -1.f);
        if (sh->dt == QM_DTYPE_F32) {
            memcpy((float *)(void *)sc + i, &v, 4);
        } else if (sh->dt == QM_DTYPE_F16) {
            sc[i] = qm_f32_to_f16(v);
        } else {
            uint32_t u;
            memcpy(&u, &v, 4);
            sc[i] = (uint16_t)(u >> 16);
        }
    }
    for (uint32_t i = 0; i < QM__KC_NX * sh->k; i++) {
        uint32_t col = i % sh->k;
        float range = (float)(1u << ((col / 32) % 5)) * 0.25f;
        c->x[i] = (col / 32) % 4 == 3 ? 0.0f
                                      : range * ((float)(qm__kc_next(&s) % 2001) - 1000.f) / 1000.f;
    }
    if (sh->r8) {
        uint8_t tmp[8 * QM__KC_MAXK];
        qm__r8_interleave(w, sh->n, c->m.row_bytes, tmp);
    }
}

/* Shape sh as a case; -1 on no memory. */
static int qm__kc_case_new(const qm__kc_shape *sh, qm__kc_case *c)
{
    memset(c, 0, sizeof *c);
    uint32_t nblk = sh->block ? (sh->k + sh->block - 1) / sh->block : 1;
    c->m = (qm__qmat){.row_bytes = ((size_t)sh->k * sh->bits + 7) / 8, .scale_dtype = sh->dt,
                      .zp_blockwise = sh->block != 0, .n = sh->n, .k = sh->k, .bits = sh->bits,
                      .nblk = nblk, .block = sh->block ? sh->block : sh->k, .r8 = sh->r8,
                      .cb = sh->cb ? qm_codebook_values(QM_CODEBOOK_E2M1) : NULL};
    c->m.zp_row_bytes = c->m.zp_blockwise ? ((size_t)nblk * sh->bits + 7) / 8 : 0;
    size_t es = sh->dt == QM_DTYPE_F32 ? 4 : 2, sf = qm__kernel_scratch_floats(&c->m);
    size_t wb = ((size_t)sh->n * c->m.row_bytes + 63) & ~(size_t)63;
    size_t sb = ((size_t)sh->n * nblk * es + 63) & ~(size_t)63;
    c->ld = (qm__i8_x_stride(&c->m) + 15) & ~(size_t)15;
    size_t floats = (size_t)QM__KC_NX * (sh->k + 2 * sh->n + c->ld) + sf + 64;
    c->mem = qm_calloc(wb + sb + QM__KC_ZP_BYTES + sizeof(float) * floats, 1);
    if (!c->mem)
        return -1;
    uint8_t *w = c->mem, *zp = w + wb + sb;
    c->m.w = w;
    c->m.scales = w + wb;
    c->m.zp = sh->zp ? zp : NULL;
    float *f = (float *)(void *)(zp + QM__KC_ZP_BYTES);
    c->x = f;
    c->ys = c->x + (size_t)QM__KC_NX * sh->k;
    c->y = c->ys + (size_t)QM__KC_NX * sh->n;
    c->xp = c->y + (size_t)QM__KC_NX * sh->n;
    c->scratch = c->xp + (size_t)QM__KC_NX * c->ld;
    qm__kc_fill(sh, c, w, zp, (uint16_t *)(void *)(w + wb));
    return 0;
}

/* fn over every 16-row tile of the case's matrix, nx prepared inputs. */
static void qm__kc_tiles(qm__mm_fn *fn, const qm__qmat *m, const qm__kc_case *c, uint32_t nx,
                         float *y)
{
    for (uint32_t n0 = 0; n0 < m->n; n0 += QM__TILE_ROWS)
        fn(m, n0, n0 + QM__TILE_ROWS < m->n ? n0 + QM__TILE_ROWS : m->n, c->xp, c->ld, nx, y,
           m->n, c->scratch);
}

static const char *qm__kc_dt(qm_dtype dt)
{
    return dt == QM_DTYPE_F32 ? "f32" : dt == QM_DTYPE_F16 ? "f16" : "bf16";
}

/* The shape in words, for a reason. */
static void qm__kc_what(const qm__kc_shape *sh, uint32_t nx, char *out, size_t cap)
{
    snprintf(out, cap, "%u-bit %s%u k %u n %u%s %s scales%s%s, %u input%s", sh->bits,
             sh->block ? "blocks of " : "row-wise", sh->block, sh->k, sh->n, sh->zp ? " zp" : "",
             qm__kc_dt(sh->dt), sh->r8 ? " r8" : "", sh->cb ? " e2m1 code book" : "", nx,
             nx == 1 ? "" : "s");
}

/* ---- the verdicts ---- */

static qm_kernel_check qm__kc;
static pthread_once_t qm__kc_once = PTHREAD_ONCE_INIT;

/* Row i's verdict slot: the exact rows first, then the fast ones. */
static qm_kernel_verdict *qm__kc_slot(int fast, size_t i)
{
    size_t at = fast ? qm__exact_count() + i : i;
    return at < QM_KERNEL_CHECK_MAX ? &qm__kc.v[at] : NULL;
}

/* Refuses the row of slot v with the shape, the input count and what. */
static void qm__kc_refuse(qm_kernel_verdict *v, const qm__kc_shape *sh, uint32_t nx,
                          const char *what)
{
    char shape[80];
    qm__kc_what(sh, nx, shape, sizeof shape);
    snprintf(v->reason, sizeof v->reason, "%s: %s", shape, what);
    v->kind = QM_KERNEL_REFUSED;
}

/* Shape sh at nx inputs: the specification once, then every fast row still
 * unchecked (kind 0) that takes the shape: refused at its first output
 * whose bits differ. */
static void qm__kc_fast_shape(const qm__kc_shape *sh, qm__kc_case *c, uint32_t nx)
{
    qm__qmat rows = c->m; /* the specification reads rows, never r8 */
    uint8_t back[QM__KC_ROWS * QM__KC_MAXK], wide[QM__KC_ROWS * QM__KC_MAXK];
    if (sh->r8) {
        qm__r8_rows(c->m.w, c->m.row_bytes, 0, c->m.n, back);
        rows.w = back;
        rows.r8 = 0;
    }
    for (uint32_t r = 0; r < nx; r++)
        qm__i8_prep(&c->m, c->x + (size_t)r * sh->k, c->xp + r * c->ld);
    if (sh->cb) {
        /* The specification: the int8 matrix of codes 128 + cb[q], its own
         * prepared inputs (8-bit) after the kernel's (4-bit) in xp. */
        qm__cb_rows_c(&rows, 0, rows.n, wide);
        rows.w = wide;
        rows.cb = NULL;
        rows.bits = 8;
        rows.row_bytes = rows.k;
        size_t ld8 = (qm__i8_x_stride(&rows) + 15) & ~(size_t)15;
        float *xp8 = qm_malloc(sizeof(float) * nx * ld8);
        if (!xp8)
            return;
        for (uint32_t r = 0; r < nx; r++)
            qm__i8_prep(&rows, c->x + (size_t)r * sh->k, xp8 + r * ld8);
        for (uint32_t n0 = 0; n0 < rows.n; n0 += QM__TILE_ROWS)
            qm__i8kernel_scalar.mm(&rows, n0, n0 + QM__TILE_ROWS < rows.n ? n0 + QM__TILE_ROWS
                                                                          : rows.n,
                                   xp8, ld8, nx, c->ys, rows.n, c->scratch);
        qm_free(xp8);
    } else {
        qm__kc_tiles(qm__i8kernel_scalar.mm, &rows, c, nx, c->ys);
    }
    for (size_t i = 0; i < qm__i8isa_count(); i++) {
        qm_kernel_verdict *v = qm__kc_slot(1, i);
        const qm__i8isa *row = qm__i8isa_at(i);
        if (!v || v->kind != 0 ||
            (sh->r8 && !(sh->bits == 8 ? row->reads_r8_q8 : row->reads_r8)))
            continue;
        memset(c->y, 0xa5, sizeof(float) * nx * sh->n);
        qm__kc_tiles(row->kernel.mm, &c->m, c, nx, c->y);
        for (size_t o = 0; o < (size_t)nx * sh->n; o++) {
            uint32_t a, b;
            memcpy(&a, &c->y[o], 4);
            memcpy(&b, &c->ys[o], 4);
            if (a != b) {
                char what[96];
                snprintf(what, sizeof what, "output [%zu][%zu] is 0x%08x, the specification's "
                         "0x%08x", o / sh->n, o % sh->n, a, b);
                qm__kc_refuse(v, sh, nx, what);
                break;
            }
        }
    }
}

/* sum_c |W[n,c] x[c]| of output (input r, row n), in double. */
static double qm__kc_abs_dot(const qm__qmat *m, const float *x, uint32_t n)
{
    const uint8_t *row = m->w + (size_t)n * m->row_bytes;
    double s = 0;
    for (uint32_t col = 0; col < m->k; col++) {
        uint32_t b = col / m->block;
        double w = (double)qm__qmat_scale(m, n, b) *
                   (qm__qmat_code(m, row, col) - qm__qmat_zp(m, n, b));
        s += w * x[col] < 0 ? -(w * x[col]) : w * x[col];
    }
    return s;
}

/* k (GEMV path below 5 inputs, GEMM from 5) on the case at nx inputs into
 * y, its prepared rows in their own block; -1 on no memory. */
static int qm__kc_exact_run(const qm__kernel *k, qm__kc_case *c, uint32_t nx, float *y)
{
    int gemm = nx > QM__GEMV_MAX_ROWS;
    size_t ld = (k->x_stride(&c->m, gemm) + 15) & ~(size_t)15;
    uint32_t pad = k->gemm_row_pad ? k->gemm_row_pad : 1, rows = (nx + pad - 1) / pad * pad;
    float *xp = qm_calloc(ld * rows + 16, sizeof(float));
    if (!xp)
        return -1;
    for (uint32_t r = 0; r < nx; r++)
        k->prep(&c->m, gemm, c->x + (size_t)r * c->m.k, xp + r * ld);
    for (uint32_t n0 = 0; n0 < c->m.n; n0 += QM__TILE_ROWS) {
        uint32_t n1 = n0 + QM__TILE_ROWS < c->m.n ? n0 + QM__TILE_ROWS : c->m.n;
        (gemm ? k->gemm : k->gemv)(&c->m, n0, n1, xp, ld, nx, y, c->m.n, c->scratch);
    }
    qm_free(xp);
    return 0;
}

/* Shape sh at nx inputs: the specification and each output's bound
 * (2e-5 sum |W x|) once, then every exact row still unchecked: refused at
 * its first output outside the bound. -1 on no memory. */
static int qm__kc_exact_shape(const qm__kc_shape *sh, qm__kc_case *c, uint32_t nx)
{
    double *bound = qm_malloc(sizeof(double) * nx * sh->n);
    if (!bound || qm__kc_exact_run(&qm__kernel_scalar, c, nx, c->ys) != 0) {
        qm_free(bound);
        return -1;
    }
    for (uint32_t r = 0; r < nx; r++)
        for (uint32_t n = 0; n < sh->n; n++)
            bound[(size_t)r * sh->n + n] =
                2e-5 * qm__kc_abs_dot(&c->m, c->x + (size_t)r * sh->k, n) + 1e-30;
    int rc = 0;
    for (size_t i = 0; i < qm__exact_count() && rc == 0; i++) {
        qm_kernel_verdict *v = qm__kc_slot(0, i);
        if (!v || v->kind != 0)
            continue;
        memset(c->y, 0xa5, sizeof(float) * nx * sh->n);
        rc = qm__kc_exact_run(qm__exact_at(i), c, nx, c->y);
        for (size_t o = 0; rc == 0 && o < (size_t)nx * sh->n; o++) {
            double a = c->y[o], b = c->ys[o];
            if (!(a - b <= bound[o] && b - a <= bound[o])) {
                char what[128];
                snprintf(what, sizeof what, "output [%zu][%zu] is %.9g, the specification's "
                         "%.9g (bound %.3g)", o / sh->n, o % sh->n, a, b, bound[o]);
                qm__kc_refuse(v, sh, nx, what);
                break;
            }
        }
    }
    qm_free(bound);
    return rc;
}

/* Every unchecked row (kind 0) through every shape; the ones left
 * standing verified. Out of memory refuses what was left unchecked. */
static void qm__kc_check_all(void)
{
    static const uint32_t NX[] = {1, 3, 9}; /* GEMV paths; the GEMM of every row */
    int oom = 0;
    for (size_t s = 0; s < QM__KC_NSHAPES && !oom; s++) {
        const qm__kc_shape *sh = &qm__kc_shapes[s];
        qm__kc_case c;
        if (qm__kc_case_new(sh, &c) != 0) {
            oom = 1;
            break;
        }
        for (int j = 0; j < 3; j++)
            qm__kc_fast_shape(sh, &c, NX[j]);
        for (int j = 0; j < 3 && !sh->r8 && !oom; j++)
            oom = qm__kc_exact_shape(sh, &c, NX[j]) != 0;
        qm_free(c.mem);
    }
    for (unsigned i = 0; i < qm__kc.n; i++) {
        qm_kernel_verdict *v = &qm__kc.v[i];
        if (v->kind != 0)
            continue;
        v->kind = oom ? QM_KERNEL_REFUSED : QM_KERNEL_VERIFIED; /* unchecked is never used */
        snprintf(v->reason, sizeof v->reason, "%s", oom ? "out of memory for the self-check" : "");
    }
}

/* Every row's name, precision, and whether this process can run it
 * (unavailable: why); the runnable ones left unchecked (kind 0). */
static void qm__kc_rows(void)
{
    size_t ne = qm__exact_count(), nf = qm__i8isa_count();
    qm__kc.n = 0;
    for (size_t at = 0; at < ne + nf && at < QM_KERNEL_CHECK_MAX; at++) {
        int fast = at >= ne;
        size_t i = fast ? at - ne : at;
        qm_kernel_verdict *v = &qm__kc.v[qm__kc.n++];
        const qm__i8isa *row = fast ? qm__i8isa_at(i) : NULL;
        v->precision = fast ? "fast" : "exact";
        v->name = fast ? row->kernel.name : qm__exact_at(i)->name;
        v->kind = 0;
        v->reason[0] = 0;
        if (fast && row->not_built)
            snprintf(v->reason, sizeof v->reason, "%s", row->not_built);
        else if (qm__cpu_needs(fast ? row->needs : qm__exact_at(i)->needs, v->reason,
                               sizeof v->reason))
            continue;
        v->kind = QM_KERNEL_UNAVAILABLE;
    }
}

/* The verdicts as the cache's payload: "fast avx2 ok;exact avx512 refused <reason>;...". */
static void qm__kc_payload(char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (unsigned i = 0; i < qm__kc.n; i++) {
        const qm_kernel_verdict *v = &qm__kc.v[i];
        if (v->kind != QM_KERNEL_VERIFIED && v->kind != QM_KERNEL_REFUSED)
            continue;
        char reason[sizeof v->reason];
        snprintf(reason, sizeof reason, "%s", v->reason);
        for (char *p = reason; *p; p++)
            if (*p == ';' || *p == '|' || *p == '\n')
                *p = ',';
        int n = snprintf(out + o, cap - o, "%s%s %s %s%s%s", o ? ";" : "", v->precision, v->name,
                         v->kind == QM_KERNEL_VERIFIED ? "ok" : "refused", reason[0] ? " " : "",
                         reason);
        if (n < 0 || (size_t)n >= cap - o) {
            out[0] = 0;
            return;
        }
        o += (size_t)n;
    }
}

/* The verdicts from the cache's payload: 0 when it names exactly the rows
 * this process can run, each ok or refused; else -1 (checked again). */
static int qm__kc_from_payload(const char *payload)
{
    unsigned seen = 0, runnable = 0;
    for (unsigned i = 0; i < qm__kc.n; i++)
        runnable += qm__kc.v[i].kind == 0;
    for (const char *p = payload; *p;) {
        size_t len = strcspn(p, ";");
        char prec[8], name[32], word[16];
        int used = 0;
        if (sscanf(p, "%7s %31s %15[a-z]%n", prec, name, word, &used) != 3 || (size_t)used > len)
            return -1;
        qm_kernel_verdict *v = NULL;
        for (unsigned i = 0; i < qm__kc.n && !v; i++)
            if (qm__kc.v[i].kind == 0 && !strcmp(qm__kc.v[i].precision, prec) &&
                !strcmp(qm__kc.v[i].name, name))
                v = &qm__kc.v[i];
        int ok = !strcmp(word, "ok");
        if (!v || (!ok && strcmp(word, "refused")))
            return -1;
        const char *r = p + used + (p[used] == ' ');
        snprintf(v->reason, sizeof v->reason, "%.*s", (int)(p + len - r), r);
        v->kind = ok ? QM_KERNEL_VERIFIED : QM_KERNEL_REFUSED;
        seen++;
        p += len + (p[len] == ';');
    }
    return seen == runnable ? 0 : -1;
}

static double qm__kc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void qm__kc_run_once(void)
{
    double t0 = qm__kc_now_ms();
    qm__cpu_brand(qm__kc.cpu, sizeof qm__kc.cpu);
    qm__cpu_flags(qm__kc.flags, sizeof qm__kc.flags);
    qm__kc_rows();
    const char *cache = getenv("QMOE_KERNEL_CACHE");
    char payload[2048];
    qm__kc.cached = cache && *cache &&
                    qm__cache_get(cache, "qmoe-kernel-check", payload, sizeof payload) == 0 &&
                    qm__kc_from_payload(payload) == 0;
    if (!qm__kc.cached) {
        qm__kc_rows(); /* a payload that did not fit may have set some */
        qm__kc_check_all();
        qm__kc_payload(payload, sizeof payload);
        if (cache && *cache && payload[0])
            qm__cache_put(cache, "qmoe-kernel-check", payload);
    }
    qm__kc.verified = qm__kc.refused = 0;
    for (unsigned i = 0; i < qm__kc.n; i++) {
        qm__kc.verified += qm__kc.v[i].kind == QM_KERNEL_VERIFIED;
        qm__kc.refused += qm__kc.v[i].kind == QM_KERNEL_REFUSED;
    }
    qm__kc.ms = qm__kc_now_ms() - t0;
}

const qm_kernel_check *qm_kernel_check_run(void)
{
    pthread_once(&qm__kc_once, qm__kc_run_once);
    return &qm__kc;
}

void qm__kcheck_rerun(void)
{
    int ran = qm__kc.n > 0;
    qm_kernel_check_run(); /* the once spent: the first check, or nothing */
    if (ran) {
        memset(&qm__kc, 0, sizeof qm__kc);
        qm__kc_run_once();
    }
}

int qm__kcheck_ok(int fast, size_t i)
{
    qm_kernel_check_run();
    const qm_kernel_verdict *v = qm__kc_slot(fast, i);
    return v && v->kind == QM_KERNEL_VERIFIED;
}

void qm__kcheck_assume(int fast, size_t i, int verified)
{
    qm_kernel_check_run();
    qm_kernel_verdict *v = qm__kc_slot(fast, i);
    if (v)
        v->kind = verified ? QM_KERNEL_VERIFIED : QM_KERNEL_REFUSED;
}

int qm_kernel_check_forced(qm_status *st)
{
    const qm_kernel_check *kc = qm_kernel_check_run();
    const char *force = getenv("QMOE_KERNEL");
    if (!force)
        return 0;
    int fi = qm__i8isa_find(force), ei = qm__exact_find(force);
    /* An exact name forces the exact kernel and, by name or alias, a fast one. */
    for (int fast = 0; fast < 2; fast++) {
        int i = fast ? fi : ei;
        const qm_kernel_verdict *v = i < 0 ? NULL : qm__kc_slot(fast, (size_t)i);
        if (v && v->kind == QM_KERNEL_REFUSED)
            return qm_status_set(st, QM_EINVAL,
                                 "QMOE_KERNEL=%s: the %s kernel %s was refused by the self-check "
                                 "on %s: %s", force, v->precision, v->name, kc->cpu, v->reason);
    }
    return 0;
}

int qm_kernel_check_break(const char *spec, qm_status *st)
{
    char why[160];
    if (qm__kernel_break(spec, why, sizeof why) != 0)
        return qm_status_set(st, QM_EINVAL, "%s", why);
    return 0;
}
