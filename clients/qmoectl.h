/* qmoectl.h - what qmoectl's files share: parsed options, the command table,
 * humane formatting, and .npy files. Not installed. */
#ifndef QMOECTL_H
#define QMOECTL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "qmoe_client.h"

enum { QMOECTL_OK = 0, QMOECTL_FAILED = 1, QMOECTL_USAGE = 2 };

#define QMOECTL_MAX_ARGS 64

/* A subcommand's parsed arguments. Option values are borrowed from argv. */
typedef struct qmoectl_args {
    const char *socket;
    int json;
    int timeout_ms;
    const char *pos[QMOECTL_MAX_ARGS]; /* positionals after the subcommand */
    int npos;
    const char *opt_name[QMOECTL_MAX_ARGS]; /* "--policy" ... in order given */
    const char *opt_value[QMOECTL_MAX_ARGS]; /* NULL for flags */
    int nopt;
} qmoectl_args;

typedef struct qmoectl_cmd {
    const char *name;
    const char *synopsis; /* after "qmoectl NAME" */
    const char *help;     /* paragraph printed by --help */
    const char *options;  /* space-separated option names; a trailing '=' takes a value */
    int min_pos, max_pos;
    int (*run)(qm_client *c, const qmoectl_args *a);
    /* (optional) usage checks that need no daemon: 0 or QMOECTL_USAGE. */
    int (*check)(const qmoectl_args *a);
    /* (optional) more of --help, written after `help` (lists from a registry). */
    void (*more_help)(FILE *out);
    /* (optional) runs without a daemon, in place of `run`. */
    int (*run_local)(const qmoectl_args *a);
} qmoectl_cmd;

extern const qmoectl_cmd qmoectl_cmds[];

/* The wire's rows as commands (qmoectl_wire.c): methods, call. */
int qmoectl_cmd_methods(const qmoectl_args *a);
int qmoectl_cmd_call(qm_client *c, const qmoectl_args *a);
int qmoectl_check_call(const qmoectl_args *a);
/* 0 when `value` is one of the names `method`'s `member` row takes (an
 * enum's, from its registry); else a usage error naming `option` and them. */
int qmoectl_check_name(const char *method, const char *member, const char *option,
                       const char *value);

/* The plan and telemetry views (qmoectl_views.c). */
int qmoectl_cmd_plan(qm_client *c, const qmoectl_args *a);
int qmoectl_cmd_telemetry(qm_client *c, const qmoectl_args *a);
int qmoectl_check_telemetry(const qmoectl_args *a);

/* Last value of an option, or NULL; flags give "" when present. */
const char *qmoectl_opt(const qmoectl_args *a, const char *name);

/* Prints "qmoectl: <reason>" for a failed request, with a hint for the
 * errors a person can act on. Returns QMOECTL_FAILED. */
int qmoectl_fail(const qm_client_error *err);
/* Prints "qmoectl: <message>" and returns QMOECTL_FAILED. */
int qmoectl_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prints "qmoectl: <message>" the same way and returns QMOECTL_USAGE. */
#define qmoectl_usage_error(...) (qmoectl_error(__VA_ARGS__), QMOECTL_USAGE)

/* Calls `method` and prints its raw result as indented JSON (--json). */
int qmoectl_print_json(qm_client *c, const char *method, const char *params_json);
/* The same for a method taking {"session": SESSION}, or no params when SESSION is NULL;
 * QMOECTL_USAGE when the id is too long. */
int qmoectl_print_json_session(qm_client *c, const char *method, const char *session);

/* Humane units into caller buffers (>= 32 bytes). */
const char *qmoectl_bytes(uint64_t n, char *buf, size_t cap);     /* "1.5 GiB" */
const char *qmoectl_micros(double us, char *buf, size_t cap);     /* "850 us", "1.2 ms" */
const char *qmoectl_duration(double s, char *buf, size_t cap);    /* "3h 12m" */
const char *qmoectl_percent(double num, double den, char *buf, size_t cap); /* "42%" or "-" */
/* Parses "1048576", "64MiB", "1.5G", "2 GiB"; 0 or -1. */
int qmoectl_parse_bytes(const char *s, uint64_t *out);
/* {"KEY":"VALUE"} (VALUE quoted and escaped) into `out`; 0 or -1 when too long. */
int qmoectl_one_param(char *out, size_t cap, const char *key, const char *value);
/* Appends `s` to a JSON string literal in `out` (quoted, escaped). */
int qmoectl_json_quote(const char *s, char *out, size_t cap);

/* A text table: add cells row by row, then print with aligned columns. */
typedef struct qmoectl_table qmoectl_table;
qmoectl_table *qmoectl_table_new(int ncols, const char *const *headers);
void qmoectl_table_cell(qmoectl_table *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void qmoectl_table_print(qmoectl_table *t, FILE *out);
void qmoectl_table_free(qmoectl_table *t);

/* .npy files (f32/f16, '<u2' as bf16 bits; little-endian, C order). On 0
 * the tensor owns its data (release with qmoectl_npy_free); errors are
 * written to `msg`. */
int qmoectl_npy_read(const char *path, qm_client_tensor *t, char *msg, size_t cap);
int qmoectl_npy_write(const char *path, const qm_client_tensor *t, char *msg, size_t cap);
void qmoectl_npy_free(qm_client_tensor *t); /* accepts NULL */

#endif
