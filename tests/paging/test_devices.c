/* test_devices.c - a session over several devices (engine/pager/qm_placement.c)
 * on two emulated non-host-visible devices (the fake device of
 * paging_fixture.c, one arena each): the placement rule and its budget
 * split, each device's budget held on every allocation, outputs bitwise
 * equal to the CPU backend's whole-bank reference with on_miss page, host
 * and auto, a layer served only by its own device; the bank mapping
 * registered with each emulated device (register_host); one routing trace
 * over both devices, byte for byte the one-device session's. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "paging_helpers.h"
#include "qm_placement.h"

/* Per-device budget hook: resident bytes of one pager against its share. */
static void device_hook(void *ud, uint64_t resident, uint64_t budget)
{
    uint64_t share = *(const uint64_t *)ud;
    ck_assert_uint_le(resident, budget);
    ck_assert_uint_eq(budget, share);
}

START_TEST(test_placement_cuts_contiguous_runs_by_weight_and_splits_the_budget)
{
    pf_spec sp = pf_default_spec();
    sp.layers = 4;
    pg_fixture_reopen(&sp);
    const qm_bank *bank = fixture.bank.bank;
    uint64_t layer_bytes = unit_bytes(&fixture.bank) * sp.experts;
    qm_placement pl;
    ck_assert_int_eq(qm_placement_make(bank, 2, NULL, 1001, &pl, &fixture.st), 0);
    const uint32_t equal[] = {0, 0, 1, 1};
    ck_assert_mem_eq(pl.device_of, equal, sizeof equal);
    ck_assert_uint_eq(pl.bytes[0], 2 * layer_bytes);
    ck_assert_uint_eq(pl.budget[0], 500);
    ck_assert_uint_eq(pl.budget[0] + pl.budget[1], 1001); /* the remainder to the last */
    qm_placement_free(&pl);

    const uint64_t w[] = {3, 1};
    ck_assert_int_eq(qm_placement_make(bank, 2, w, 0, &pl, &fixture.st), 0);
    const uint32_t skewed[] = {0, 0, 0, 1};
    ck_assert_mem_eq(pl.device_of, skewed, sizeof skewed);
    ck_assert_uint_eq(pl.budget[1], layer_bytes); /* no budget: its bytes */
    qm_placement_free(&pl);

    const uint64_t none_on_1[] = {1, 0};
    ck_assert_int_eq(qm_placement_make(bank, 2, none_on_1, 0, &pl, &fixture.st), 0);
    ck_assert_uint_eq(pl.bytes[1], 0);
    ck_assert_uint_eq(pl.budget[1], 0);
    qm_placement_free(&pl);

    ck_assert_int_eq(qm_placement_make(bank, 0, NULL, 0, &pl, &fixture.st), QM_EINVAL);
    ck_assert_str_eq(fixture.st.field, "device");
}
END_TEST

