/* test_bank_writer.c - the one bank writer (model/qm_bank_writer.h): the
 * plan and the header the loader accepts, the partial file (exclusive,
 * locked, never a bank until finished, never through a symbolic link),
 * resume, and what it removes. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qm_alloc.h"
#include "qm_bank.h"
#include "qm_bank_writer.h"

typedef struct fixture {
    char dir[64], out[96], partial[112];
    qm_bank_config cfg;
    qm_bank_plan_tensor plan[2 * QM_T_COUNT];
    char values[12][32];
    qm_st_meta meta[QM_BANK_STD_META + 3];
    qm_bank_writer_spec spec;
} fixture;

static void setup(fixture *f, const char *source)
{
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/qm_writer_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    snprintf(f->out, sizeof f->out, "%s/b.bank", f->dir);
    snprintf(f->partial, sizeof f->partial, "%s.partial", f->out);
    f->cfg = (qm_bank_config){.layers = 2,
                              .experts = 3,
                              .hidden = 32,
                              .inter = 16,
                              .k = 2,
                              .bits = 4,
                              .block_size = 16,
                              .activation = QM_ACT_SWIGLU,
                              .swiglu_fusion = 1,
                              .normalize_routing = 1,
                              .alpha = 1.0f,
                              .limit = 1e30f};
    const qm_bank_layer_opts lo = {.scale_dtype = QM_DTYPE_F16,
                                   .bias_dtype = QM_DTYPE_F32,
                                   .router_dtype = QM_DTYPE_F32,
                                   .fc1_bias = 1,
                                   .router_weight = 1};
    for (uint32_t l = 0; l < 2; l++)
        qm_bank_plan_layer(&f->cfg, &lo, &f->plan[l * QM_T_COUNT]);
    qm_bank_std_meta(&f->cfg, f->values, f->meta);
    size_t n = QM_BANK_STD_META;
    if (source) f->meta[n++] = (qm_st_meta){"qmoe.source", (char *)source};
    f->spec = (qm_bank_writer_spec){.layers = 2,
                                    .experts = 3,
                                    .tensors = f->plan,
                                    .meta = f->meta,
                                    .n_meta = n,
                                    .deferred_key = source ? "qmoe.source" : NULL,
                                    .tool = "test"};
}

static void teardown(fixture *f)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    ck_assert_int_eq(system(cmd), 0);
}

static int exists(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0;
}

/* Writes every tensor of layer l as bytes of value `fill`. */
static void put_layer(qm_bank_writer *w, uint32_t l, uint8_t fill)
{
    qm_status st;
    for (int t = 0; t < QM_T_COUNT; t++) {
        uint64_t n = qm_bank_writer_tensor_bytes(w, l, t);
        if (!n) continue;
        uint8_t *buf = malloc(n);
        /* f16 scales of 0x3c3c (~1.06) and f32 biases / routers of 0x3c3c3c3c: finite */
        memset(buf, t == QM_T_FC1_WEIGHT || t == QM_T_FC2_WEIGHT ? fill : 0x3c, n);
        ck_assert_int_eq(qm_bank_writer_put(w, l, t, 0, buf, n, &st), 0);
        free(buf);
    }
}

