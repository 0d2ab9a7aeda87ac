/* qm_kernel_report.c - the CPU kernels' self-check at start, as the daemon
 * reports it (qm_kernel_report.h; the check: engine/kernels/qm_kernel_check.h). */
#include "qm_kernel_report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_kernel_check.h"
#include "qm_log.h"
#include "qm_name_groups.h"

/* "exact avx512, avx2; fast avx512vnni, avx2" of the verdicts of one kind. */
static void names_of(const qm_kernel_check *kc, qm_kernel_verdict_kind kind, char *out,
                     size_t cap)
{
    qm_name_groups g;
    qm_name_groups_init(&g, out, cap);
    for (unsigned i = 0; i < kc->n; i++)
        if (kc->v[i].kind == kind) qm_name_groups_add(&g, kc->v[i].precision, kc->v[i].name);
    if (!out[0])
        snprintf(out, cap, "none");
}

int qm_kernel_report_start(qm_status *st)
{
    const char *brk = getenv("QMOED_FAULT_KERNEL");
    if (brk && *brk) {
        qm_status why = {0};
        if (qm_kernel_check_break(brk, &why) < 0)
            return qm_status_set(st, QM_EINVAL, "QMOED_FAULT_KERNEL=%s: %s", brk, why.msg);
        qm_log(QM_LOG_WARNING, "QMOED_FAULT_KERNEL=%s: that kernel gives a wrong lane (a test "
               "hook); the self-check must refuse it", brk);
    }
    const qm_kernel_check *kc = qm_kernel_check_run();
    char verified[512], refused[512];
    names_of(kc, QM_KERNEL_VERIFIED, verified, sizeof verified);
    names_of(kc, QM_KERNEL_REFUSED, refused, sizeof refused);
    qm_log(QM_LOG_INFO, "kernel self-check on %s (%s): verified %s; refused %s; %.1f ms%s",
           kc->cpu, kc->flags[0] ? kc->flags : "no SIMD features the kernels use", verified,
           refused, kc->ms, kc->cached ? " (read from the kernel cache)" : "");
    for (unsigned i = 0; i < kc->n; i++) {
        const qm_kernel_verdict *v = &kc->v[i];
        if (v->kind == QM_KERNEL_REFUSED)
            qm_log(QM_LOG_WARNING, "kernel self-check: %s kernel %s refused, never used, on %s "
                   "(%s): %s", v->precision, v->name, kc->cpu, kc->flags, v->reason);
        else if (v->kind == QM_KERNEL_UNAVAILABLE)
            qm_log(QM_LOG_DEBUG, "kernel self-check: %s kernel %s not checked: %s", v->precision,
                   v->name, v->reason);
    }
    return qm_kernel_check_forced(st);
}

void qm_kernel_report_json(qm_jw *w)
{
    const qm_kernel_check *kc = qm_kernel_check_run();
    static const struct {
        const char *key;
        qm_kernel_verdict_kind kind;
    } lists[] = {{"verified", QM_KERNEL_VERIFIED},
                 {"refused", QM_KERNEL_REFUSED},
                 {"unavailable", QM_KERNEL_UNAVAILABLE}};
    qm_jw_obj_begin(w);
    qm_jw_member_str(w, "cpu", kc->cpu);
    qm_jw_member_str(w, "flags", kc->flags);
    qm_jw_key(w, "check_ms");
    qm_jw_f64(w, kc->ms);
    qm_jw_key(w, "cached");
    qm_jw_bool(w, kc->cached);
    for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++) {
        qm_jw_key(w, lists[l].key);
        qm_jw_arr_begin(w);
        for (unsigned i = 0; i < kc->n; i++) {
            const qm_kernel_verdict *v = &kc->v[i];
            if (v->kind != lists[l].kind)
                continue;
            qm_jw_obj_begin(w);
            qm_jw_member_str(w, "precision", v->precision);
            qm_jw_member_str(w, "name", v->name);
            if (v->kind != QM_KERNEL_VERIFIED)
                qm_jw_member_str(w, "reason", v->reason);
            qm_jw_obj_end(w);
        }
        qm_jw_arr_end(w);
    }
    qm_jw_obj_end(w);
}
