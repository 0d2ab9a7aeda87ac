/* bank_inspect.c - `qmoe-bank inspect`: validate a bank and describe it. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_bank.h"
#include "qm_residency.h"
#include "qmoe_bank_tool.h"

void qm__help_inspect(FILE *f)
{
    fputs("usage: qmoe-bank inspect FILE [--json]\n"
          "\n"
          "Opens FILE exactly as the daemon does (mmap, full validation) and prints the\n"
          "model summary (name, path, layers, experts, hidden_size, inter_size, k,\n"
          "activation, bits, block_size, codebook (none, or e2m1 with its 16 values: code\n"
          "q weighs scale * value[q]), bytes_total = expert bytes of all layers,\n"
          "bytes_per_expert = one expert's unit in one layer), then per layer its tensors\n"
          "(dtype, shape, offset in the data section, bytes, bytes per expert) and its\n"
          "region catalog (pageable, or the non-pageable reason). Unknown tensors are\n"
          "listed as warnings. Imported banks also show their source (format, family,\n"
          "files, exact, max_rel_err), the layer map (bank layer -> model layer) and\n"
          "the routing rule (legacy, or the qmoe.routing.* keys and which layers carry a\n"
          "correction bias). --json prints the same as one JSON object.\n"
          "A corrupt or invalid file prints one line on stderr and exits with status 2.\n",
          f);
}

static void shape_str(char *buf, size_t n, const qm_tensor_view *tv)
{
    size_t off = (size_t)snprintf(buf, n, "[");
    for (uint32_t d = 0; d < tv->ndim && off < n; d++)
        off += (size_t)snprintf(buf + off, n - off, "%s%llu", d ? "," : "",
                                (unsigned long long)tv->shape[d]);
    if (off < n) snprintf(buf + off, n - off, "]");
}

static const char *model_name(const char *path, char *buf, size_t n)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(buf, n, "%s", base);
    char *dot = strrchr(buf, '.');
    if (dot && dot != buf) *dot = '\0';
    return buf;
}

/* qmoe.source, layer map and routing in words (the loader checked them). */
static void print_provenance_text(const qm_bank *bank)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    const char *src = qm_bank_source_json(bank);
    cJSON *j = src ? cJSON_Parse(src) : NULL;
    const cJSON *v;
    printf("source: %s\n", src ? src : "(none: qmoe.source absent)");
    if (j) {
        if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(j, "format")))
            printf("source_format: %s\n", v->valuestring);
        if (cJSON_IsString(v = cJSON_GetObjectItemCaseSensitive(j, "family")))
            printf("source_family: %s\n", v->valuestring);
        v = cJSON_GetObjectItemCaseSensitive(j, "exact");
        printf("exact: %s\n", cJSON_IsBool(v) ? (cJSON_IsTrue(v) ? "yes" : "no") : "unknown");
        if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(j, "max_rel_err")))
            printf("max_rel_err: %.3g\n", v->valuedouble);
    }
    cJSON_Delete(j);
    const uint32_t *map = qm_bank_layer_map(bank);
    printf("layer_map:");
    if (!map) printf(" identity (bank layer l = model layer l)");
    for (uint32_t l = 0; map && l < c->layers; l++)
        printf(" %u->%u", l, map[l]);
    printf("\n");
    const qm_routing_rule *r = &c->routing;
    if (r->score == QM_ROUTE_SCORE_LEGACY) {
        printf("routing: legacy (top-%u of the logits, softmax over the %u)\n", c->k, c->k);
        return;
    }
    printf("routing: %s scores, top-%u, normalize %d, scale %g", qm_route_score_name(r->score),
           c->k, r->normalize, (double)r->scale);
    if (r->groups > 1)
        printf(", groups %u keep %u by %s", r->groups, r->topk_groups,
               qm_group_score_name(r->group_score));
    uint32_t with_bias = 0;
    for (uint32_t l = 0; l < c->layers; l++)
        with_bias += qm_bank_layer(bank, l)->t[QM_T_ROUTER_CORRECTION_BIAS].present;
    printf(", correction bias in %u of %u layers\n", with_bias, c->layers);
}

