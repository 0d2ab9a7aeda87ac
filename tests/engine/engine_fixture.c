/* engine_fixture.c - see engine_fixture.h. */
#include "engine_fixture.h"

#include "qm_r8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

uint64_t tl_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float tl_uniform(uint64_t *s, float lo, float hi)
{
    double u = (double)(tl_rand(s) >> 11) / 9007199254740992.0;
    return (float)(lo + (hi - lo) * u);
}

void tl_random_inputs(uint64_t seed, uint32_t T, uint32_t H, uint32_t E, float *x, float *logits)
{
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)T * H; i++) {
        float v = tl_uniform(&s, -1.0f, 1.0f);
        x[i] = v == 0.0f ? 0.25f : v;
    }
    for (size_t i = 0; i < (size_t)T * E; i++)
        logits[i] = tl_uniform(&s, -2.0f, 2.0f);
}

tl_spec tl_default_spec(uint64_t seed)
{
    tl_spec s = {.E = 4, .H = 88, .I = 52, .k = 2, .bits = 4, .block_size = 32,
                 .act = QM_ACT_SILU, .fusion = 1, .asym = 0, .bias = 1, .router = 0,
                 .scale_dtype = QM_DTYPE_F32, .bias_dtype = QM_DTYPE_F32,
                 .alpha = 1.702f, .beta = 1.0f, .limit = 7.0f, .seed = seed};
    return s;
}

/* Stores v in dtype at index i and returns the value as stored. */
static double tl_store(void *base, qm_dtype dt, size_t i, float v)
{
    if (dt == QM_DTYPE_F32) {
        ((float *)base)[i] = v;
        return v;
    }
    uint16_t h = dt == QM_DTYPE_F16 ? qm_f32_to_f16(v) : qm_f32_to_bf16(v);
    ((uint16_t *)base)[i] = h;
    return dt == QM_DTYPE_F16 ? qm_f16_to_f32(h) : qm_bf16_to_f32(h);
}

static size_t tl_dsize(qm_dtype dt)
{
    return dt == QM_DTYPE_F32 ? 4 : dt == QM_DTYPE_U8 ? 1 : 2;
}

static void tl_view(qm_tensor_view *tv, qm_dtype dt, uint32_t ndim, uint64_t d0, uint64_t d1,
                    uint64_t d2, void *data)
{
    tv->present = 1;
    tv->dtype = dt;
    tv->ndim = ndim;
    tv->shape[0] = d0;
    tv->shape[1] = d1;
    tv->shape[2] = d2;
    uint64_t n = d0 * d1 * (ndim == 3 ? d2 : 1);
    tv->nbytes = n * tl_dsize(dt);
    tv->offset = 0;
    tv->data = data;
}


