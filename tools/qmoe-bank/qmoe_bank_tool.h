/* qmoe_bank_tool.h - the subcommands of the qmoe-bank tool. */
#ifndef QMOE_BANK_TOOL_H
#define QMOE_BANK_TOOL_H

#include <stdio.h>

/* Exit statuses: 0 ok, 1 runtime failure (I/O, memory), 2 bad usage or an
 * invalid bank/tensor file. */
enum { QMB_OK = 0, QMB_FAIL = 1, QMB_USAGE = 2 };

int qmb_create(int argc, char **argv);
int qmb_inspect(int argc, char **argv);
int qmb_run(int argc, char **argv);
int qmb_import_hf(int argc, char **argv); /* import_hf.c: argv[0] = "hf" */
int qmb_import_gguf(int argc, char **argv); /* import_gguf.c: argv[0] = "gguf" */

void qmb_help_create(FILE *f);
void qmb_help_inspect(FILE *f);
void qmb_help_run(FILE *f);
void qmb_help_import_hf(FILE *f);
void qmb_help_import_gguf(FILE *f);

/* Prints "qmoe-bank CMD: WHAT (see qmoe-bank CMD --help)" to stderr;
 * returns QMB_USAGE. */
int qmb_usage(const char *cmd, const char *what);
/* Strict unsigned parse of a whole string; -1 on junk or overflow of `max`. */
int qmb_parse_u32(const char *s, unsigned long long max, unsigned *out);
/* Prints s as a JSON string literal. */
void qmb_json_string(FILE *f, const char *s);

#endif