START_TEST(test_writer_plans_the_loaders_layout_and_finishes_a_bank)
{
    fixture f;
    setup(&f, "{\"format\":\"hf\",\"exact\":false,\"max_rel_err\":0.000000e+00}");
    qm_bank_writer *w = NULL;
    uint32_t first = 9;
    double value = 9;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), 0);
    ck_assert_uint_eq(first, 0);
    ck_assert(value == 0);
    ck_assert_uint_eq(qm_bank_writer_slice_bytes(w, 0, QM_T_FC1_WEIGHT), 32 * 32 / 2);
    ck_assert_uint_eq(qm_bank_writer_slice_bytes(w, 0, QM_T_FC1_SCALES), 32 * 2 * 2);
    ck_assert_uint_eq(qm_bank_writer_tensor_bytes(w, 1, QM_T_ROUTER_WEIGHT), 3 * 32 * 4);
    ck_assert_uint_eq(qm_bank_writer_tensor_bytes(w, 0, QM_T_FC3_WEIGHT), 0);
    /* writing past a tensor is refused */
    uint8_t b = 0;
    ck_assert_int_eq(qm_bank_writer_put(w, 0, QM_T_FC1_BIAS, 3 * 32 * 4, &b, 1, &st), QM_EINTERNAL);
    ck_assert(!exists(f.out) && exists(f.partial));
    for (uint32_t l = 0; l < 2; l++) {
        put_layer(w, l, (uint8_t)(0x11 * (l + 1)));
        ck_assert_int_eq(qm_bank_writer_layer_done(w, l, 0.25, l + 1, 2, &st), 0);
    }
    ck_assert_uint_eq(qm_bank_writer_layers_done(w), 2);
    uint64_t bytes = 0;
    /* the deferred value must keep its length */
    ck_assert_int_eq(qm_bank_writer_finish(w, "{\"format\":\"hf\"}", &bytes, &st), QM_EINTERNAL);
    ck_assert_int_eq(
        qm_bank_writer_finish(w, "{\"format\":\"hf\",\"exact\":false,\"max_rel_err\":2.500000e-01}",
                              &bytes, &st),
        0);
    qm_bank_writer_free(w, 0);
    ck_assert(exists(f.out) && !exists(f.partial));
    qm_bank *bank = NULL;
    ck_assert_msg(qm_bank_open(f.out, &bank, &st) == 0, "%s", st.msg);
    ck_assert_uint_eq(qm_bank_file_bytes(bank), bytes);
    /* The source as the daemon answers it: the same object, compact. */
    ck_assert_str_eq(qm_bank_source_json(bank),
                     "{\"format\":\"hf\",\"exact\":false,\"max_rel_err\":0.25}");
    const qm_layer_view *lv = qm_bank_layer(bank, 1);
    ck_assert_uint_eq(((const uint8_t *)lv->t[QM_T_FC1_WEIGHT].data)[0], 0x22);
    /* wider elements first: every f32 tensor lies before every f16 and u8 one */
    ck_assert(lv->t[QM_T_ROUTER_WEIGHT].offset < qm_bank_layer(bank, 0)->t[QM_T_FC1_SCALES].offset);
    ck_assert(lv->t[QM_T_FC1_SCALES].offset < qm_bank_layer(bank, 0)->t[QM_T_FC1_WEIGHT].offset);
    qm_bank_close(bank);
    teardown(&f);
}
END_TEST

START_TEST(test_writer_refuses_a_header_the_loader_would_refuse_before_creating_a_file)
{
    fixture f;
    setup(&f, NULL);
    f.meta[QM_BANK_STD_META] = (qm_st_meta){"qmoe.routing.score", "softmax"};
    f.meta[QM_BANK_STD_META + 1] = (qm_st_meta){"qmoe.routing.scale", "1e308"};
    f.spec.n_meta = QM_BANK_STD_META + 2;
    qm_bank_writer *w = NULL;
    uint32_t first;
    double value;
    qm_status st;
    qm_status_clear(&st);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st),
                     QM_EINVALID_MODEL);
    ck_assert_msg(strstr(st.msg, "qmoe.routing.scale = \"1e308\""), "%s", st.msg);
    ck_assert_ptr_null(w);
    ck_assert(!exists(f.partial) && !exists(f.out));
    teardown(&f);
}
END_TEST

START_TEST(test_an_unfinished_bank_never_loads)
{
    fixture f;
    setup(&f, NULL);
    qm_bank_writer *w = NULL;
    uint32_t first;
    double value;
    qm_status st;
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), 0);
    put_layer(w, 0, 0x11);
    ck_assert_int_eq(qm_bank_writer_layer_done(w, 0, 0, 1, 2, &st), 0);
    put_layer(w, 1, 0x22); /* every byte written, not finished */
    qm_bank *bank = NULL;
    ck_assert_int_eq(qm_bank_open(f.partial, &bank, &st), QM_EINVALID_MODEL);
    ck_assert_ptr_null(bank);
    qm_bank_writer_free(w, 1);
    ck_assert(exists(f.partial) && !exists(f.out));
    ck_assert_int_eq(qm_bank_open(f.partial, &bank, &st), QM_EINVALID_MODEL);
    teardown(&f);
}
END_TEST

