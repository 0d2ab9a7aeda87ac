/* qm_catalog.c - region catalogs: per bank, each expert's regions, or why the
 * bank cannot be split per expert. */
#include "qm_residency.h"
#include "qm_residency_impl.h"

#include <stdio.h>
#include <string.h>

#include "qm_alloc.h"

typedef struct qm__expert_unit {
    qm_region *regions;
    size_t n_regions;
    size_t cap_regions;
    uint64_t bytes; /* saturating sum of the regions' lengths */
} qm__expert_unit;

struct qm_region_catalog {
    uint32_t bank_id;
    uint32_t n_experts;
    qm__expert_unit *units;
    qm_nonpageable_reason reason; /* as set; computed reasons are not stored */
    char detail[QM_DECISION_DETAIL_MAX];
};

const char *qm_nonpageable_reason_name(qm_nonpageable_reason reason)
{
    switch (reason) {
#define QM__NP_NAME(name, text)                                                                    \
    case QM_NONPAGEABLE_##name:                                                                    \
        return text;
        QM_NONPAGEABLE_MAP(QM__NP_NAME)
#undef QM__NP_NAME
    case QM_NONPAGEABLE_COUNT:
        break;
    }
    return "unknown_reason";
}

int qm_catalog_new(uint32_t bank_id, uint32_t n_experts, qm_region_catalog **out)
{
    if (!out) return QM_EINVAL;
    *out = NULL;
    qm_region_catalog *cat = qm_calloc(1, sizeof *cat);
    if (!cat) goto fail_catalog;
    cat->units = qm_calloc(n_experts ? n_experts : 1, sizeof *cat->units);
    if (!cat->units) goto fail_units;
    cat->bank_id = bank_id;
    cat->n_experts = n_experts;
    *out = cat;
    return 0;

fail_units:
    qm_free(cat);
fail_catalog:
    return QM_ENOMEM;
}

void qm_catalog_free(qm_region_catalog *cat)
{
    if (!cat) return;
    for (uint32_t e = 0; e < cat->n_experts; e++)
        qm_free(cat->units[e].regions);
    qm_free(cat->units);
    qm_free(cat);
}

int qm_catalog_add_region(qm_region_catalog *cat, uint32_t expert, qm_region region)
{
    if (!cat || expert >= cat->n_experts) return QM_EINVAL;
    qm__expert_unit *u = &cat->units[expert];
    if (u->n_regions == u->cap_regions) {
        size_t cap = u->cap_regions ? u->cap_regions * 2 : 4;
        size_t bytes;
        if (__builtin_mul_overflow(cap, sizeof *u->regions, &bytes)) return QM_ENOMEM;
        qm_region *grown = qm_realloc(u->regions, bytes);
        if (!grown) return QM_ENOMEM; /* u->regions is still valid and still owned */
        u->regions = grown;
        u->cap_regions = cap;
    }
    u->regions[u->n_regions++] = region;
    unsigned long long sum;
    u->bytes = qm_add_u64(u->bytes, region.length, &sum) ? UINT64_MAX : sum;
    return 0;
}

void qm_catalog_set_nonpageable(qm_region_catalog *cat, qm_nonpageable_reason reason,
                                const char *detail)
{
    if (!cat) return;
    if ((unsigned)reason >= QM_NONPAGEABLE_COUNT)
        reason = QM_NONPAGEABLE_NOT_EXPERT_MAJOR; /* fail closed on a garbage reason */
    cat->reason = reason;
    if (reason == QM_NONPAGEABLE_NONE || !detail)
        cat->detail[0] = '\0';
    else
        snprintf(cat->detail, sizeof cat->detail, "%s", detail);
}

uint32_t qm_catalog_bank_id(const qm_region_catalog *cat)
{
    return cat ? cat->bank_id : 0;
}

uint32_t qm_catalog_expert_count(const qm_region_catalog *cat)
{
    return cat ? cat->n_experts : 0;
}

qm_nonpageable_reason qm__catalog_reason_ex(const qm_region_catalog *cat, char *detail,
                                            size_t detail_cap)
{
    if (detail && detail_cap) detail[0] = '\0';
    if (!cat) return QM_NONPAGEABLE_MISSING_REGION;
    if (cat->reason != QM_NONPAGEABLE_NONE) {
        if (detail && detail_cap) snprintf(detail, detail_cap, "%s", cat->detail);
        return cat->reason;
    }
    if (cat->n_experts < 2) {
        if (detail && detail_cap)
            snprintf(detail, detail_cap, "bank %u has %u expert(s)", cat->bank_id, cat->n_experts);
        return QM_NONPAGEABLE_SINGLE_EXPERT;
    }
    for (uint32_t e = 0; e < cat->n_experts; e++) {
        if (cat->units[e].n_regions == 0) {
            if (detail && detail_cap) snprintf(detail, detail_cap, "expert %u has no region", e);
            return QM_NONPAGEABLE_MISSING_REGION;
        }
    }
    for (uint32_t e = 0; e < cat->n_experts; e++) {
        if (cat->units[e].bytes == 0) {
            if (detail && detail_cap) snprintf(detail, detail_cap, "expert %u has zero bytes", e);
            return QM_NONPAGEABLE_EMPTY_UNIT;
        }
    }
    return QM_NONPAGEABLE_NONE;
}

qm_nonpageable_reason qm_catalog_reason(const qm_region_catalog *cat)
{
    return qm__catalog_reason_ex(cat, NULL, 0);
}

const char *qm_catalog_reason_detail(const qm_region_catalog *cat)
{
    return cat ? cat->detail : "";
}

const qm_region *qm_catalog_regions(const qm_region_catalog *cat, uint32_t expert, size_t *count)
{
    if (!cat || expert >= cat->n_experts) {
        if (count) *count = 0;
        return NULL;
    }
    if (count) *count = cat->units[expert].n_regions;
    return cat->units[expert].regions;
}

uint64_t qm_catalog_expert_bytes(const qm_region_catalog *cat, uint32_t expert)
{
    if (!cat || expert >= cat->n_experts) return 0;
    return cat->units[expert].bytes;
}

uint64_t qm_catalog_bytes_per_expert(const qm_region_catalog *cat)
{
    uint64_t most = 0;
    for (uint32_t e = 0; cat && e < cat->n_experts; e++)
        if (cat->units[e].bytes > most) most = cat->units[e].bytes;
    return most;
}

uint64_t qm_catalog_total_bytes(const qm_region_catalog *cat)
{
    unsigned long long total = 0;
    for (uint32_t e = 0; cat && e < cat->n_experts; e++)
        if (qm_add_u64(total, cat->units[e].bytes, &total)) return UINT64_MAX;
    return total;
}