/* One quantised matrix [E, N, K] with random codes, scales, zero points, bias. */
static int tl_matrix(tl_layer *L, int mi, int wt, uint32_t N, uint32_t K, uint64_t *rng)
{
    const tl_spec *s = &L->spec;
    uint32_t E = s->E, bits = s->bits, pack = 8 / bits, bs = s->block_size;
    uint32_t nblk = bs ? (K + bs - 1) / bs : 1;
    int blockwise = bs && nblk > 1;
    size_t row_bytes = (K + pack - 1) / pack;
    size_t zrow = blockwise ? (nblk + pack - 1) / pack : 0;
    size_t zbytes = blockwise ? (size_t)E * N * zrow : (size_t)E * ((N + pack - 1) / pack);
    uint8_t *w = calloc((size_t)E * N * row_bytes, 1);
    void *sc = calloc((size_t)E * N * nblk, tl_dsize(s->scale_dtype));
    uint8_t *zp = s->asym ? calloc(zbytes, 1) : NULL;
    void *bias = s->bias ? calloc((size_t)E * N, tl_dsize(s->bias_dtype)) : NULL;
    double *deq = malloc(sizeof(double) * E * N * K);
    double *db = calloc((size_t)E * N, sizeof(double));
    if (!w || !sc || (s->asym && !zp) || (s->bias && !bias) || !deq || !db)
        return -1;
    const int8_t *cb = qm_codebook_values(s->codebook);
    uint32_t maxq = cb ? 15u : (1u << bits) - 1, half = cb ? 8u : 1u << (bits - 1);
    for (uint32_t e = 0; e < E; e++) {
        for (uint32_t n = 0; n < N; n++) {
            double scale[1024];
            int zpv[1024];
            for (uint32_t b = 0; b < nblk; b++) {
                float v = tl_uniform(rng, 0.5f, 1.5f) / (sqrtf((float)K) * (float)half);
                scale[b] = tl_store(sc, s->scale_dtype, ((size_t)e * N + n) * nblk + b, v);
                zpv[b] = 1 << (bits - 1);
                if (s->asym) {
                    zpv[b] = (int)(tl_rand(rng) % (maxq + 1));
                    if (blockwise)
                        zp[((size_t)e * N + n) * zrow + b / pack] |=
                            (uint8_t)(zpv[b] << ((b % pack) * bits));
                }
            }
            if (s->asym && !blockwise) {
                size_t per_e = (N + pack - 1) / pack;
                zp[(size_t)e * per_e + n / pack] |= (uint8_t)(zpv[0] << ((n % pack) * bits));
            }
            uint8_t *row = w + ((size_t)e * N + n) * row_bytes;
            for (uint32_t c = 0; c < K; c++) {
                uint32_t q = (uint32_t)(tl_rand(rng) % (maxq + 1));
                uint32_t b = bs ? c / bs : 0;
                double v = (double)((int)q - zpv[b]);
                if (cb) {
                    v = cb[q];
                    if (bits == 8)
                        q = (uint32_t)(128 + cb[q]);
                }
                row[c / pack] |= (uint8_t)(q << ((c % pack) * bits));
                deq[((size_t)e * N + n) * K + c] = scale[b] * v;
            }
            if (bias)
                db[(size_t)e * N + n] =
                    tl_store(bias, s->bias_dtype, (size_t)e * N + n, tl_uniform(rng, -0.5f, 0.5f));
        }
    }
    tl_view(&L->lv.t[wt], QM_DTYPE_U8, 3, E, N, row_bytes, w);
    if (blockwise)
        tl_view(&L->lv.t[wt + 1], s->scale_dtype, 3, E, N, nblk, sc);
    else
        tl_view(&L->lv.t[wt + 1], s->scale_dtype, 2, E, N, 0, sc);
    if (zp) {
        if (blockwise)
            tl_view(&L->lv.t[wt + 2], QM_DTYPE_U8, 3, E, N, zrow, zp);
        else
            tl_view(&L->lv.t[wt + 2], QM_DTYPE_U8, 2, E, (N + pack - 1) / pack, 0, zp);
    }
    if (bias)
        tl_view(&L->lv.t[wt + 3], s->bias_dtype, 2, E, N, 0, bias);
    L->buf[wt] = w;
    L->buf[wt + 1] = sc;
    L->buf[wt + 2] = zp;
    L->buf[wt + 3] = bias;
    L->deq[mi] = deq;
    L->bias[mi] = db;
    L->n[mi] = N;
    L->kk[mi] = K;
    return 0;
}

