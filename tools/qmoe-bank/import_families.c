/* import_families.c - the family table's help lines and JSON (see
 * import_families.h). */
#include "import_families.h"

#include <string.h>

#include "qmoe_bank_tool.h"

void qm__family_help(FILE *f, int gguf)
{
    for (size_t i = 0; i < qm_n_families; i++) {
        const qm_family *m = &qm_families[i];
        if (gguf && m->gguf_arch)
            fprintf(f, "  %-12s %s%s\n", m->gguf_arch, m->name,
                    m->gguf_sigmoid ? " (sigmoid gating)" : "");
        else if (!gguf)
            fprintf(f, "  %-12s %s\n", m->name, m->formats);
    }
}

/* The flags' names in --families, in the order of the enum. */
static const struct {
    const char *name;
    unsigned flag;
} flag_names[] = {
    {"fused_experts", QM_FAMILY_FUSED_EXPERTS},
    {"expert_biases", QM_FAMILY_EXPERT_BIASES},
    {"router_bias", QM_FAMILY_ROUTER_BIAS},
    {"correction_bias", QM_FAMILY_CORRECTION_BIAS},
    {"sparse_step", QM_FAMILY_SPARSE_STEP},
    {"dense_prefix", QM_FAMILY_DENSE_PREFIX},
    {"mxfp4", QM_FAMILY_MXFP4},
    {"fp8", QM_FAMILY_FP8},
    {"oai_swiglu", QM_FAMILY_OAI_SWIGLU},
};

static void json_flag(FILE *f, const char *name, unsigned on, int first)
{
    fprintf(f, "%s", first ? "" : ", ");
    qm__json_string(f, name);
    fprintf(f, ": %s", on ? "true" : "false");
}

static void json_str(FILE *f, const char *key, const char *v)
{
    fprintf(f, ", ");
    qm__json_string(f, key);
    fprintf(f, ": ");
    if (v)
        qm__json_string(f, v);
    else
        fprintf(f, "null");
}

void qm__families_json(FILE *f)
{
    static const char *const groups[] = {"none", "by_topk_method", "always"};
    fprintf(f, "[");
    for (size_t i = 0; i < qm_n_families; i++) {
        const qm_family *m = &qm_families[i];
        fprintf(f, "%s\n  {\"name\": ", i ? "," : "");
        qm__json_string(f, m->name);
        fprintf(f, ", \"hf\": {\"architecture\": ");
        qm__json_string(f, m->architecture);
        json_str(f, "moe", m->moe);
        json_str(f, "gate", m->gate);
        json_str(f, "up", m->up);
        json_str(f, "down", m->down);
        json_str(f, "router", m->router);
        json_str(f, "inter_key", m->inter_key);
        fprintf(f, ", \"flags\": {");
        for (size_t b = 0; b < sizeof flag_names / sizeof flag_names[0]; b++)
            json_flag(f, flag_names[b].name, m->flags & flag_names[b].flag, b == 0);
        fprintf(f, "}}, \"routing\": {\"score\": ");
        qm__json_string(f, m->score);
        json_str(f, "normalize_key", m->normalize_key);
        fprintf(f, ", \"normalize_default\": %d", m->normalize_default);
        json_str(f, "scale_key", m->scale_key);
        fprintf(f,
                ", \"scale_default\": %.9g, \"groups\": \"%s\", \"n_group_default\": %u, "
                "\"topk_group_default\": %u",
                m->scale_default, groups[m->groups], m->n_group_default, m->topk_group_default);
        json_str(f, "group_score", m->group_score);
        fprintf(f, "}, \"gguf\": ");
        if (m->gguf_arch) {
            fprintf(f, "{\"arch\": ");
            qm__json_string(f, m->gguf_arch);
            fprintf(f, ", \"sigmoid\": %s, \"norm_default\": %s}",
                    m->gguf_sigmoid ? "true" : "false", m->gguf_norm_default ? "true" : "false");
        } else {
            fprintf(f, "null");
        }
        json_str(f, "formats", m->formats);
        fprintf(f, "}");
    }
    fprintf(f, "\n]\n");
}
