/* test_quant.c - the one quantiser (model/qm_quant.h): symmetric and
 * asymmetric round to nearest, exact at ties and near them, both scale
 * rules, the measured error, non-finite input refused. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qm_half.h"
#include "qm_quant.h"

static int code_at(const uint8_t *packed, unsigned bits, int c)
{
    return bits == 8 ? packed[c] : c % 2 ? packed[c / 2] >> 4 : packed[c / 2] & 15;
}

/* The specification: the round to nearest, ties to even, of the real
 * quotient; the f64 quotient of two f32 values is never on the wrong side
 * of a half-integer (its distance from one is 0 or above 2^-26). */
static int reference_code(float x, float s, unsigned bits)
{
    double q = rint((double)x / (double)s);
    double lo = -(double)(1 << (bits - 1)), hi = (double)((1 << (bits - 1)) - 1);
    q = q < lo ? lo : q > hi ? hi : q;
    return (int)q + (1 << (bits - 1));
}

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

START_TEST(test_quant_symmetric_rtn_against_the_stored_scale)
{
    float w[40];
    for (int c = 0; c < 40; c++)
        w[c] = (float)(c - 20) * 0.05f;
    uint8_t packed[20];
    float scales[2];
    qm_quant_error err = QM_QUANT_ERROR_INIT;
    const qm_quant_spec q = {.bits = 4, .block_size = 32, .scale_dtype = QM_DTYPE_F32};
    ck_assert_int_eq(qm_quant_row(&q, w, 40, packed, scales, 0, NULL, &err), 0);
    /* block 0: columns 0..31, absmax 1.0 -> scale 1/7; block 1: 32..39, absmax 0.95 */
    ck_assert_float_eq(scales[0], 1.0f / 7.0f);
    ck_assert_float_eq(scales[1], 0.95f / 7.0f);
    for (int c = 0; c < 40; c++)
        ck_assert_int_eq(code_at(packed, 4, c), reference_code(w[c], scales[c / 32], 4));
    ck_assert_int_eq(err.exact, 0);
    ck_assert(qm_quant_error_rel(&err) > 0 && qm_quant_error_rel(&err) < 0.1);
    /* values on the grid come back exactly: exact, error 0 */
    float g[32];
    for (int c = 0; c < 32; c++)
        g[c] = (float)((c % 15) - 7) * 0.25f;
    qm_quant_error e3 = QM_QUANT_ERROR_INIT;
    ck_assert_int_eq(qm_quant_row(&q, g, 32, packed, scales, 0, NULL, &e3), 0);
    ck_assert_int_eq(e3.exact, 1);
    ck_assert(qm_quant_error_rel(&e3) == 0.0);
}
END_TEST

/* Values on a grid (as FP8 sources and ggml K-quants are) put many
 * quotients on or within an f32 rounding of a half-integer: the codes must
 * still be the exact quotient's, where x * (1/s) or an f32 division would
 * round some of them the wrong way. */
START_TEST(test_quant_codes_are_the_exact_quotients_rounding_at_and_near_ties)
{
    uint64_t seed = 7;
    unsigned checked = 0, near = 0;
    for (int round = 0; round < 400; round++) {
        const unsigned bits = round % 2 ? 8 : 4;
        float w[64];
        float unit = ldexpf(1.0f + (float)(lcg(&seed) % 1000) / 1000.0f, -(int)(lcg(&seed) % 12));
        int span = (int)(lcg(&seed) % 600) + 3;
        for (int c = 0; c < 64; c++)
            w[c] = unit * (float)((int)(lcg(&seed) % (unsigned)(2 * span + 1)) - span);
        const qm_quant_spec q = {.bits = bits, .block_size = 32, .scale_dtype = QM_DTYPE_F32};
        uint8_t packed[64];
        float scales[2];
        ck_assert_int_eq(qm_quant_row(&q, w, 64, packed, scales, 0, NULL, NULL), 0);
        for (int c = 0; c < 64; c++) {
            float s = scales[c / 32], t = w[c] * (1.0f / s);
            near += fabsf(t - rintf(t)) > 0.49f;
            ck_assert_msg(code_at(packed, bits, c) == reference_code(w[c], s, bits),
                          "round %d col %d: x %a s %a code %d, want %d", round, c, (double)w[c],
                          (double)s, code_at(packed, bits, c), reference_code(w[c], s, bits));
            checked++;
        }
    }
    ck_assert_uint_eq(checked, 400 * 64);
    ck_assert_msg(near > 100, "only %u values near a tie: the test lost its point", near);
}
END_TEST