int tl_layer_build(const tl_spec *spec, tl_layer *L)
{
    memset(L, 0, sizeof *L);
    L->spec = *spec;
    const tl_spec *s = spec;
    uint64_t rng = s->seed;
    int swiglu = s->act == QM_ACT_SWIGLU;
    uint32_t N1 = swiglu && s->fusion != 0 ? 2 * s->I : s->I;
    L->cfg = (qm_bank_config){.layers = 1, .experts = s->E, .hidden = s->H, .inter = s->I,
                              .k = s->k, .bits = s->bits, .block_size = s->block_size,
                              .activation = s->act, .swiglu_fusion = s->fusion,
                              .normalize_routing = 1, .alpha = s->alpha, .beta = s->beta,
                              .limit = s->limit,
                              .codebook = s->bits == 4 ? s->codebook : QM_CODEBOOK_NONE};
    L->lv.index = 0;
    if (tl_matrix(L, 0, QM_T_FC1_WEIGHT, N1, s->H, &rng) < 0 ||
        tl_matrix(L, 1, QM_T_FC2_WEIGHT, s->H, s->I, &rng) < 0)
        return -1;
    if (swiglu && s->fusion == 0 && tl_matrix(L, 2, QM_T_FC3_WEIGHT, s->I, s->H, &rng) < 0)
        return -1;
    if (s->router) {
        float *rw = malloc(sizeof(float) * s->E * s->H), *rb = malloc(sizeof(float) * s->E);
        L->router_w = malloc(sizeof(double) * s->E * s->H);
        L->router_b = malloc(sizeof(double) * s->E);
        if (!rw || !rb || !L->router_w || !L->router_b)
            return -1;
        for (size_t i = 0; i < (size_t)s->E * s->H; i++)
            L->router_w[i] = rw[i] = tl_uniform(&rng, -0.3f, 0.3f);
        for (uint32_t e = 0; e < s->E; e++)
            L->router_b[e] = rb[e] = tl_uniform(&rng, -0.5f, 0.5f);
        tl_view(&L->lv.t[QM_T_ROUTER_WEIGHT], QM_DTYPE_F32, 2, s->E, s->H, 0, rw);
        tl_view(&L->lv.t[QM_T_ROUTER_BIAS], QM_DTYPE_F32, 1, s->E, 1, 0, rb);
        L->lv.t[QM_T_ROUTER_BIAS].nbytes = 4ull * s->E;
        L->buf[QM_T_ROUTER_WEIGHT] = rw;
        L->buf[QM_T_ROUTER_BIAS] = rb;
    }
    uint64_t per = 0;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++)
        if (L->lv.t[t].present)
            per += L->lv.t[t].nbytes / s->E;
    L->lv.bytes_per_expert = per;
    return 0;
}

void tl_layer_free(tl_layer *L)
{
    for (int t = 0; t < QM_T_COUNT; t++)
        free(L->buf[t]);
    for (int i = 0; i < 3; i++) {
        free(L->deq[i]);
        free(L->bias[i]);
    }
    free(L->router_w);
    free(L->router_b);
    memset(L, 0, sizeof *L);
}

void tl_layer_r8(tl_layer *L)
{
    for (int wt = QM_T_FC1_WEIGHT; wt <= QM_T_FC3_WEIGHT; wt += 4) {
        qm_tensor_view *tv = &L->lv.t[wt];
        if (!tv->present)
            continue;
        uint32_t n = (uint32_t)tv->shape[1];
        size_t rb = (size_t)tv->shape[2];
        uint8_t *tmp = malloc(8 * rb);
        for (uint32_t e = 0; e < L->spec.E; e++)
            qm__r8_interleave((uint8_t *)tv->data + (size_t)e * n * rb, n, rb, tmp);
        free(tmp);
        L->r8_mask |= 1u << wt;
    }
}

void tl_expert_weights(const tl_layer *L, uint32_t e, qm_expert_weights *w)
{
    w->r8 = L->r8_mask;
    for (int t = 0; t < QM_T_EXPERT_COUNT; t++) {
        const qm_tensor_view *tv = &L->lv.t[t];
        w->ptr[t] = tv->present ? (const uint8_t *)tv->data + e * (tv->nbytes / L->spec.E) : NULL;
    }
}

static int tl_acquire(void *ctx, uint32_t layer, const uint32_t *experts, size_t n,
                      qm_expert_weights *weights, size_t *n_ready, qm_status *st)
{
    (void)layer;
    (void)st;
    for (size_t i = 0; i < n; i++)
        tl_expert_weights(ctx, experts[i], &weights[i]);
    *n_ready = n;
    return 0;
}

