/* bank_run.c - `qmoe-bank run`: one MoE layer on the CPU engine. */
#include <stdio.h>

#include "qmoe_bank_tool.h"

void qmb_help_run(FILE *f)
{
    fputs("usage: qmoe-bank run FILE --layer N --hidden X.npy [--logits R.npy] --out Y.npy\n"
          "                     [--threads T]\n", f);
}

int qmb_run(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "qmoe-bank run: engine not built\n");
    return 1;
}
