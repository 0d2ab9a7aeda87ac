/* qmoectl_format.c - humane units and aligned tables. Raw numbers stay in
 * the API; only the CLI turns them into words. */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "qmoectl.h"

#include "qm_buf.h"

const char *qmoectl_bytes(uint64_t n, char *buf, size_t cap)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%llu B", (unsigned long long)n);
    else
        snprintf(buf, cap, v >= 100 ? "%.0f %s" : "%.1f %s", v, units[u]);
    return buf;
}

const char *qmoectl_micros(double us, char *buf, size_t cap)
{
    if (!(us >= 0))
        snprintf(buf, cap, "-");
    else if (us < 1000)
        snprintf(buf, cap, "%.0f us", us);
    else if (us < 1e6)
        snprintf(buf, cap, "%.1f ms", us / 1e3);
    else
        snprintf(buf, cap, "%.2f s", us / 1e6);
    return buf;
}

const char *qmoectl_duration(double s, char *buf, size_t cap)
{
    unsigned long long t = s > 0 ? (unsigned long long)s : 0;
    if (t < 60)
        snprintf(buf, cap, "%llus", t);
    else if (t < 3600)
        snprintf(buf, cap, "%llum %llus", t / 60, t % 60);
    else if (t < 86400)
        snprintf(buf, cap, "%lluh %llum", t / 3600, t % 3600 / 60);
    else
        snprintf(buf, cap, "%llud %lluh", t / 86400, t % 86400 / 3600);
    return buf;
}

const char *qmoectl_percent(double num, double den, char *buf, size_t cap)
{
    if (!(den > 0))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.0f%%", 100.0 * num / den);
    return buf;
}

int qmoectl_parse_bytes(const char *s, uint64_t *out)
{
    char *end = NULL;
    if (!s || !isdigit((unsigned char)*s))
        return -1;
    double v = strtod(s, &end);
    while (*end == ' ')
        end++;
    double mul = 1;
    if (*end) {
        char u = (char)toupper((unsigned char)*end);
        const char *rest = end + 1;
        switch (u) {
        case 'B': mul = 1; rest = end; break;
        case 'K': mul = 1024.0; break;
        case 'M': mul = 1024.0 * 1024; break;
        case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        default: return -1;
        }
        /* Accept K, KB, KiB (all binary: budgets are memory). */
        if (*rest == 'i' || *rest == 'I')
            rest++;
        if (*rest == 'b' || *rest == 'B')
            rest++;
        if (*rest)
            return -1;
    }
    double b = v * mul;
    if (!(b >= 0) || b >= 18446744073709551616.0 || (mul == 1 && v != floor(v)))
        return -1;
    *out = (uint64_t)llround(b);
    return 0;
}

int qmoectl_json_quote(const char *s, char *out, size_t cap)
{
    qm_buf b;
    qm_buf_init(&b);
    qm_buf_append(&b, "\"", 1);
    qm_json_escape(&b, s, strlen(s));
    qm_buf_append(&b, "\"", 1);
    int rc = !b.oom && b.len < cap ? 0 : -1;
    if (rc == 0) {
        memcpy(out, b.data, b.len);
        out[b.len] = '\0';
    }
    qm_buf_free(&b);
    return rc;
}

int qmoectl_one_param(char *out, size_t cap, const char *key, const char *value)
{
    char q[1024];
    if (qmoectl_json_quote(value, q, sizeof(q)) < 0)
        return -1;
    int n = snprintf(out, cap, "{\"%s\":%s}", key, q);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

struct qmoectl_table {
    int ncols;
    char **cells; /* row-major, headers first */
    size_t n, cap;
};

qmoectl_table *qmoectl_table_new(int ncols, const char *const *headers)
{
    qmoectl_table *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->ncols = ncols;
    for (int i = 0; i < ncols; i++)
        qmoectl_table_cell(t, "%s", headers[i]);
    return t;
}

void qmoectl_table_cell(qmoectl_table *t, const char *fmt, ...)
{
    if (!t)
        return;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        char **c = realloc(t->cells, cap * sizeof(*c));
        if (!c)
            return; /* a lost cell misaligns one row; better than dying in a CLI */
        t->cells = c;
        t->cap = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0)
        s = NULL;
    va_end(ap);
    t->cells[t->n++] = s;
}

/* Display width: count UTF-8 lead bytes only. */
static size_t qmoectl__width(const char *s)
{
    size_t w = 0;
    for (; s && *s; s++)
        if (((unsigned char)*s & 0xc0) != 0x80)
            w++;
    return w;
}

void qmoectl_table_print(qmoectl_table *t, FILE *out)
{
    if (!t)
        return;
    size_t width[32] = {0};
    int nc = t->ncols < 32 ? t->ncols : 32;
    for (size_t i = 0; i < t->n; i++) {
        size_t w = qmoectl__width(t->cells[i]);
        if (w > width[i % t->ncols])
            width[i % t->ncols] = w;
    }
    for (size_t i = 0; i < t->n; i++) {
        int col = (int)(i % t->ncols);
        const char *s = t->cells[i] ? t->cells[i] : "";
        int last = col == t->ncols - 1 || i + 1 == t->n;
        fputs(s, out);
        if (last) {
            fputc('\n', out);
        } else {
            for (size_t p = qmoectl__width(s); col < nc && p < width[col] + 2; p++)
                fputc(' ', out);
        }
    }
}

void qmoectl_table_free(qmoectl_table *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->n; i++)
        free(t->cells[i]);
    free(t->cells);
    free(t);
}
