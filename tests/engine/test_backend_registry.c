/* test_backend_registry.c - the backend registry (backends/qm_backend_registry.c)
 * and what a backend declares: every row is usable, names are found
 * exactly, the host kind opens, numbered kinds open by index or say why
 * they cannot here, and a backend's routing is asked only for the calls its
 * `routes` name. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_backend_impl.h"

static const unsigned known_caps =
    QM_BACKEND_CAP_HOST | QM_BACKEND_CAP_NUMBERED | QM_BACKEND_CAP_AUTO | QM_BACKEND_CAP_SHARED_POOL |
    QM_BACKEND_CAP_CODEBOOK;

START_TEST(test_every_row_has_a_distinct_name_a_summary_and_known_caps)
{
    size_t n = qm_backend_kind_count(), hosts = 0;
    ck_assert_uint_gt(n, 0);
    for (size_t i = 0; i < n; i++) {
        const char *name = qm_backend_kind_name(i);
        ck_assert_msg(name && name[0], "row %zu has no name", i);
        ck_assert_msg(strlen(name) < 16, "%s: longer than qm_device_info.kind", name);
        const char *summary = qm_backend_kind_summary(i);
        ck_assert_msg(summary && summary[0], "%s has no summary", name);
        unsigned caps = qm_backend_kind_caps(i);
        ck_assert_msg((caps & ~known_caps) == 0, "%s: unknown caps %#x", name, caps);
        ck_assert_msg(!((caps & QM_BACKEND_CAP_HOST) && (caps & QM_BACKEND_CAP_NUMBERED)),
                      "%s: the host is one device, not numbered ones", name);
        hosts += (caps & QM_BACKEND_CAP_HOST) != 0;
        ck_assert_int_eq(qm_backend_kind_find(name, strlen(name)), (int)i);
        for (size_t j = 0; j < i; j++)
            ck_assert_msg(strcmp(name, qm_backend_kind_name(j)) != 0, "%s listed twice", name);
    }
    /* --backend auto needs one kind to fall back to. */
    ck_assert_uint_eq(hosts, 1);
    ck_assert_ptr_null(qm_backend_kind_name(n));
    ck_assert_ptr_null(qm_backend_kind_summary(n));
    ck_assert_uint_eq(qm_backend_kind_caps(n), 0);
}
END_TEST

START_TEST(test_find_matches_whole_names_only)
{
    const char *name = qm_backend_kind_name(0);
    size_t len = strlen(name);
    char longer[32];
    snprintf(longer, sizeof longer, "%sx", name);
    ck_assert_int_eq(qm_backend_kind_find(name, len), 0);
    ck_assert_int_eq(qm_backend_kind_find(name, len - 1), -1);
    ck_assert_int_eq(qm_backend_kind_find(longer, len + 1), -1);
    /* A prefix of a longer text is found by its length (config's KIND:N). */
    ck_assert_int_eq(qm_backend_kind_find(longer, len), 0);
    ck_assert_int_eq(qm_backend_kind_find("tpu", 3), -1);
    ck_assert_int_eq(qm_backend_kind_find(NULL, 0), -1);
}
END_TEST

START_TEST(test_names_are_joined_in_registry_order)
{
    char want[256] = "", got[256];
    size_t n = qm_backend_kind_count();
    for (size_t i = 0; i < n; i++) {
        const char *sep = i == 0 ? "" : i + 1 == n ? " or " : ", ";
        strcat(want, sep);
        strcat(want, qm_backend_kind_name(i));
    }
    size_t len = qm_backend_kind_names(0, ", ", " or ", got, sizeof got);
    ck_assert_str_eq(got, want);
    ck_assert_uint_eq(len, strlen(want));
    /* Too small: what fits, NUL-terminated, and the length it needed. */
    char small[4];
    ck_assert_uint_eq(qm_backend_kind_names(0, ", ", " or ", small, sizeof small), strlen(want));
    ck_assert_uint_eq(strlen(small), sizeof small - 1);
    ck_assert(strncmp(small, want, sizeof small - 1) == 0);
    ck_assert_uint_eq(qm_backend_kind_names(0, ", ", " or ", NULL, 0), strlen(want));
    /* A filter no kind passes gives nothing. */
    ck_assert_uint_eq(qm_backend_kind_names(1u << 30, ", ", " or ", got, sizeof got), 0);
    ck_assert_str_eq(got, "");
    /* The host kind alone. */
    for (size_t i = 0; i < n; i++)
        if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_HOST) {
            qm_backend_kind_names(QM_BACKEND_CAP_HOST, ", ", " or ", got, sizeof got);
            ck_assert_str_eq(got, qm_backend_kind_name(i));
        }
}
END_TEST

