/* test_hotness.c - hotness profiles: counts, decay, hottest-first lists,
 * atomic save, validated load (corrupt, truncated, mismatched, missing). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_hotness.h"

static char g_dir[256];

static void make_dir(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/qm_hotness_test.XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
}

static void path_in_dir(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", g_dir, name);
}

static qm_hotness *sample(double decay)
{
    qm_hotness_key key = {.layers = 2, .experts = 6, .fingerprint = 42};
    qm_hotness *h = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_new(&key, decay, &h, &st), 0);
    /* Layer 0: expert 4 three times, 1 twice, 5 once. */
    const uint32_t a[] = {4, 1, 4}, b[] = {4, 1, 5}, c[] = {4, 4, 4, UINT32_MAX};
    qm_hotness_record(h, 0, a, 3);
    qm_hotness_record(h, 0, b, 3);
    qm_hotness_record(h, 0, c, 4);
    const uint32_t d[] = {2};
    qm_hotness_record(h, 1, d, 1);
    return h;
}

START_TEST(test_hottest_lists_order_by_count_then_index)
{
    qm_hotness *h = sample(1.0);
    ck_assert_double_eq(qm_hotness_count(h, 0, 4), 3.0); /* once per request */
    ck_assert_double_eq(qm_hotness_count(h, 0, 1), 2.0);
    uint32_t out[6];
    ck_assert_int_eq(qm_hotness_hottest(h, 0, out, 6), 3);
    ck_assert_uint_eq(out[0], 4);
    ck_assert_uint_eq(out[1], 1);
    ck_assert_uint_eq(out[2], 5);
    ck_assert_int_eq(qm_hotness_hottest(h, 1, out, 6), 1);
    ck_assert_uint_eq(out[0], 2);
    ck_assert_int_lt(qm_hotness_hottest(h, 2, out, 6), 0);
    qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION};
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_policy_params(h, &pp, &st), 0);
    ck_assert_uint_eq(pp.n_hot_banks, 2);
    ck_assert_uint_eq(pp.hot_len[0], 3);
    ck_assert_uint_eq(pp.hot[0][0], 4);
    ck_assert_uint_eq(pp.hot[1][0], 2);
    /* The lists drive a real static_hot policy. */
    qm_policy pol = {0};
    ck_assert_int_eq(qm_policy_new("static_hot", &pp, &pol, &st), 0);
    qm_policy_destroy(&pol);
    qm_hotness_free(h);
}
END_TEST

/* The prior next_use starts from: each expert's share of its layer's
 * records, exact without decay and weighted as the counts were with it. */
START_TEST(test_prior_is_each_experts_share_of_its_layers_records)
{
    const double decays[] = {1.0, 0.9};
    for (int i = 0; i < 2; i++) {
        qm_hotness_key key = {.layers = 2, .experts = 4, .fingerprint = 7};
        qm_hotness *h = NULL;
        qm_status st = {0};
        ck_assert_int_eq(qm_hotness_new(&key, decays[i], &h, &st), 0);
        const uint32_t r01[] = {0, 1}, r0[] = {0}, r02[] = {0, 2}, r3[] = {3};
        qm_hotness_record(h, 0, r01, 2);
        qm_hotness_record(h, 1, r3, 1);
        qm_hotness_record(h, 0, r0, 1);
        qm_hotness_record(h, 1, r3, 1);
        qm_hotness_record(h, 0, r02, 2);
        qm_hotness_record(h, 1, NULL, 0);
        qm_hotness_record(h, 0, r0, 1);
        qm_hotness_record(h, 1, NULL, 0);
        qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION};
        ck_assert_int_eq(qm_hotness_policy_prior(h, &pp, &st), 0);
        ck_assert_uint_eq(pp.n_prior_banks, 2);
        ck_assert_uint_eq(pp.prior_len[0], 4);
        double d = decays[i], w = d < 1.0 ? (1 - d * d * d * d) / (1 - d) : 4.0;
        ck_assert_double_eq_tol(pp.prior[0][0], 1.0, 1e-12); /* every record */
        ck_assert_double_eq_tol(pp.prior[0][1], d * d * d / w, 1e-12);   /* the first */
        ck_assert_double_eq_tol(pp.prior[0][2], d / w, 1e-12);           /* the third */
        ck_assert_double_eq_tol(pp.prior[0][3], 0.0, 1e-12);
        ck_assert_double_eq_tol(pp.prior[1][3], (d * d * d + d * d) / w, 1e-12);
        ck_assert_double_eq_tol(pp.prior_visits, w, 1e-12); /* 4 records a layer, decayed */
        /* It drives a real next_use; a policy without a prior refuses it. */
        qm_policy pol = {0};
        ck_assert_int_eq(qm_policy_new("next_use", &pp, &pol, &st), 0);
        qm_policy_destroy(&pol);
        ck_assert_int_eq(qm_policy_new("lfu", &pp, &pol, &st), QM_EINVAL);
        qm_hotness_free(h);
    }
    /* An empty profile: no layer has a prior. */
    qm_hotness_key key = {.layers = 2, .experts = 4, .fingerprint = 7};
    qm_hotness *h = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_new(&key, 1.0, &h, &st), 0);
    qm_policy_params pp = {.version = QM_POLICY_PARAMS_VERSION};
    ck_assert_int_eq(qm_hotness_policy_prior(h, &pp, &st), 0);
    ck_assert_ptr_null(pp.prior[0]);
    ck_assert_ptr_null(pp.prior[1]);
    qm_hotness_free(h);
}
END_TEST

