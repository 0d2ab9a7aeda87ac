/* qm_kernel_report.h - the CPU kernels' self-check, as the daemon reports
 * it: at start (log lines, and the refusal to start when QMOE_KERNEL
 * forces a refused kernel) and in daemon.status ("kernels",
 * docs/PROTOCOL.md). The check itself: engine/kernels/qm_kernel_check.h. */
#ifndef QM_KERNEL_REPORT_H
#define QM_KERNEL_REPORT_H

#include "qm_error.h"
#include "qm_protocol.h"

/* Runs the self-check (QMOED_FAULT_KERNEL=PRECISION:NAME[:LANE] first
 * breaks that kernel's lane: a test hook) and logs it: one INFO line with
 * the CPU, its flags, the kernels verified and refused and the cost, one
 * WARNING per refused kernel with its reason. 0, or QM_EINVAL with the
 * sentence when QMOE_KERNEL forces a refused kernel (the daemon does not
 * start) or the hook's spec is bad. Before any thread starts. */
int qm_kernel_report_start(qm_status *st);
/* daemon.status's "kernels" object: cpu, flags, check_ms, cached, and the
 * verified, refused and unavailable kernels ({precision, name[, reason]}). */
void qm_kernel_report_json(qm_jw *w);

#endif
