/* fuzz_gguf.c - libFuzzer: a whole `qmoe-bank import gguf` of arbitrary bytes
 * taken as a GGUF file in memory: the header, metadata and tensor infos
 * (gguf_reader.c), the plan against the family table, every tensor's
 * dequantisation or exact repack, the bank writer; then, when the import
 * says it succeeded, the bank it wrote must open through the loader. */
#include <stddef.h>
#include <stdint.h>

#include "fuzz_common.h"
#include "gguf_reader.h"
#include "qm_bank.h"
#include "qmoe_bank_tool.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *out = fuzz_out_path();
    qm__gguf_file *f = NULL;
    qm_status st;
    qm_status_clear(&st);
    if (qm__gguf_open_memory(data, size, &f, &st) != 0) return 0;
    char *argv[] = {"gguf",
                    "fuzz.gguf",
                    "--out",
                    (char *)out,
                    "--quiet",
                    "--requant-bits",
                    size % 2 ? "4" : "8",
                    "--mxfp4",
                    size & 2 ? "int8" : "e2m1",
                    NULL};
    int rc = qm__gguf_run(f, 9, argv);
    if (rc == QM__EXIT_OK) {
        qm_bank *bank = NULL;
        if (qm_bank_open(out, &bank, &st) != 0) abort(); /* the writer checked it: never */
        qm_bank_close(bank);
    }
    fuzz_clean();
    return 0;
}