static void run_two_devices(int on_miss, int prefetch, uint64_t budget, const char *policy)
{
    const pf_spec *sp = &fixture.spec;
    const pf_bank *b = &fixture.bank;
    qm_backend *dev[2] = {NULL, NULL};
    ck_assert_int_eq(pf_fake_device_new(&dev[0]), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev[1]), 0);
    pg_set set;
    make_calls(b, fixture.cpu, 18, 31, &set);
    qm_policy pol = {0};
    new_policy(policy, b, &set, &pol);
    qm_residency_plan *plan = make_plan(b, &pol, 1, budget);
    qm_placement pl;
    ck_assert_int_eq(qm_placement_make(b->bank, 2, NULL, budget, &pl, &fixture.st), 0);
    qm_pager_options o = {.prefetch = prefetch, .on_miss = on_miss, .host_threads = 1,
                          .no_preload = 1};
    qm_multipager *mp = NULL;
    int rc = qm_multipager_new(dev, b->bank, plan, &pol, &o, &pl, &mp, &fixture.st);
    ck_assert_msg(rc == 0, "multipager: %s", fixture.st.msg);
    for (uint32_t d = 0; d < 2; d++)
        qm_pager_set_alloc_hook(qm_multipager_pager(mp, d), device_hook, &pl.budget[d]);
    /* Host experts of both devices run on one CPU backend of the session
     * (not one pool of workers per device), which is neither device. */
    const qm_backend *h0 = qm_pager_host_backend(qm_multipager_pager(mp, 0)),
                     *h1 = qm_pager_host_backend(qm_multipager_pager(mp, 1));
    ck_assert_ptr_eq(h0, h1);
    if (on_miss == QM_ON_MISS_PAGE)
        ck_assert_ptr_null(h0);
    else
        ck_assert(h0 && h0 != dev[0] && h0 != dev[1]);
    const qm_bank_config *cfg = qm_bank_get_config(b->bank);
    float out[8 * 64];
    uint64_t accesses = 0;
    for (size_t i = 0; i < set.n; i++) {
        const pg_call *c = &set.calls[i];
        qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                          .n_tokens = c->T, .logits = c->logits, .output = out};
        qm_pager_stats other0, other1;
        uint32_t here = pl.device_of[c->layer];
        qm_pager_stats_get(qm_multipager_pager(mp, 1 - here), &other0);
        rc = qm_multipager_forward(mp, &mc, NULL, &fixture.st);
        ck_assert_msg(rc == 0, "call %zu: %s", i, fixture.st.msg);
        ck_assert_msg(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0,
                      "%s on_miss %d budget %llu: call %zu (layer %u) differs", policy, on_miss,
                      (unsigned long long)budget, i, c->layer);
        /* The other device saw nothing of this call. */
        qm_pager_stats_get(qm_multipager_pager(mp, 1 - here), &other1);
        ck_assert_uint_eq(other0.hits + other0.misses + other0.host_runs +
                              other0.whole_bank_accesses,
                          other1.hits + other1.misses + other1.host_runs +
                              other1.whole_bank_accesses);
        accesses += c->n_uniq;
    }
    qm_pager_stats s;
    qm_multipager_stats(mp, &s);
    ck_assert_uint_eq(s.hits + s.misses + s.host_runs + s.whole_bank_accesses, accesses);
    ck_assert_uint_le(s.resident_bytes, budget);
    ck_assert_uint_eq(s.budget_bytes, budget);
    for (uint32_t d = 0; d < 2; d++) {
        qm_pager_stats sd;
        qm_pager_stats_get(qm_multipager_pager(mp, d), &sd);
        ck_assert_uint_le(sd.resident_bytes, pl.budget[d]);
    }
    /* A layer asked of the wrong device's pager is refused. */
    uint32_t wrong = 1 - pl.device_of[0];
    qm_moe_call mc = {.layer = 0, .dtype = QM_DTYPE_F32, .hidden = set.calls[0].x,
                      .n_tokens = 1, .output = out};
    ck_assert_int_eq(qm_pager_forward(qm_multipager_pager(mp, wrong), &mc, NULL, &fixture.st),
                     QM_EINVAL);
    ck_assert_int_eq(qm_pager_resident_experts(qm_multipager_pager(mp, wrong), 0, NULL, 0), 0);
    (void)sp;
    free_calls(&set);
    free_two_devices(mp, &pl, plan, &pol, dev);
}

START_TEST(test_two_devices_bitwise_with_budgets_per_device_for_every_on_miss)
{
    const pf_spec *sp = &fixture.spec;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    const char *policies[] = {"lru", "lfu", "belady"};
    for (int om = QM_ON_MISS_PAGE; om <= QM_ON_MISS_AUTO; om++)
        for (size_t p = 0; p < 3; p++)
            for (int pf = 0; pf < 2; pf++) {
                run_two_devices(om, pf, total / 2, policies[p]);
                run_two_devices(om, pf, total, policies[p]);
            }
}
END_TEST


START_TEST(test_the_mapping_registers_with_each_emulated_device)
{
    qm_backend *dev[2] = {NULL, NULL};
    ck_assert_int_eq(pf_fake_device_new(&dev[0]), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev[1]), 0);
    uint64_t bytes, held;
    const uint8_t *base = qm_bank_mapping(fixture.bank.bank, &bytes);
    for (uint32_t d = 0; d < 2; d++) {
        ck_assert_uint_eq(qm_backend_emu_registered(dev[d], NULL), 0);
        ck_assert_int_eq(qm_backend_register_host(dev[d], base, bytes, &fixture.st), 1);
        ck_assert_uint_eq(qm_backend_emu_registered(dev[d], &held), 1);
        ck_assert_uint_eq(held, bytes);
    }
    /* A range held already is refused; outputs do not depend on it. */
    ck_assert_int_eq(qm_backend_register_host(dev[0], base + 1, 1, &fixture.st), QM_ECONFLICT);
    ck_assert_int_eq(qm_backend_unregister_host(dev[1], base, &fixture.st), 0);
    ck_assert_uint_eq(qm_backend_emu_registered(dev[1], NULL), 0);
    ck_assert_uint_eq(qm_backend_emu_registered(dev[0], NULL), 1);
    ck_assert_int_eq(qm_backend_unregister_host(dev[1], base, &fixture.st), QM_ENOT_FOUND);
    ck_assert_int_eq(qm_backend_unregister_host(dev[0], base, &fixture.st), 0);
    ck_assert_uint_eq(qm_backend_emu_registered(dev[0], NULL), 0);
    ck_assert_uint_eq(qm_backend_emu_registered(fixture.cpu, NULL), 0); /* not emu */
    qm_backend_free(dev[0]);
    qm_backend_free(dev[1]);
}
END_TEST