/* Every kind either opens its device 0 (then its name and info say its
 * kind) or says in a sentence why it has none here. */
START_TEST(test_each_kind_opens_device_0_or_says_why_not)
{
    for (size_t i = 0; i < qm_backend_kind_count(); i++) {
        const char *name = qm_backend_kind_name(i);
        uint32_t n = 7;
        qm_status st = {0};
        int rc = qm_backend_kind_probe(i, &n, &st);
        if (rc < 0) {
            ck_assert_msg(rc == QM_EUNSUPPORTED || rc == QM_EDEVICE, "%s: probe %d", name, rc);
            ck_assert_msg(st.msg[0], "%s: a failed probe without a reason", name);
            ck_assert_uint_eq(n, 0);
            qm_backend *be = (qm_backend *)1;
            qm_status_clear(&st);
            ck_assert_int_lt(qm_backend_kind_open(i, NULL, &be, &st), 0);
            ck_assert_ptr_null(be);
            ck_assert_msg(st.msg[0], "%s: a failed open without a reason", name);
            printf("%s: no device here (%s)\n", name, st.msg);
            continue;
        }
        ck_assert_uint_ge(n, 1);
        if (qm_backend_kind_caps(i) & QM_BACKEND_CAP_HOST)
            ck_assert_uint_eq(n, 1);
        qm_backend_open_options o = {.index = 0, .threads = 1};
        qm_backend *be = NULL;
        ck_assert_msg(qm_backend_kind_open(i, &o, &be, &st) == 0, "%s: %s", name, st.msg);
        ck_assert_str_eq(qm_backend_name(be), name);
        qm_device_info info;
        ck_assert_int_eq(qm_backend_info(be, &info), 0);
        ck_assert_str_eq(info.kind, name);
        printf("%s: %u devices; device 0 is %s\n", name, n, info.name);
        qm_backend_free(be);
    }
}
END_TEST

/* A numbered kind's open takes the index: the emulated device names it. */
START_TEST(test_numbered_kind_opens_the_index_asked_for)
{
    int k = qm_backend_kind_find("emu", 3);
    ck_assert_int_ge(k, 0);
    ck_assert(qm_backend_kind_caps((size_t)k) & QM_BACKEND_CAP_NUMBERED);
    qm_backend_open_options o = {.index = 5, .threads = 1, .copy_gbps = 2.5};
    qm_backend *be = NULL;
    qm_status st = {0};
    ck_assert_msg(qm_backend_kind_open((size_t)k, &o, &be, &st) == 0, "%s", st.msg);
    qm_device_info info;
    qm_backend_info(be, &info);
    ck_assert_msg(strncmp(info.name, "emu:5 ", 6) == 0, "%s", info.name);
    ck_assert_msg(strstr(info.name, "2.5 GB/s") != NULL, "the bandwidth got lost: %s", info.name);
    qm_backend_free(be);
}
END_TEST

START_TEST(test_out_of_range_kind_is_refused)
{
    size_t n = qm_backend_kind_count();
    qm_backend *be = (qm_backend *)1;
    qm_status st = {0};
    ck_assert_int_eq(qm_backend_kind_open(n, NULL, &be, &st), QM_EINVAL);
    ck_assert_ptr_null(be);
    uint32_t devices = 9;
    ck_assert_int_eq(qm_backend_kind_probe(n, &devices, &st), QM_EINVAL);
    ck_assert_uint_eq(devices, 0);
}
END_TEST