/* Across layers (what warm_from_profile loads): by count, ties to the
 * lower layer, then the lower expert; a cap writes the hottest only and
 * the answer is how many there are. */
START_TEST(test_hottest_across_layers_order_by_count_then_layer_then_index)
{
    qm_hotness *h = sample(1.0);
    const uint32_t e[] = {3};
    qm_hotness_record(h, 1, e, 1); /* layer 1: experts 2 and 3 once each */
    uint32_t layers[8], experts[8];
    ck_assert_int_eq(qm_hotness_hottest_all(h, layers, experts, 8), 5);
    const uint32_t want_l[] = {0, 0, 0, 1, 1}, want_e[] = {4, 1, 5, 2, 3};
    for (int i = 0; i < 5; i++) {
        ck_assert_uint_eq(layers[i], want_l[i]);
        ck_assert_uint_eq(experts[i], want_e[i]);
    }
    memset(layers, 0xff, sizeof layers);
    ck_assert_int_eq(qm_hotness_hottest_all(h, layers, experts, 2), 5);
    ck_assert_uint_eq(experts[0], 4);
    ck_assert_uint_eq(experts[1], 1);
    ck_assert_uint_eq(layers[2], UINT32_MAX); /* past the cap: untouched */
    ck_assert_int_eq(qm_hotness_hottest_all(h, NULL, NULL, 0), 5);
    ck_assert_int_lt(qm_hotness_hottest_all(NULL, layers, experts, 8), 0);
    qm_hotness_free(h);
}
END_TEST

START_TEST(test_decay_lets_stale_popularity_fade)
{
    qm_hotness_key key = {.layers = 1, .experts = 4};
    qm_hotness *h = NULL;
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_new(&key, 0.5, &h, &st), 0);
    const uint32_t old[] = {0}, now[] = {3};
    for (int i = 0; i < 4; i++)
        qm_hotness_record(h, 0, old, 1);
    for (int i = 0; i < 3; i++)
        qm_hotness_record(h, 0, now, 1);
    /* 0: 1.875 * 0.125; 3: 1 + 0.5 + 0.25 */
    ck_assert_double_eq_tol(qm_hotness_count(h, 0, 0), 1.875 * 0.125, 1e-12);
    ck_assert_double_eq_tol(qm_hotness_count(h, 0, 3), 1.75, 1e-12);
    uint32_t out[4];
    ck_assert_int_eq(qm_hotness_hottest(h, 0, out, 4), 2);
    ck_assert_uint_eq(out[0], 3);
    qm_hotness *bad = h;
    ck_assert_int_eq(qm_hotness_new(&key, 0.0, &bad, &st), QM_EINVAL);
    ck_assert_ptr_null(bad);
    ck_assert_int_eq(qm_hotness_new(&key, 1.5, &bad, &st), QM_EINVAL);
    qm_hotness_free(h);
}
END_TEST

START_TEST(test_save_load_round_trip_keeps_counts)
{
    make_dir();
    char path[512];
    path_in_dir(path, sizeof path, "hot.bin");
    qm_hotness *h = sample(0.9);
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_save(h, path, &st), 0);
    qm_hotness_key key = {.layers = 2, .experts = 6, .fingerprint = 42};
    qm_hotness *g = NULL;
    char warn[256] = "x";
    ck_assert_int_eq(qm_hotness_load(path, &key, 0.9, &g, warn, sizeof warn, &st), 0);
    ck_assert_str_eq(warn, "");
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t e = 0; e < 6; e++)
            ck_assert_double_eq(qm_hotness_count(g, l, e), qm_hotness_count(h, l, e));
    ck_assert_uint_eq(qm_hotness_records(g), qm_hotness_records(h));
    /* No temp file left behind. */
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    ck_assert_int_ne(access(tmp, F_OK), 0);
    /* Saving again replaces atomically. */
    const uint32_t more[] = {0};
    qm_hotness_record(g, 1, more, 1);
    ck_assert_int_eq(qm_hotness_save(g, path, &st), 0);
    qm_hotness *k2 = NULL;
    ck_assert_int_eq(qm_hotness_load(path, &key, 0.9, &k2, warn, sizeof warn, &st), 0);
    ck_assert_double_eq(qm_hotness_count(k2, 1, 0), 1.0);
    qm_hotness_free(k2);
    qm_hotness_free(g);
    qm_hotness_free(h);
    unlink(path);
    rmdir(g_dir);
}
END_TEST

