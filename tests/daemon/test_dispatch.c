/* test_dispatch.c - the method table and the routing decision of
 * daemon/qm_dispatch.c, without a loop or a socket: who may call what,
 * whose sessions a peer may use, and which requests wait in a session's
 * queue and as which job. The same rules over the wire: test_qmoed_*.py. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "qm_dispatch.h"

static const qm_peer user = {.uid = 1000, .gid = 1000, .pid = 1, .is_admin = 0};
static const qm_peer other_user = {.uid = 1001, .gid = 1001, .pid = 2, .is_admin = 0};
static const qm_peer admin = {.uid = 0, .gid = 0, .pid = 3, .is_admin = 1};

/* A session as routing reads it. */
static qm_route_session *session_of(uid_t owner, size_t queued)
{
    qm_route_session *s = calloc(1, sizeof *s);
    ck_assert_ptr_nonnull(s);
    s->owner = owner;
    s->queued = queued;
    return s;
}

static qm_route route(qm_method m, const qm_peer *peer, int draining, const qm_route_session *s)
{
    const qm_method_entry *e = qm_method_entry_get(m);
    ck_assert_ptr_nonnull(e);
    return qm_dispatch_route(e, peer, draining, s != NULL, s);
}

START_TEST(test_table_has_one_row_per_method_in_order)
{
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        const qm_method_entry *e = qm_method_entry_get((qm_method)m);
        ck_assert_ptr_nonnull(e);
        ck_assert_msg(e->method == (qm_method)m, "row %d says method %d (%s)", m, (int)e->method,
                      qm_method_name((qm_method)m));
    }
    ck_assert_ptr_null(qm_method_entry_get(QM_METHOD_COUNT));
    ck_assert_ptr_null(qm_method_entry_get((qm_method)-1));
}
END_TEST

/* A method answered on the loop thread, now or behind its session's work,
 * needs a handler and no job; one a worker answers has no handler and job
 * operations that at least finish (answer) it. */
START_TEST(test_every_loop_answered_method_has_a_handler)
{
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        const qm_method_entry *e = qm_method_entry_get((qm_method)m);
        const char *name = qm_method_name((qm_method)m);
        if (e->queued == QM_QUEUE_ALWAYS) {
            ck_assert_msg(e->handler == NULL, "%s: a worker answers it, yet it has a handler",
                          name);
            ck_assert_msg(e->job && e->job->finish, "%s: queued without operations", name);
            for (int o = 0; o < m; o++) {
                const qm_method_entry *other = qm_method_entry_get((qm_method)o);
                ck_assert_msg(!other->job || other->job != e->job, "%s and %s share a job", name,
                              qm_method_name((qm_method)o));
            }
        } else {
            ck_assert_msg(e->handler != NULL, "%s: answered on the loop without a handler", name);
            ck_assert_msg(e->job == NULL, "%s: a loop method with job operations", name);
        }
        if (e->queued == QM_QUEUE_BEHIND)
            ck_assert_msg(e->session != QM_SESSION_UNUSED, "%s: behind which session?", name);
    }
}
END_TEST

/* queue_depth bounds the inferences (the compute) alone, and only
 * session.map and session.ring take the descriptors that come with a
 * request. */
START_TEST(test_only_inference_is_bounded_and_only_map_takes_descriptors)
{
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        const qm_method_entry *e = qm_method_entry_get((qm_method)m);
        const char *name = qm_method_name((qm_method)m);
        int bounded = e->job && e->job->bounded;
        ck_assert_msg(bounded == (m == QM_METHOD_SESSION_INFER), "%s: bounded %d", name,
                      bounded);
        int fds = m == QM_METHOD_SESSION_MAP || m == QM_METHOD_SESSION_RING;
        ck_assert_msg(e->takes_fds == fds, "%s: takes_fds %d", name, e->takes_fds);
    }
}
END_TEST

/* PROTOCOL.md: model.load, model.unload, telemetry.trace and
 * daemon.shutdown are admin-only; everything else is open to any peer. */
START_TEST(test_admin_methods_refuse_a_plain_user_and_only_them)
{
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        int admin_only = m == QM_METHOD_MODEL_LOAD || m == QM_METHOD_MODEL_UNLOAD ||
                         m == QM_METHOD_TELEMETRY_TRACE || m == QM_METHOD_DAEMON_SHUTDOWN;
        const char *name = qm_method_name((qm_method)m);
        qm_route_session *mine = session_of(user.uid, 0);
        qm_route r = route((qm_method)m, &user, 0, mine);
        if (admin_only) {
            ck_assert_msg(r.kind == QM_ROUTE_REFUSE && r.refusal == QM_REFUSE_NOT_ADMIN,
                          "%s: user got kind %d refusal %d", name, (int)r.kind, (int)r.refusal);
        } else {
            ck_assert_msg(r.kind != QM_ROUTE_REFUSE, "%s: user refused (%d)", name,
                          (int)r.refusal);
        }
        r = route((qm_method)m, &admin, 0, mine);
        ck_assert_msg(r.kind != QM_ROUTE_REFUSE, "%s: admin refused (%d)", name, (int)r.refusal);
        free(mine);
    }
}
END_TEST