static int fake_open(const qm_backend_open_options *o, qm_backend **out, qm_status *st)
{
    (void)o;
    *out = NULL;
    return qm_status_set(st, QM_EUNSUPPORTED, "fake");
}

START_TEST(test_a_row_of_another_version_or_without_open_is_refused)
{
    qm__backend_kind k = {.version = QM_BACKEND_KIND_VERSION, .name = "fake", .open = fake_open};
    qm_status st = {0};
    ck_assert_int_eq(qm__backend_kind_check(&k, &st), 0);
    k.version = QM_BACKEND_KIND_VERSION + 1;
    ck_assert_int_eq(qm__backend_kind_check(&k, &st), QM_EUNSUPPORTED);
    ck_assert_msg(strstr(st.msg, "fake") && strstr(st.msg, "version"), "%s", st.msg);
    k.version = QM_BACKEND_KIND_VERSION;
    k.open = NULL;
    ck_assert_int_eq(qm__backend_kind_check(&k, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "open method"), "%s", st.msg);
    k.open = fake_open;
    k.name = "";
    ck_assert_int_eq(qm__backend_kind_check(&k, &st), QM_EINVAL);
    ck_assert_int_eq(qm__backend_kind_check(NULL, &st), QM_EINVAL);
}
END_TEST

/* ---- `routes`: what a backend routes, and only that ---- */

static int routed;
static int fake_info(void *ctx, qm_device_info *out)
{
    (void)ctx;
    memset(out, 0, sizeof *out);
    return 0;
}
static int fake_arena_alloc(void *ctx, qm_arena *a, uint64_t n, qm_status *st)
{
    (void)ctx, (void)a, (void)n;
    return qm_status_set(st, QM_EUNSUPPORTED, "no arenas");
}
static void fake_arena_release(void *ctx, qm_arena *a) { (void)ctx, (void)a; }
static int fake_copy(void *ctx, void *d, const void *s, uint64_t n, qm_fence *f, qm_status *st)
{
    (void)ctx, (void)d, (void)s, (void)n, (void)f;
    return qm_status_set(st, QM_EUNSUPPORTED, "no copies");
}
static int fake_run(void *ctx, const qm_expert_batch *b, qm_status *st)
{
    (void)ctx, (void)b;
    return qm_status_set(st, QM_EUNSUPPORTED, "no kernels");
}
static void fake_destroy(void *ctx) { (void)ctx; }
static int pass_token;
static int fake_route(void *ctx, const qm_routing_request *rq, void **pass, qm_status *st)
{
    (void)ctx, (void)rq, (void)st;
    routed++;
    *pass = &pass_token;
    return 0;
}
static int fake_run_routed(void *ctx, void *pass, const qm_expert_batch *b, qm_status *st)
{
    (void)ctx, (void)pass, (void)b, (void)st;
    return 0;
}
static int fake_combine(void *ctx, void *pass, float *out, qm_status *st)
{
    (void)ctx, (void)pass, (void)out, (void)st;
    return 0;
}
static void fake_pass_release(void *ctx, void *pass) { (void)ctx, (void)pass; }

static qm_backend_iface routing_iface(unsigned routes)
{
    return (qm_backend_iface){.version = QM_BACKEND_IFACE_VERSION, .name = "routing",
                              .routes = routes, .info = fake_info,
                              .arena_alloc = fake_arena_alloc,
                              .arena_release = fake_arena_release, .copy_h2d = fake_copy,
                              .run_experts = fake_run, .destroy = fake_destroy,
                              .route = fake_route, .run_routed = fake_run_routed,
                              .combine = fake_combine, .pass_release = fake_pass_release};
}

/* Routes one call of each rule: 1 when the backend routed it, 0 when it
 * went to the host (which, given no host state, declines). */