static void expect_ignored(const char *path, const qm_hotness_key *key, const char *needle)
{
    qm_hotness *g = NULL;
    char warn[256] = "";
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_load(path, key, 0.9, &g, warn, sizeof warn, &st), 0);
    ck_assert_ptr_nonnull(g);
    ck_assert_msg(strstr(warn, needle) != NULL, "warning '%s' lacks '%s'", warn, needle);
    ck_assert_msg(strstr(warn, "ignored") != NULL, "warning '%s'", warn);
    uint32_t out[8];
    for (uint32_t l = 0; l < key->layers; l++)
        ck_assert_int_eq(qm_hotness_hottest(g, l, out, 8), 0); /* empty profile */
    qm_hotness_free(g);
}

START_TEST(test_corrupt_truncated_or_mismatched_profile_is_ignored_with_a_warning)
{
    make_dir();
    char path[512];
    path_in_dir(path, sizeof path, "hot.bin");
    qm_hotness *h = sample(0.9);
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_save(h, path, &st), 0);
    qm_hotness_key key = {.layers = 2, .experts = 6, .fingerprint = 42};
    FILE *f = fopen(path, "rb");
    unsigned char buf[4096];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    ck_assert_uint_gt(n, 60);
    /* One flipped bit in a count: checksum. */
    buf[60] ^= 0x10;
    f = fopen(path, "wb");
    fwrite(buf, 1, n, f);
    fclose(f);
    expect_ignored(path, &key, "checksum");
    buf[60] ^= 0x10;
    /* Truncated. */
    f = fopen(path, "wb");
    fwrite(buf, 1, n - 9, f);
    fclose(f);
    expect_ignored(path, &key, "size");
    f = fopen(path, "wb");
    fwrite(buf, 1, 20, f);
    fclose(f);
    expect_ignored(path, &key, "truncated");
    /* Not ours. */
    f = fopen(path, "wb");
    fwrite("hello world, this is not a profile at all, not even close....", 1, 60, f);
    fclose(f);
    expect_ignored(path, &key, "magic");
    /* Another model: shape, then fingerprint. */
    f = fopen(path, "wb");
    fwrite(buf, 1, n, f);
    fclose(f);
    qm_hotness_key other = {.layers = 2, .experts = 8, .fingerprint = 42};
    expect_ignored(path, &other, "another model");
    other = (qm_hotness_key){.layers = 2, .experts = 6, .fingerprint = 43};
    expect_ignored(path, &other, "another model");
    /* Missing file: empty profile, no warning (first start). */
    unlink(path);
    qm_hotness *g = NULL;
    char warn[256] = "x";
    ck_assert_int_eq(qm_hotness_load(path, &key, 0.9, &g, warn, sizeof warn, &st), 0);
    ck_assert_str_eq(warn, "");
    qm_hotness_free(g);
    qm_hotness_free(h);
    rmdir(g_dir);
}
END_TEST

START_TEST(test_save_into_missing_directory_fails_cleanly)
{
    qm_hotness *h = sample(0.9);
    qm_status st = {0};
    ck_assert_int_eq(qm_hotness_save(h, "/nonexistent-dir-qm/x/hot.bin", &st), QM_EIO);
    ck_assert_ptr_nonnull(strstr(st.msg, "cannot create"));
    qm_hotness_free(h);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hotness");
    TCase *tc = tcase_create("profile");
    tcase_add_test(tc, test_hottest_lists_order_by_count_then_index);
    tcase_add_test(tc, test_hottest_across_layers_order_by_count_then_layer_then_index);
    tcase_add_test(tc, test_prior_is_each_experts_share_of_its_layers_records);
    tcase_add_test(tc, test_decay_lets_stale_popularity_fade);
    tcase_add_test(tc, test_save_load_round_trip_keeps_counts);
    tcase_add_test(tc, test_corrupt_truncated_or_mismatched_profile_is_ignored_with_a_warning);
    tcase_add_test(tc, test_save_into_missing_directory_fails_cleanly);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
