/* qmoectl_npy.c - .npy files for `qmoectl infer`, through protocol/'s
 * validating reader and writer (qm_npy.h). f32 and f16 map to the wire
 * dtypes of the same name; '<u2' arrays travel as bf16 bits,
 * '<i4' as i32 (topk_ids). */
#include <string.h>

#include "qm_alloc.h"
#include "qm_npy.h"
#include "qmoectl.h"

int qmoectl_npy_read(const char *path, qm_client_tensor *t, char *msg, size_t cap)
{
    qm_npy npy;
    qm_status st = {0};
    memset(t, 0, sizeof(*t));
    if (qm_npy_read(path, 0, &npy, &st) < 0) {
        snprintf(msg, cap, "%s: %s", path, st.msg);
        return -1;
    }
    if (npy.ndim < 1 || npy.ndim > QM_CLIENT_MAX_DIMS) {
        snprintf(msg, cap, "%s: a tensor needs 1 to %d dimensions, this array has %u", path,
                 QM_CLIENT_MAX_DIMS, npy.ndim);
        qm_npy_free(&npy);
        return -1;
    }
    t->dtype = npy.dtype == QM_NPY_F32   ? QM_CLIENT_F32
               : npy.dtype == QM_NPY_F16 ? QM_CLIENT_F16
               : npy.dtype == QM_NPY_I32 ? QM_CLIENT_I32
                                         : QM_CLIENT_BF16;
    t->ndim = (int)npy.ndim;
    memcpy(t->shape, npy.shape, sizeof(uint64_t) * npy.ndim);
    t->nbytes = (size_t)npy.nbytes;
    t->data = npy.data; /* handed over; qmoectl_npy_free releases it */
    return 0;
}

int qmoectl_npy_write(const char *path, const qm_client_tensor *t, char *msg, size_t cap)
{
    qm_status st = {0};
    qm_npy_dtype dt = t->dtype == QM_CLIENT_F32   ? QM_NPY_F32
                      : t->dtype == QM_CLIENT_F16 ? QM_NPY_F16
                      : t->dtype == QM_CLIENT_I32 ? QM_NPY_I32
                                                  : QM_NPY_U16;
    if (qm_npy_write(path, dt, t->shape, (uint32_t)t->ndim, t->data, &st) < 0) {
        snprintf(msg, cap, "%s: %s", path, st.msg);
        return -1;
    }
    return 0;
}

void qmoectl_npy_free(qm_client_tensor *t)
{
    if (!t)
        return;
    qm_free(t->data);
    t->data = NULL;
}