static void route_each_rule(qm_backend *be, int want[3])
{
    static const int32_t ids[2] = {0, 1};
    static const float w[2] = {0.5f, 0.5f};
    qm_bank_config legacy = {0}, keyed = {0};
    keyed.routing.score = QM_ROUTE_SCORE_SIGMOID;
    qm_routing_request rq[3] = {{.config = &legacy, .n_tokens = 1},
                              {.config = &keyed, .n_tokens = 1},
                              {.config = &legacy, .n_tokens = 1, .topk_ids = ids,
                               .topk_weights = w, .k = 2}};
    for (int i = 0; i < 3; i++) {
        qm_routed_pass pass = {0};
        qm_status st = {0};
        routed = 0;
        int rc = qm__backend_route(be, &rq[i], &pass, &st);
        ck_assert_msg(routed == want[i], "rule %d: routed %d times, want %d", i, routed, want[i]);
        if (want[i]) {
            ck_assert_int_eq(rc, 0);
            ck_assert_ptr_eq(pass.backend_pass, &pass_token);
        } else {
            ck_assert_int_eq(rc, QM_EUNSUPPORTED); /* the host's, without its state */
            ck_assert_ptr_null(pass.backend_pass);
        }
        qm__backend_pass_release(be, &pass);
    }
}

START_TEST(test_backend_routes_only_the_rules_it_declares)
{
    struct {
        unsigned routes;
        int want[3]; /* legacy, keyed, supplied */
    } cases[] = {
        {QM_BACKEND_ROUTES_LEGACY, {1, 0, 0}},
        {QM_BACKEND_ROUTES_KEYED, {0, 1, 0}},
        {QM_BACKEND_ROUTES_LEGACY | QM_BACKEND_ROUTES_SUPPLIED, {1, 0, 1}},
        {QM_BACKEND_ROUTES_LEGACY | QM_BACKEND_ROUTES_KEYED | QM_BACKEND_ROUTES_SUPPLIED,
         {1, 1, 1}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        qm_backend_iface iface = routing_iface(cases[c].routes);
        qm_backend *be = NULL;
        qm_status st = {0};
        ck_assert_msg(qm__backend_wrap(&iface, NULL, &be, &st) == 0, "%s", st.msg);
        route_each_rule(be, cases[c].want);
        qm_backend_free(be);
    }
}
END_TEST

START_TEST(test_routes_and_the_routing_group_go_together)
{
    qm_backend_iface iface = routing_iface(0);
    qm_backend *be = (qm_backend *)1;
    qm_status st = {0};
    ck_assert_int_eq(qm__backend_wrap(&iface, NULL, &be, &st), QM_EINVAL);
    ck_assert_ptr_null(be);
    ck_assert_msg(strstr(st.msg, "routes no rule"), "%s", st.msg);
    iface = routing_iface(QM_BACKEND_ROUTES_LEGACY);
    iface.route = NULL;
    iface.run_routed = NULL;
    iface.combine = NULL;
    iface.pass_release = NULL;
    ck_assert_int_eq(qm__backend_wrap(&iface, NULL, &be, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "without a routing group"), "%s", st.msg);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("backend_registry");
    TCase *tc = tcase_create("registry");
    tcase_add_test(tc, test_every_row_has_a_distinct_name_a_summary_and_known_caps);
    tcase_add_test(tc, test_find_matches_whole_names_only);
    tcase_add_test(tc, test_names_are_joined_in_registry_order);
    tcase_add_test(tc, test_each_kind_opens_device_0_or_says_why_not);
    tcase_add_test(tc, test_numbered_kind_opens_the_index_asked_for);
    tcase_add_test(tc, test_out_of_range_kind_is_refused);
    tcase_add_test(tc, test_a_row_of_another_version_or_without_open_is_refused);
    suite_add_tcase(s, tc);
    tc = tcase_create("routes");
    tcase_add_test(tc, test_backend_routes_only_the_rules_it_declares);
    tcase_add_test(tc, test_routes_and_the_routing_group_go_together);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