START_TEST(test_quant_scale_rules_for_f16_scales)
{
    int differ = 0;
    for (int row = 0; row < 50; row++) {
        float w[32];
        for (int c = 0; c < 32; c++)
            w[c] = sinf((float)(c + 32 * row)) * 0.37f;
        uint8_t stored_codes[32], f32_codes[32];
        uint16_t s_stored, s_f32;
        qm_quant_spec q = {.bits = 8, .block_size = 0, .scale_dtype = QM_DTYPE_F16};
        ck_assert_int_eq(qm_quant_row(&q, w, 32, stored_codes, &s_stored, 0, NULL, NULL), 0);
        q.rule = QM_QUANT_F32_SCALE;
        ck_assert_int_eq(qm_quant_row(&q, w, 32, f32_codes, &s_f32, 0, NULL, NULL), 0);
        float amax = 0;
        for (int c = 0; c < 32; c++)
            amax = fabsf(w[c]) > amax ? fabsf(w[c]) : amax;
        float scale = amax / 127.0f, stored = qm_f16_to_f32(qm_f32_to_f16(scale));
        ck_assert_uint_eq(s_stored, qm_f32_to_f16(scale)); /* both store the rounded scale */
        ck_assert_uint_eq(s_f32, qm_f32_to_f16(scale));
        for (int c = 0; c < 32; c++) {
            ck_assert_int_eq(stored_codes[c], reference_code(w[c], stored, 8));
            ck_assert_int_eq(f32_codes[c], reference_code(w[c], scale, 8));
            differ += stored_codes[c] != f32_codes[c];
        }
    }
    ck_assert_msg(differ > 0, "the two rules never differed: the test lost its point");
    uint8_t stored_codes[32];
    uint16_t s_stored;
    const qm_quant_spec q = {.bits = 8, .block_size = 0, .scale_dtype = QM_DTYPE_F16};
    /* a block of zeros: the stored scale is never 0 under the stored-scale rule */
    float z[32] = {0};
    ck_assert_int_eq(qm_quant_row(&q, z, 32, stored_codes, &s_stored, 0, NULL, NULL), 0);
    ck_assert_uint_eq(s_stored, 0x0001);
    ck_assert_int_eq(stored_codes[0], 128);
}
END_TEST

START_TEST(test_quant_asymmetric_min_max_with_zero_points)
{
    float w[32];
    for (int c = 0; c < 32; c++)
        w[c] = 0.1f + 0.02f * (float)c; /* all positive: zero point 0 */
    const qm_quant_spec q = {.bits = 4,
                             .block_size = 16,
                             .scale_dtype = QM_DTYPE_F32,
                             .asymmetric = 1,
                             .rule = QM_QUANT_F32_SCALE};
    uint8_t packed[16], zp[2];
    float scales[2];
    ck_assert_int_eq(qm_quant_row(&q, w, 32, packed, scales, 0, zp, NULL), 0);
    for (int b = 0; b < 2; b++) {
        float mn = w[16 * b], mx = w[16 * b + 15];
        ck_assert_float_eq(scales[b], (mx - mn) / 15.0f);
        double zpf = -(double)mn / (double)scales[b];
        ck_assert_int_eq(zp[b], (int)fmax(0, fmin(15, rint(zpf))));
        for (int c = 16 * b; c < 16 * b + 16; c++) {
            double v = rint((double)w[c] / (double)scales[b] + zpf);
            ck_assert_int_eq(code_at(packed, 4, c), (int)fmax(0, fmin(15, v)));
        }
    }
}
END_TEST

START_TEST(test_quant_refuses_nan_and_infinity)
{
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++)
        for (int at = 0; at < 32; at += 31) {
            float w[32];
            for (int c = 0; c < 32; c++)
                w[c] = 0.01f * (float)c;
            w[at] = bad[i];
            /* Both layouts and widths: no code is computed from a NaN (an
             * integer conversion of one is undefined; clang's UBSan stops). */
            for (int v = 0; v < 4; v++) {
                uint8_t packed[32], zp[1];
                float scale;
                const qm_quant_spec q = {.bits = v & 1 ? 8 : 4,
                                         .block_size = 32,
                                         .scale_dtype = QM_DTYPE_F32,
                                         .asymmetric = v >= 2};
                ck_assert_int_eq(qm_quant_row(&q, w, 32, packed, &scale, 0, zp, NULL), QM_EINVAL);
            }
            ck_assert_int_eq(qm_quant_finite(w, 32), 0);
        }
    float ok[3] = {0, -1e30f, 3.4e38f};
    ck_assert_int_eq(qm_quant_finite(ok, 3), 1);
}
END_TEST

START_TEST(test_quant_error_accumulates_over_rows)
{
    float w[2][32];
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 32; c++)
            w[r][c] = cosf((float)(c + 40 * r)) * 0.2f;
    const qm_quant_spec q = {.bits = 4, .block_size = 32, .scale_dtype = QM_DTYPE_F32};
    qm_quant_error err = QM_QUANT_ERROR_INIT;
    uint8_t packed[2][16];
    float scales[2];
    for (int r = 0; r < 2; r++)
        ck_assert_int_eq(qm_quant_row(&q, w[r], 32, packed[r], scales, (uint64_t)r, NULL, &err), 0);
    double d2 = 0, r2 = 0;
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 32; c++) {
            double e =
                (double)(scales[r] * (float)(code_at(packed[r], 4, c) - 8)) - (double)w[r][c];
            d2 += e * e;
            r2 += (double)w[r][c] * (double)w[r][c];
        }
    /* f32 sums over 32-column chunks: within a few f32 roundings of the f64 sum */
    ck_assert_double_eq_tol(qm_quant_error_rel(&err), sqrt(d2 / r2), 1e-6 * sqrt(d2 / r2));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model_quant");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_quant_symmetric_rtn_against_the_stored_scale);
    tcase_add_test(tc, test_quant_codes_are_the_exact_quotients_rounding_at_and_near_ties);
    tcase_add_test(tc, test_quant_scale_rules_for_f16_scales);
    tcase_add_test(tc, test_quant_asymmetric_min_max_with_zero_points);
    tcase_add_test(tc, test_quant_refuses_nan_and_infinity);
    tcase_add_test(tc, test_quant_error_accumulates_over_rows);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
