/* qm_layer_clock.c - the layer phase the layer-aware policies share (see
 * qm_residency_impl.h): when each bank is next visited, learnt from its own
 * visit history. */
#include "qm_residency_impl.h"

uint64_t qm__layer_clock_access(qm__layer_clock *lc, qm__ref_map *map, uint32_t bank,
                                uint64_t tick)
{
    lc->now = tick;
    if (lc->has_cur && lc->cur_bank == bank) {
        const qm__ref_entry *b = qm__ref_map_find(map, qm__bank_key(bank));
        return b ? b->clock : 0;
    }
    lc->has_cur = 1;
    lc->cur_bank = bank;
    qm__ref_entry *b = qm__ref_map_upsert(map, qm__bank_key(bank));
    if (!b) return 0; /* no memory: this bank's phase is unknown, nothing worse */
    if (b->clock > 0 && tick > b->last_tick) {
        double gap = (double)(tick - b->last_tick);
        b->count = b->count > 0 ? 0.5 * b->count + 0.5 * gap : gap;
        lc->period_all = lc->period_all > 0 ? 0.9 * lc->period_all + 0.1 * gap : gap;
    }
    b->clock++;
    b->last_tick = tick;
    return b->clock;
}

void qm__layer_clock_phase(const qm__layer_clock *lc, const qm__ref_map *map, uint32_t bank,
                           qm__bank_phase *out)
{
    const qm__ref_entry *b = qm__ref_map_find(map, qm__bank_key(bank));
    double per = b && b->count > 0 ? b->count : lc->period_all;
    out->period = per > 0 ? per : 1.0;
    out->visits = b ? b->clock : 0;
    out->current = lc->has_cur && lc->cur_bank == bank;
    if (!b || !b->clock) {
        out->until = 0.0;
        return;
    }
    if (out->current) { /* the next visit is a period away */
        out->until = out->period;
        return;
    }
    double since = lc->now >= b->last_tick ? (double)(lc->now - b->last_tick) : 0.0;
    out->until = out->period > since ? out->period - since : 0.0;
}

uint64_t qm__visits_since(const qm__bank_phase *ph, uint64_t visit)
{
    uint64_t since = ph->visits > visit ? ph->visits - visit : 0;
    if (since && ph->current) since--;
    return since;
}

double qm__layered_next_use(const qm__bank_phase *ph, uint64_t visit)
{
    return ph->until + ph->period * (double)qm__visits_since(ph, visit);
}