/* The whole file at `path` (malloc'd, *n its size). */
static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
    ck_assert_uint_eq(fread(buf, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return buf;
}

START_TEST(test_two_devices_record_the_trace_one_device_records)
{
    const pf_spec *sp = &fixture.spec;
    uint64_t U = unit_bytes(&fixture.bank), total = (uint64_t)sp->layers * sp->experts * U;
    qm_backend *dev[2] = {NULL, NULL};
    ck_assert_int_eq(pf_fake_device_new(&dev[0]), 0);
    ck_assert_int_eq(pf_fake_device_new(&dev[1]), 0);
    pg_set set;
    make_calls(&fixture.bank, fixture.cpu, 24, 41, &set);
    qm_policy pol = {0};
    new_policy("lru", &fixture.bank, &set, &pol);
    qm_residency_plan *plan = make_plan(&fixture.bank, &pol, 1, total / 2);
    qm_placement pl;
    ck_assert_int_eq(qm_placement_make(fixture.bank.bank, 2, NULL, total / 2, &pl, &fixture.st),
                     0);
    qm_pager_options o = {.prefetch = 1, .no_preload = 1};
    qm_multipager *mp = NULL;
    ck_assert_int_eq(
        qm_multipager_new(dev, fixture.bank.bank, plan, &pol, &o, &pl, &mp, &fixture.st), 0);
    qm_pager *one = NULL;
    ck_assert_int_eq(qm_pager_new(dev[0], fixture.bank.bank, plan, &pol, &o, &one, &fixture.st),
                     0);
    char p2[] = "/tmp/qm_trace_two.XXXXXX", p1[] = "/tmp/qm_trace_one.XXXXXX";
    for (char *p = p2; p; p = p == p2 ? p1 : NULL) {
        int fd = mkstemp(p);
        ck_assert_int_ge(fd, 0);
        close(fd);
    }
    ck_assert_int_eq(qm_multipager_record_trace(mp, p2, 0, 0, &fixture.st), 0);
    ck_assert_int_eq(qm_pager_record_trace(one, p1, 0, 0, &fixture.st), 0);
    const qm_bank_config *cfg = qm_bank_get_config(fixture.bank.bank);
    float out[8 * 64];
    for (size_t i = 0; i < set.n; i++) {
        const pg_call *c = &set.calls[i];
        qm_moe_call mc = {.layer = c->layer, .dtype = QM_DTYPE_F32, .hidden = c->x,
                          .n_tokens = c->T, .logits = c->logits, .output = out};
        ck_assert_int_eq(qm_multipager_forward(mp, &mc, NULL, &fixture.st), 0);
        ck_assert_int_eq(qm_pager_forward(one, &mc, NULL, &fixture.st), 0);
        ck_assert(memcmp(out, c->ref, sizeof(float) * c->T * cfg->hidden) == 0);
        /* Token rows land as every layer has routed them, on either device. */
        qm_pager_stats a, b;
        qm_multipager_stats(mp, &a);
        qm_pager_stats_get(one, &b);
        ck_assert_uint_eq(a.trace_tokens, b.trace_tokens);
    }
    size_t n2, n1;
    uint8_t *t2 = slurp(p2, &n2), *t1 = slurp(p1, &n1);
    ck_assert_uint_eq(n2, n1);
    ck_assert_uint_gt(n1, 40);
    ck_assert(memcmp(t2, t1, n1) == 0);
    qm_pager_stats a;
    qm_multipager_stats(mp, &a);
    ck_assert_uint_gt(a.trace_tokens, 0);
    ck_assert_uint_eq(a.trace_errors + a.trace_dropped, 0);
    free(t2);
    free(t1);
    unlink(p2);
    unlink(p1);
    qm_pager_free(one);
    free_calls(&set);
    free_two_devices(mp, &pl, plan, &pol, dev);
}
END_TEST

static Suite *devices_suite(void)
{
    Suite *s = suite_create("paging_devices");
    TCase *tc = tcase_create("devices");
    tcase_add_checked_fixture(tc, pg_fixture_setup, pg_fixture_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_placement_cuts_contiguous_runs_by_weight_and_splits_the_budget);
    tcase_add_test(tc, test_two_devices_bitwise_with_budgets_per_device_for_every_on_miss);
    tcase_add_test(tc, test_the_mapping_registers_with_each_emulated_device);
    tcase_add_test(tc, test_two_devices_record_the_trace_one_device_records);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(devices_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
