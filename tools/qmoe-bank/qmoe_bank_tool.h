/* qmoe_bank_tool.h - the subcommands of the qmoe-bank tool. */
#ifndef QMOE_BANK_TOOL_H
#define QMOE_BANK_TOOL_H

#include <stdio.h>

#include "qm_bank.h"

/* Exit statuses: 0 ok, 1 runtime failure (I/O, memory), 2 bad usage or an
 * invalid bank/tensor file. */
enum { QM__EXIT_OK = 0, QM__EXIT_FAIL = 1, QM__EXIT_USAGE = 2 };

int qm__cmd_create(int argc, char **argv);
int qm__cmd_inspect(int argc, char **argv);
int qm__cmd_run(int argc, char **argv);
int qm__cmd_import_hf(int argc, char **argv);   /* import_hf.c: argv[0] = "hf" */
int qm__cmd_import_gguf(int argc, char **argv); /* import_gguf.c: argv[0] = "gguf" */

void qm__help_create(FILE *f);
void qm__help_inspect(FILE *f);
void qm__help_run(FILE *f);
void qm__help_import_hf(FILE *f);
void qm__help_import_gguf(FILE *f);

/* Prints "qmoe-bank CMD: WHAT (see qmoe-bank CMD --help)" to stderr;
 * returns QM__EXIT_USAGE. */
int qm__usage(const char *cmd, const char *what);
/* Strict unsigned parse of a whole string; -1 on junk or overflow of `max`. */
int qm__parse_u32(const char *s, unsigned long long max, unsigned *out);
/* A scale dtype option's value, "f32", "f16" or "bf16", into *out; -1
 * for anything else. */
int qm__parse_scale_dtype(const char *s, qm_dtype *out);
/* Prints s as a JSON string literal. */
void qm__json_string(FILE *f, const char *s);

#endif