void tl_source(tl_layer *L, qm_expert_source *out)
{
    *out = (qm_expert_source){.version = QM_EXPERT_SOURCE_VERSION, .ctx = L, .acquire = tl_acquire};
}

static double tl_sigmoid(double z)
{
    return 1.0 / (1.0 + exp(-z));
}

static void tl_matvec(const tl_layer *L, int mi, uint32_t e, const double *x, double *y)
{
    uint32_t N = L->n[mi], K = L->kk[mi];
    for (uint32_t n = 0; n < N; n++) {
        const double *w = L->deq[mi] + ((size_t)e * N + n) * K;
        double acc = L->bias[mi][(size_t)e * N + n];
        for (uint32_t c = 0; c < K; c++)
            acc += w[c] * x[c];
        y[n] = acc;
    }
}

void tl_reference(const tl_layer *L, const float *x, const float *logits, uint32_t T, double *out)
{
    const tl_spec *s = &L->spec;
    uint32_t E = s->E, H = s->H, I = s->I, k = s->k;
    double *xd = malloc(sizeof(double) * H), *h1 = malloc(sizeof(double) * 2 * I);
    double *h3 = malloc(sizeof(double) * I), *a = malloc(sizeof(double) * I);
    double *y = malloc(sizeof(double) * H);
    for (uint32_t t = 0; t < T; t++) {
        for (uint32_t c = 0; c < H; c++)
            xd[c] = x[(size_t)t * H + c];
        const float *l = logits + (size_t)t * E;
        uint32_t sel[64];
        double w[64], sum = 0;
        for (uint32_t j = 0; j < k; j++) {
            int best = -1;
            for (uint32_t e = 0; e < E; e++) {
                int taken = 0;
                for (uint32_t i = 0; i < j; i++)
                    taken |= sel[i] == e;
                if (!taken && (best < 0 || l[e] >= l[best]))
                    best = (int)e;
            }
            sel[j] = (uint32_t)best;
        }
        for (uint32_t j = 0; j < k; j++)
            sum += w[j] = exp((double)l[sel[j]] - (double)l[sel[0]]);
        for (uint32_t c = 0; c < H; c++)
            out[(size_t)t * H + c] = 0;
        for (uint32_t j = 0; j < k; j++) {
            double wj = w[j] / sum;
            if (wj <= 1e-8)
                continue;
            uint32_t e = sel[j];
            tl_matvec(L, 0, e, xd, h1);
            if (L->deq[2])
                tl_matvec(L, 2, e, xd, h3);
            for (uint32_t i = 0; i < I; i++) {
                double h = h1[i];
                switch (s->act) {
                case QM_ACT_RELU: a[i] = h > 0 ? h : 0; break;
                case QM_ACT_GELU:
                    a[i] = 0.5 * h * (1 + tanh(sqrt(2 / M_PI) * (h + 0.044715 * h * h * h)));
                    break;
                case QM_ACT_SILU: a[i] = h * tl_sigmoid(h); break;
                case QM_ACT_IDENTITY: a[i] = h; break;
                case QM_ACT_SWIGLU: {
                    double g, lin;
                    if (s->fusion == 1) {
                        g = h1[2 * i];
                        lin = h1[2 * i + 1];
                    } else if (s->fusion == 2) {
                        g = h1[i];
                        lin = h1[I + i];
                    } else {
                        g = h1[i];
                        lin = h3[i];
                    }
                    double lim = s->limit;
                    double G = g < lim ? g : lim;
                    double Lc = lin > lim ? lim : lin < -lim ? -lim : lin;
                    a[i] = G * tl_sigmoid(s->alpha * G) * (Lc + s->beta);
                    break;
                }
                }
            }
            tl_matvec(L, 1, e, a, y);
            for (uint32_t c = 0; c < H; c++)
                out[(size_t)t * H + c] += wj * y[c];
        }
    }
    free(xd);
    free(h1);
    free(h3);
    free(a);
    free(y);
}

double tl_rel_err_f(const float *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    if (den == 0)
        return sqrt(num);
    return sqrt(num / den);
}
