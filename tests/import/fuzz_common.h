/* fuzz_common.h - what the importer's fuzz targets share: a private
 * directory on tmpfs for the bank each whole import writes, and the tool's
 * own failure lines kept off the fuzzer's output. */
#ifndef QMOE_FUZZ_COMMON_H
#define QMOE_FUZZ_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char fuzz_dir[64];

/* The directory goes when the process exits (libFuzzer's runs end in exit). */
static void fuzz_rmdir(void)
{
    rmdir(fuzz_dir);
}

/* The output path for this process (created once; removed after each run
 * by fuzz_clean, its directory at exit). The tool's stdout and stderr lines
 * go to /dev/null: libFuzzer keeps its own handle on the real stderr, and
 * ASan writes to the descriptor directly. */
static const char *fuzz_out_path(void)
{
    static char out[96];
    if (!out[0]) {
        snprintf(fuzz_dir, sizeof fuzz_dir, "%s/qmoe-fuzz-XXXXXX",
                 access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
        if (!mkdtemp(fuzz_dir)) abort();
        atexit(fuzz_rmdir);
        snprintf(out, sizeof out, "%s/out.bank", fuzz_dir);
        FILE *null = fopen("/dev/null", "w");
        if (null) {
            stdout = null;
            stderr = null;
        }
    }
    return out;
}

static void fuzz_clean(void)
{
    char partial[128];
    unlink(fuzz_out_path());
    snprintf(partial, sizeof partial, "%s.partial", fuzz_out_path());
    unlink(partial);
}

#endif