START_TEST(test_draining_refuses_every_method_even_an_admins)
{
    qm_route_session *mine = session_of(admin.uid, 0);
    for (int m = 0; m < QM_METHOD_COUNT; m++) {
        qm_route r = route((qm_method)m, &admin, 1, mine);
        ck_assert_msg(r.kind == QM_ROUTE_REFUSE && r.refusal == QM_REFUSE_DRAINING,
                      "%s while draining: kind %d refusal %d", qm_method_name((qm_method)m),
                      (int)r.kind, (int)r.refusal);
    }
    free(mine);
}
END_TEST

/* The draining answer comes before the admin check: a user learns the
 * daemon is going away, not that it lacks rights. */
START_TEST(test_draining_is_checked_before_the_role)
{
    qm_route r = route(QM_METHOD_MODEL_LOAD, &user, 1, NULL);
    ck_assert_int_eq(r.refusal, QM_REFUSE_DRAINING);
}
END_TEST

START_TEST(test_session_methods_need_an_existing_session)
{
    static const qm_method scoped[] = {QM_METHOD_SESSION_CLOSE, QM_METHOD_SESSION_PLAN,
                                       QM_METHOD_SESSION_INFER, QM_METHOD_SESSION_RESIZE};
    for (size_t i = 0; i < sizeof scoped / sizeof *scoped; i++) {
        const qm_method_entry *e = qm_method_entry_get(scoped[i]);
        ck_assert_int_eq(e->session, QM_SESSION_REQUIRED);
        /* Named but not found, and (defensively) not named at all. */
        qm_route r = qm_dispatch_route(e, &user, 0, 1, NULL);
        ck_assert_msg(r.kind == QM_ROUTE_REFUSE && r.refusal == QM_REFUSE_NO_SESSION,
                      "%s: refusal %d", qm_method_name(scoped[i]), (int)r.refusal);
        r = qm_dispatch_route(e, &admin, 0, 0, NULL);
        ck_assert_int_eq(r.refusal, QM_REFUSE_NO_SESSION);
    }
}
END_TEST

START_TEST(test_only_the_owner_or_an_admin_may_use_a_session)
{
    static const qm_method scoped[] = {QM_METHOD_SESSION_CLOSE, QM_METHOD_SESSION_PLAN,
                                       QM_METHOD_SESSION_INFER, QM_METHOD_TELEMETRY_GET,
                                       QM_METHOD_SESSION_RESIZE};
    qm_route_session *theirs = session_of(other_user.uid, 0);
    for (size_t i = 0; i < sizeof scoped / sizeof *scoped; i++) {
        const char *name = qm_method_name(scoped[i]);
        qm_route r = route(scoped[i], &user, 0, theirs);
        ck_assert_msg(r.kind == QM_ROUTE_REFUSE && r.refusal == QM_REFUSE_NOT_OWNER,
                      "%s on another uid's session: kind %d refusal %d", name, (int)r.kind,
                      (int)r.refusal);
        r = route(scoped[i], &other_user, 0, theirs);
        ck_assert_msg(r.kind != QM_ROUTE_REFUSE, "%s: owner refused (%d)", name,
                      (int)r.refusal);
        r = route(scoped[i], &admin, 0, theirs);
        ck_assert_msg(r.kind != QM_ROUTE_REFUSE, "%s: admin refused (%d)", name,
                      (int)r.refusal);
    }
    free(theirs);
}
END_TEST

/* telemetry.get names a session only optionally: without one it is the
 * daemon-wide view, answered at once, whatever sessions exist. */
START_TEST(test_telemetry_get_without_a_session_is_answered_at_once)
{
    const qm_method_entry *e = qm_method_entry_get(QM_METHOD_TELEMETRY_GET);
    ck_assert_int_eq(e->session, QM_SESSION_OPTIONAL);
    qm_route r = qm_dispatch_route(e, &user, 0, 0, NULL);
    ck_assert_int_eq(r.kind, QM_ROUTE_ANSWER);
    r = qm_dispatch_route(e, &user, 0, 1, NULL);
    ck_assert_int_eq(r.refusal, QM_REFUSE_NO_SESSION);
}
END_TEST