static void print_provenance_json(const qm_bank *bank)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    const char *src = qm_bank_source_json(bank);
    /* The loader parsed it as one JSON object: spliced as is. */
    printf("\"source\":%s,\"layer_map\":", src ? src : "null");
    const uint32_t *map = qm_bank_layer_map(bank);
    if (!map) printf("null");
    for (uint32_t l = 0; map && l < c->layers; l++)
        printf("%s%u", l ? "," : "[", map[l]);
    if (map) printf("]");
    const qm_routing_rule *r = &c->routing;
    printf(",\"routing\":{\"score\":\"%s\"", qm_route_score_name(r->score));
    if (r->score != QM_ROUTE_SCORE_LEGACY) {
        printf(",\"normalize\":%d,\"scale\":%.9g,\"groups\":%u,\"topk_groups\":%u,"
               "\"group_score\":\"%s\",\"correction_bias_layers\":[",
               r->normalize, (double)r->scale, r->groups, r->topk_groups,
               qm_group_score_name(r->group_score));
        int first = 1;
        for (uint32_t l = 0; l < c->layers; l++)
            if (qm_bank_layer(bank, l)->t[QM_T_ROUTER_CORRECTION_BIAS].present) {
                printf("%s%u", first ? "" : ",", l);
                first = 0;
            }
        printf("]");
    }
    printf("},");
}

static void print_text(const qm_bank *bank, qm_region_catalog **cats)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    char name[256];
    const qm_layer_view *l0 = qm_bank_layer(bank, 0);
    printf("name: %s\npath: %s\n", model_name(qm_bank_path(bank), name, sizeof name),
           qm_bank_path(bank));
    printf("layers: %u\nexperts: %u\nhidden_size: %u\ninter_size: %u\nk: %u\n", c->layers,
           c->experts, c->hidden, c->inter, c->k);
    printf("activation: %s\nbits: %u\nblock_size: %u\n", qm_activation_name(c->activation), c->bits,
           c->block_size);
    const int8_t *book = qm_codebook_values(c->codebook);
    printf("codebook: %s", qm_codebook_name(c->codebook));
    for (int q = 0; book && q < 16; q++)
        printf("%s%d", q ? " " : " (codes 0-15: ", book[q]);
    printf("%s\n", book ? ")" : "");
    printf("bytes_total: %llu\nbytes_per_expert: %llu\n",
           (unsigned long long)qm_bank_expert_bytes_total(bank),
           (unsigned long long)l0->bytes_per_expert);
    printf("file_bytes: %llu\nswiglu_fusion: %u\nnormalize_routing_weights: %d\n",
           (unsigned long long)qm_bank_file_bytes(bank), c->swiglu_fusion, c->normalize_routing);
    printf("activation_alpha: %g\nactivation_beta: %g\nswiglu_limit: %g\n", (double)c->alpha,
           (double)c->beta, (double)c->limit);
    print_provenance_text(bank);
    for (uint32_t l = 0; l < c->layers; l++) {
        const qm_layer_view *lv = qm_bank_layer(bank, l);
        qm_nonpageable_reason r = qm_catalog_reason(cats[l]);
        size_t nreg = 0;
        qm_catalog_regions(cats[l], 0, &nreg);
        printf("layer %u: bytes_per_expert %llu, catalog %s", l,
               (unsigned long long)lv->bytes_per_expert, qm_nonpageable_reason_name(r));
        if (r == QM_NONPAGEABLE_NONE)
            printf(" (%u experts x %zu regions, %llu bytes each)", c->experts, nreg,
                   (unsigned long long)qm_catalog_bytes_per_expert(cats[l]));
        else if (qm_catalog_reason_detail(cats[l])[0])
            printf(": %s", qm_catalog_reason_detail(cats[l]));
        printf("\n");
        for (int t = 0; t < QM_T_COUNT; t++) {
            const qm_tensor_view *tv = &lv->t[t];
            char shape[96];
            if (!tv->present) continue;
            shape_str(shape, sizeof shape, tv);
            printf("  %-22s %-4s %-18s offset %-12llu bytes %-12llu",
                   qm_bank_tensor_suffix((qm_bank_tensor)t), qm_dtype_name(tv->dtype), shape,
                   (unsigned long long)tv->offset, (unsigned long long)tv->nbytes);
            if (t < QM_T_EXPERT_COUNT)
                printf(" per_expert %llu",
                       (unsigned long long)qm_expert_slice_bytes(tv, c->experts));
            printf("\n");
        }
    }
    size_t nw = 0;
    const char *const *w = qm_bank_warnings(bank, &nw);
    for (size_t i = 0; i < nw; i++)
        printf("warning: unknown tensor %s ignored\n", w[i]);
}

