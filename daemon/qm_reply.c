/* qm_reply.c - a frame's answers, assembled slot by slot and written once. */
#include "qm_reply.h"

#include "qm_alloc.h"
#include "qm_log.h"

struct qm_reply {
    qm_conn *conn;
    qm_counters *counters;
    int is_batch;
    size_t n, pending; /* slots, and those not yet filled + the frame's hold */
    char **parts;      /* NULL: no response (notification) */
    size_t *lens;
};

int qm_reply_abandoned(const qm_reply *r) { return qm_conn_gone(r->conn); }
qm_conn *qm_reply_conn(const qm_reply *r) { return r->conn; }

qm_reply *qm_reply_new(qm_conn *c, size_t n, int is_batch, qm_counters *counters)
{
    qm_reply *r = qm_calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->parts = qm_calloc(n ? n : 1, sizeof *r->parts);
    if (!r->parts)
        goto fail_parts;
    r->lens = qm_calloc(n ? n : 1, sizeof *r->lens);
    if (!r->lens)
        goto fail_lens;
    r->conn = c;
    r->counters = counters;
    r->n = n;
    r->pending = n + 1;
    r->is_batch = is_batch;
    qm_conn_reply_begin(c);
    return r;

fail_lens:
    qm_free(r->parts);
fail_parts:
    qm_free(r);
    return NULL;
}

static void reply_send(qm_reply *r)
{
    qm_buf b;
    qm_buf_init(&b);
    size_t present = 0;
    for (size_t i = 0; i < r->n; i++)
        present += r->parts[i] != NULL;
    if (present == 1 && r->n == 1 && !r->is_batch) {
        /* The common case: one answer, written as it is (no copy). */
        char *p = qm_realloc(r->parts[0], r->lens[0] + 1);
        if (p) {
            p[r->lens[0]] = '\n';
            qm_conn_write(r->conn, p, r->lens[0] + 1);
            r->parts[0] = NULL;
            present = 0;
        }
    }
    if (present) {
        if (r->is_batch)
            qm_buf_append(&b, "[", 1);
        size_t k = 0;
        for (size_t i = 0; i < r->n; i++) {
            if (!r->parts[i])
                continue;
            if (k++)
                qm_buf_append(&b, ",", 1);
            qm_buf_append(&b, r->parts[i], r->lens[i]);
        }
        if (r->is_batch)
            qm_buf_append(&b, "]", 1);
        qm_buf_append(&b, "\n", 1);
        if (!b.oom) {
            size_t len;
            char *data = qm_buf_take(&b, &len);
            qm_conn_write(r->conn, data, len);
        } else {
            qm_log(QM_LOG_ERR, "out of memory assembling a response; dropping connection %llu",
                   (unsigned long long)qm_conn_id(r->conn));
            qm_conn_drop(r->conn);
        }
    }
    qm_buf_free(&b);
    for (size_t i = 0; i < r->n; i++)
        qm_free(r->parts[i]);
    qm_free(r->parts);
    qm_free(r->lens);
    qm_conn *c = r->conn;
    qm_free(r);
    qm_conn_reply_done(c);
}

static void reply_settle(qm_reply *r)
{
    if (--r->pending == 0)
        reply_send(r);
}

void qm_reply_release(qm_reply *r) { reply_settle(r); }

void qm_reply_fill(qm_reply *r, size_t slot, char *data, size_t len)
{
    r->parts[slot] = data;
    r->lens[slot] = len;
    reply_settle(r);
}

void qm_reply_take_buf(qm_reply *r, size_t slot, qm_buf *b, const char *id)
{
    if (b->oom) {
        qm_buf_reset(b);
        qm_jw w;
        qm_jw_init(&w, b);
        qm_rpc_error(&w, id, QM_RPC_INTERNAL_ERROR, "out of memory encoding the response", NULL);
        r->counters->errors++;
    }
    size_t len;
    char *data = qm_buf_take(b, &len);
    qm_reply_fill(r, slot, data, len);
}

/* A notification's slot is answered empty (0); otherwise b and w are ready
 * for the answer (1), which qm_reply_take_buf sends. */
static int reply_open(qm_reply *r, size_t slot, int notification, qm_buf *b, qm_jw *w)
{
    if (notification) {
        qm_reply_fill(r, slot, NULL, 0);
        return 0;
    }
    qm_buf_init(b);
    qm_jw_init(w, b);
    return 1;
}

void qm_reply_error(qm_reply *r, size_t slot, const char *id, int notification, int rpc_code,
                    const char *reason, const char *field)
{
    r->counters->errors++;
    qm_buf b;
    qm_jw w;
    if (!reply_open(r, slot, notification, &b, &w))
        return;
    qm_rpc_error(&w, id, rpc_code, reason, field);
    qm_reply_take_buf(r, slot, &b, id);
}

void qm_reply_status(qm_reply *r, size_t slot, const qm_request *req, const qm_status *st)
{
    qm_reply_error(r, slot, req->id, req->id == NULL, qm_rpc_code_from_status(st->code), st->msg,
                   st->field);
}

void qm_reply_result(qm_reply *r, size_t slot, const qm_request *req,
                     void (*write)(qm_jw *w, const void *arg), const void *arg)
{
    qm_buf b;
    qm_jw w;
    if (!reply_open(r, slot, req->id == NULL, &b, &w))
        return;
    qm_rpc_result_begin(&w, req->id);
    write(&w, arg);
    qm_rpc_result_end(&w);
    qm_reply_take_buf(r, slot, &b, req->id);
}