/* Inference and session.plan always go through the session's queue (the
 * pagers belong to its worker); session.create always becomes a job;
 * session.resize is ordered with the session's inferences. Each is its
 * row's job: admitted where it checks or reserves, undone where a
 * reservation must be given back. */
START_TEST(test_infer_plan_and_create_are_always_queued_as_their_job)
{
    qm_route_session *idle = session_of(user.uid, 0), *busy = session_of(user.uid, 3);
    static const qm_method always[] = {QM_METHOD_SESSION_INFER, QM_METHOD_SESSION_PLAN,
                                       QM_METHOD_SESSION_CREATE, QM_METHOD_SESSION_RESIZE};
    for (size_t i = 0; i < sizeof always / sizeof *always; i++) {
        const qm_method m = always[i];
        const qm_route_session *s = m == QM_METHOD_SESSION_CREATE ? NULL : idle;
        ck_assert_int_eq(route(m, &user, 0, s).kind, QM_ROUTE_QUEUE);
        if (s)
            ck_assert_int_eq(route(m, &user, 0, busy).kind, QM_ROUTE_QUEUE);
        const qm_job_ops *job = qm_method_entry_get(m)->job;
        ck_assert_msg(job && job->run, "%s: no work for a worker", qm_method_name(m));
    }
    const qm_job_ops *create = qm_method_entry_get(QM_METHOD_SESSION_CREATE)->job,
                     *resize = qm_method_entry_get(QM_METHOD_SESSION_RESIZE)->job,
                     *infer = qm_method_entry_get(QM_METHOD_SESSION_INFER)->job;
    ck_assert(create->admit && create->undo);  /* the session and its budget */
    ck_assert(resize->admit && resize->undo);  /* the growth */
    ck_assert(infer->admit && !infer->undo);   /* checks and map references only */
    free(idle);
    free(busy);
}
END_TEST

/* A request about a session with queued work waits behind it (a barrier
 * job), so its answer leaves in request order; about an idle session, or
 * about no session, it is answered at once. */
START_TEST(test_session_requests_wait_behind_queued_work_only)
{
    qm_route_session *idle = session_of(user.uid, 0), *busy = session_of(user.uid, 1);
    static const qm_method behind[] = {QM_METHOD_SESSION_CLOSE, QM_METHOD_TELEMETRY_GET};
    for (size_t i = 0; i < sizeof behind / sizeof *behind; i++) {
        const char *name = qm_method_name(behind[i]);
        qm_route r = route(behind[i], &user, 0, idle);
        ck_assert_msg(r.kind == QM_ROUTE_ANSWER, "%s on an idle session: kind %d", name,
                      (int)r.kind);
        r = route(behind[i], &user, 0, busy);
        ck_assert_msg(r.kind == QM_ROUTE_QUEUE && qm_method_entry_get(behind[i])->job == NULL,
                      "%s behind queued work: kind %d", name, (int)r.kind);
    }
    static const qm_method never[] = {QM_METHOD_DAEMON_STATUS, QM_METHOD_MODEL_LIST,
                                      QM_METHOD_SESSION_LIST, QM_METHOD_TELEMETRY_METRICS};
    for (size_t i = 0; i < sizeof never / sizeof *never; i++) {
        qm_route r = route(never[i], &user, 0, busy);
        ck_assert_msg(r.kind == QM_ROUTE_ANSWER, "%s: kind %d", qm_method_name(never[i]),
                      (int)r.kind);
    }
    free(idle);
    free(busy);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dispatch");
    TCase *tc = tcase_create("table");
    tcase_add_test(tc, test_table_has_one_row_per_method_in_order);
    tcase_add_test(tc, test_every_loop_answered_method_has_a_handler);
    tcase_add_test(tc, test_only_inference_is_bounded_and_only_map_takes_descriptors);
    suite_add_tcase(s, tc);
    tc = tcase_create("roles");
    tcase_add_test(tc, test_admin_methods_refuse_a_plain_user_and_only_them);
    tcase_add_test(tc, test_draining_refuses_every_method_even_an_admins);
    tcase_add_test(tc, test_draining_is_checked_before_the_role);
    suite_add_tcase(s, tc);
    tc = tcase_create("ownership");
    tcase_add_test(tc, test_session_methods_need_an_existing_session);
    tcase_add_test(tc, test_only_the_owner_or_an_admin_may_use_a_session);
    tcase_add_test(tc, test_telemetry_get_without_a_session_is_answered_at_once);
    suite_add_tcase(s, tc);
    tc = tcase_create("queuing");
    tcase_add_test(tc, test_infer_plan_and_create_are_always_queued_as_their_job);
    tcase_add_test(tc, test_session_requests_wait_behind_queued_work_only);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