static void print_json(const qm_bank *bank, qm_region_catalog **cats)
{
    const qm_bank_config *c = qm_bank_get_config(bank);
    char name[256];
    printf("{\"name\":");
    qm__json_string(stdout, model_name(qm_bank_path(bank), name, sizeof name));
    printf(",\"path\":");
    qm__json_string(stdout, qm_bank_path(bank));
    printf(",\"layers\":%u,\"experts\":%u,\"hidden_size\":%u,\"inter_size\":%u,\"k\":%u,"
           "\"activation\":\"%s\",\"bits\":%u,\"block_size\":%u,\"bytes_total\":%llu,"
           "\"bytes_per_expert\":%llu,\"file_bytes\":%llu,\"swiglu_fusion\":%u,"
           "\"normalize_routing_weights\":%d,",
           c->layers, c->experts, c->hidden, c->inter, c->k, qm_activation_name(c->activation),
           c->bits, c->block_size, (unsigned long long)qm_bank_expert_bytes_total(bank),
           (unsigned long long)qm_bank_layer(bank, 0)->bytes_per_expert,
           (unsigned long long)qm_bank_file_bytes(bank), c->swiglu_fusion, c->normalize_routing);
    const int8_t *book = qm_codebook_values(c->codebook);
    if (book) {
        printf("\"codebook\":{\"name\":\"%s\",\"values\":[", qm_codebook_name(c->codebook));
        for (int q = 0; q < 16; q++)
            printf("%s%d", q ? "," : "", book[q]);
        printf("]},");
    } else {
        printf("\"codebook\":null,");
    }
    if (c->limit > 3.0e38f)
        printf("\"activation_alpha\":%.9g,\"activation_beta\":%.9g,\"swiglu_limit\":\"inf\",",
               (double)c->alpha, (double)c->beta);
    else
        printf("\"activation_alpha\":%.9g,\"activation_beta\":%.9g,\"swiglu_limit\":%.9g,",
               (double)c->alpha, (double)c->beta, (double)c->limit);
    print_provenance_json(bank);
    printf("\"layer_details\":[");
    for (uint32_t l = 0; l < c->layers; l++) {
        const qm_layer_view *lv = qm_bank_layer(bank, l);
        qm_nonpageable_reason r = qm_catalog_reason(cats[l]);
        printf("%s{\"layer\":%u,\"bytes_per_expert\":%llu,\"tensors\":[", l ? "," : "", l,
               (unsigned long long)lv->bytes_per_expert);
        int first = 1;
        for (int t = 0; t < QM_T_COUNT; t++) {
            const qm_tensor_view *tv = &lv->t[t];
            if (!tv->present) continue;
            printf("%s{\"name\":\"%s\",\"dtype\":\"%s\",\"shape\":[", first ? "" : ",",
                   qm_bank_tensor_suffix((qm_bank_tensor)t), qm_dtype_name(tv->dtype));
            for (uint32_t d = 0; d < tv->ndim; d++)
                printf("%s%llu", d ? "," : "", (unsigned long long)tv->shape[d]);
            printf("],\"offset\":%llu,\"bytes\":%llu,\"bytes_per_expert\":%llu}",
                   (unsigned long long)tv->offset, (unsigned long long)tv->nbytes,
                   (unsigned long long)(t < QM_T_EXPERT_COUNT
                                            ? qm_expert_slice_bytes(tv, c->experts)
                                            : 0));
            first = 0;
        }
        printf("],\"catalog\":{\"pageable\":%s,\"reason\":\"%s\",\"detail\":",
               r == QM_NONPAGEABLE_NONE ? "true" : "false", qm_nonpageable_reason_name(r));
        qm__json_string(stdout, qm_catalog_reason_detail(cats[l]));
        printf(",\"experts\":%u,\"bytes_per_expert\":%llu,\"total_bytes\":%llu,\"regions\":[",
               qm_catalog_expert_count(cats[l]),
               (unsigned long long)qm_catalog_bytes_per_expert(cats[l]),
               (unsigned long long)qm_catalog_total_bytes(cats[l]));
        for (uint32_t e = 0; e < qm_catalog_expert_count(cats[l]); e++) {
            size_t n = 0;
            const qm_region *reg = qm_catalog_regions(cats[l], e, &n);
            printf("%s[", e ? "," : "");
            for (size_t i = 0; i < n; i++)
                printf("%s[%u,%llu,%llu]", i ? "," : "", reg[i].tensor,
                       (unsigned long long)reg[i].offset, (unsigned long long)reg[i].length);
            printf("]");
        }
        printf("]}}");
    }
    printf("],\"warnings\":[");
    size_t nw = 0;
    const char *const *w = qm_bank_warnings(bank, &nw);
    for (size_t i = 0; i < nw; i++) {
        if (i) printf(",");
        qm__json_string(stdout, w[i]);
    }
    printf("]}\n");
}

