/* test_npy.c - the .npy codec: round trips, and every header rule rejected
 * with a sentence (the reader faces files from anywhere). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qm_npy.h"

static size_t image(const char *dict, size_t data_bytes, uint8_t *buf)
{
    size_t hlen = strlen(dict);
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (uint8_t)(hlen & 0xff);
    buf[9] = (uint8_t)(hlen >> 8);
    memcpy(buf + 10, dict, hlen);
    memset(buf + 10 + hlen, 0x3c, data_bytes);
    return 10 + hlen + data_bytes;
}

static void expect_reject(const char *dict, size_t data_bytes, const char *needle)
{
    uint8_t buf[1024];
    size_t n = image(dict, data_bytes, buf);
    uint8_t *exact = malloc(n);
    memcpy(exact, buf, n);
    qm_npy npy;
    qm_status st;
    qm_status_clear(&st);
    int rc = qm_npy_parse(exact, n, &npy, &st);
    free(exact);
    ck_assert_msg(rc == QM_EINVAL, "%s: rc %d", dict, rc);
    ck_assert_msg(strstr(st.msg, needle), "%s: message \"%s\" lacks \"%s\"", dict, st.msg, needle);
    ck_assert_ptr_null(npy.data);
}

START_TEST(test_npy_round_trips_every_dtype_and_rank)
{
    char path[] = "/tmp/qm_npy_test_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    float f[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
    uint64_t shapes[3][3] = {{6, 0, 0}, {2, 3, 0}, {1, 2, 3}};
    for (uint32_t nd = 1; nd <= 3; nd++)
        for (int dt = QM_NPY_F32; dt <= QM_NPY_U16; dt++) {
            qm_status st;
            ck_assert_int_eq(qm_npy_write(path, (qm_npy_dtype)dt, shapes[nd - 1], nd, f, &st), 0);
            qm_npy npy;
            ck_assert_int_eq(qm_npy_read(path, 0, &npy, &st), 0);
            ck_assert_int_eq(npy.dtype, dt);
            ck_assert_uint_eq(npy.ndim, nd);
            ck_assert_uint_eq(npy.count, 6);
            ck_assert_uint_eq(npy.nbytes, 6 * qm_npy_dtype_size((qm_npy_dtype)dt));
            ck_assert_int_eq(memcmp(npy.data, f, npy.nbytes), 0);
            for (uint32_t d = 0; d < nd; d++)
                ck_assert_uint_eq(npy.shape[d], shapes[nd - 1][d]);
            qm_npy_free(&npy);
        }
    /* The header is padded so data starts on a 64-byte boundary, as NumPy does. */
    FILE *fp = fopen(path, "rb");
    uint8_t pre[10];
    ck_assert_uint_eq(fread(pre, 1, 10, fp), 10);
    fclose(fp);
    ck_assert_uint_eq((10u + (pre[8] | pre[9] << 8)) % 64, 0);
    unlink(path);
    qm_npy_free(NULL);
}
END_TEST

START_TEST(test_npy_accepts_numpy_spellings)
{
    uint8_t buf[512];
    qm_npy npy;
    qm_status st;
    size_t n = image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }       \n", 24,
                     buf);
    ck_assert_int_eq(qm_npy_parse(buf, n, &npy, &st), 0);
    ck_assert_uint_eq(npy.count, 6);
    qm_npy_free(&npy);
    n = image("{\"shape\": (), \"fortran_order\": False, \"descr\": \"<f2\"}\n", 2, buf);
    ck_assert_int_eq(qm_npy_parse(buf, n, &npy, &st), 0);
    ck_assert_uint_eq(npy.ndim, 0);
    ck_assert_uint_eq(npy.count, 1);
    qm_npy_free(&npy);
    n = image("{'descr': '<u2', 'fortran_order': False, 'shape': (0, 4), }\n", 0, buf);
    ck_assert_int_eq(qm_npy_parse(buf, n, &npy, &st), 0);
    ck_assert_uint_eq(npy.count, 0);
    qm_npy_free(&npy);
}
END_TEST

START_TEST(test_npy_rejects_bad_headers_with_reasons)
{
    expect_reject("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 16,
                  "dtype '<f8' unsupported");
    expect_reject("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8, "unsupported");
    expect_reject("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", 8, "Fortran");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 8,
                  "needs 12 data bytes but the file holds 8");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", 8, "shape must");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", 8, "shape must");
    expect_reject("{'descr': '<f4', 'fortran_order': False}", 8, "lacks shape");
    expect_reject("{'descr': '<f4', 'descr': '<f4', 'shape': (2,)}", 8, "repeated key");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8,
                  "unexpected or repeated key 'x'");
    expect_reject("['descr']", 0, "not a Python dict");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", 8,
                  "bytes after the dict");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': "
                  "(4294967296, 4294967296, 4294967296), }",
                  0, "overflows 64-bit");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 4,
                  "at most 8");
    expect_reject("{'descr': '<f4', 'fortran_order': False, 'shape': "
                  "(99999999999999999999999,), }",
                  0, "shape must");
}
END_TEST

START_TEST(test_npy_rejects_bad_magic_versions_and_lengths)
{
    qm_npy npy;
    qm_status st;
    ck_assert_int_eq(qm_npy_parse("\x93NUMPZ\x01\x00\x00\x00", 10, &npy, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "magic"));
    ck_assert_int_eq(qm_npy_parse("\x93NUMPY\x04\x00\x00\x00", 10, &npy, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "version 4.0"));
    ck_assert_int_eq(qm_npy_parse("\x93NUMPY\x01\x00\xff\x00{", 11, &npy, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "only 1 bytes follow"));
    ck_assert_int_eq(qm_npy_parse("\x93NUMPY\x02\x00\xff\xff\xff\x7f", 12, &npy, &st), QM_EINVAL);
    ck_assert_ptr_nonnull(strstr(st.msg, "limit"));
    ck_assert_int_eq(qm_npy_parse("\x93NUMPY\x02", 7, &npy, &st), QM_EINVAL);
    ck_assert_int_eq(qm_npy_read("/nonexistent.npy", 0, &npy, &st), QM_EIO);
    ck_assert_ptr_nonnull(strstr(st.msg, "/nonexistent.npy"));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("npy");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_npy_round_trips_every_dtype_and_rank);
    tcase_add_test(tc, test_npy_accepts_numpy_spellings);
    tcase_add_test(tc, test_npy_rejects_bad_headers_with_reasons);
    tcase_add_test(tc, test_npy_rejects_bad_magic_versions_and_lengths);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