START_TEST(test_a_second_writer_of_the_same_out_is_refused)
{
    fixture f;
    setup(&f, NULL);
    qm_bank_writer *a = NULL, *b = NULL;
    uint32_t first;
    double value;
    qm_status st;
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &a, &first, &value, &st), 0);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &b, &first, &value, &st), QM_EIN_USE);
    ck_assert_msg(strstr(st.msg, "another process"), "%s", st.msg);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 1, &b, &first, &value, &st), QM_EIN_USE);
    ck_assert_ptr_null(b);
    ck_assert(exists(f.partial)); /* the refused writer removed nothing */
    for (uint32_t l = 0; l < 2; l++) {
        put_layer(a, l, 0x33);
        ck_assert_int_eq(qm_bank_writer_layer_done(a, l, 0, l + 1, 2, &st), 0);
    }
    ck_assert_int_eq(qm_bank_writer_finish(a, NULL, NULL, &st), 0);
    qm_bank_writer_free(a, 0);
    qm_bank *bank = NULL;
    ck_assert_int_eq(qm_bank_open(f.out, &bank, &st), 0);
    qm_bank_close(bank);
    teardown(&f);
}
END_TEST

START_TEST(test_the_partial_file_is_never_followed_through_a_link)
{
    fixture f;
    setup(&f, NULL);
    char victim[128];
    snprintf(victim, sizeof victim, "%s/victim", f.dir);
    FILE *v = fopen(victim, "w");
    fputs("keep me", v);
    fclose(v);
    ck_assert_int_eq(symlink(victim, f.partial), 0);
    qm_bank_writer *w = NULL;
    uint32_t first;
    double value;
    qm_status st;
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "symbolic link"), "%s", st.msg);
    char buf[16] = {0};
    v = fopen(victim, "r");
    ck_assert_ptr_nonnull(fgets(buf, sizeof buf, v));
    fclose(v);
    ck_assert_str_eq(buf, "keep me");
    /* a hard link to another file is not ours to take either */
    unlink(f.partial);
    ck_assert_int_eq(link(victim, f.partial), 0);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), QM_EINVAL);
    unlink(f.partial);
    /* OUT a directory: refused before anything is written */
    ck_assert_int_eq(mkdir(f.out, 0755), 0);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), QM_EINVAL);
    ck_assert_msg(strstr(st.msg, "is a directory"), "%s", st.msg);
    ck_assert(!exists(f.partial));
    teardown(&f);
}
END_TEST

START_TEST(test_resume_continues_only_the_same_header)
{
    fixture f;
    setup(&f, NULL);
    qm_bank_writer *w = NULL;
    uint32_t first;
    double value;
    qm_status st;
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), 0);
    put_layer(w, 0, 0x44);
    ck_assert_int_eq(qm_bank_writer_layer_done(w, 0, 0.125, 1, 2, &st), 0);
    qm_bank_writer_free(w, 1); /* as if the process died */
    /* another header: refused, the file left alone */
    f.values[4][0] = '1'; /* qmoe.k "2" -> "1" */
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 1, &w, &first, &value, &st), QM_ECONFLICT);
    ck_assert(exists(f.partial));
    f.values[4][0] = '2';
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 1, &w, &first, &value, &st), 0);
    ck_assert_uint_eq(first, 1);
    ck_assert(value == 0.125);
    put_layer(w, 1, 0x55);
    ck_assert_int_eq(qm_bank_writer_layer_done(w, 1, 0.125, 2, 2, &st), 0);
    ck_assert_int_eq(qm_bank_writer_finish(w, NULL, NULL, &st), 0);
    qm_bank_writer_free(w, 0);
    qm_bank *bank = NULL;
    ck_assert_int_eq(qm_bank_open(f.out, &bank, &st), 0);
    ck_assert_uint_eq(((const uint8_t *)qm_bank_layer(bank, 0)->t[QM_T_FC1_WEIGHT].data)[0], 0x44);
    qm_bank_close(bank);
    /* without resume, a stale partial file is replaced from layer 0 */
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), 0);
    put_layer(w, 0, 0x66);
    ck_assert_int_eq(qm_bank_writer_layer_done(w, 0, 0, 1, 2, &st), 0);
    qm_bank_writer_free(w, 1);
    ck_assert_int_eq(qm_bank_writer_open(&f.spec, f.out, 0, &w, &first, &value, &st), 0);
    ck_assert_uint_eq(first, 0);
    qm_bank_writer_free(w, 0);
    ck_assert(!exists(f.partial));
    teardown(&f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model_bank_writer");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_writer_plans_the_loaders_layout_and_finishes_a_bank);
    tcase_add_test(tc, test_writer_refuses_a_header_the_loader_would_refuse_before_creating_a_file);
    tcase_add_test(tc, test_an_unfinished_bank_never_loads);
    tcase_add_test(tc, test_a_second_writer_of_the_same_out_is_refused);
    tcase_add_test(tc, test_the_partial_file_is_never_followed_through_a_link);
    tcase_add_test(tc, test_resume_continues_only_the_same_header);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