int qm__cmd_inspect(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"json", no_argument, 0, 'j'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int json = 0, c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        if (c == 'j') {
            json = 1;
        } else if (c == 'h') {
            qm__help_inspect(stdout);
            return QM__EXIT_OK;
        } else {
            fprintf(stderr, "qmoe-bank inspect: unknown option \"%.64s\" (see --help)\n",
                    argv[optind - 1]);
            return QM__EXIT_USAGE;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "qmoe-bank inspect: expected exactly one FILE (see --help)\n");
        return QM__EXIT_USAGE;
    }
    const char *path = argv[optind];
    qm_bank *bank = NULL;
    qm_status st;
    qm_status_clear(&st);
    int rc = qm_bank_open(path, &bank, &st);
    if (rc != 0) {
        fprintf(stderr, "qmoe-bank inspect: %s: %s\n", path, st.msg[0] ? st.msg : qm_strerror(rc));
        return rc == QM_ENOMEM ? QM__EXIT_FAIL : QM__EXIT_USAGE;
    }
    const qm_bank_config *cfg = qm_bank_get_config(bank);
    qm_region_catalog **cats = calloc(cfg->layers, sizeof *cats);
    int ret = QM__EXIT_OK;
    if (!cats) {
        fprintf(stderr, "qmoe-bank inspect: out of memory\n");
        ret = QM__EXIT_FAIL;
        goto done;
    }
    for (uint32_t l = 0; l < cfg->layers; l++)
        if (qm_bank_build_catalog(bank, l, &cats[l], &st) != 0) {
            fprintf(stderr, "qmoe-bank inspect: %s: layer %u catalog: %s\n", path, l, st.msg);
            ret = QM__EXIT_FAIL;
            goto done;
        }
    if (json)
        print_json(bank, cats);
    else
        print_text(bank, cats);
done:
    if (cats)
        for (uint32_t l = 0; l < cfg->layers; l++)
            qm_catalog_free(cats[l]);
    free(cats);
    qm_bank_close(bank);
    return ret;
}
