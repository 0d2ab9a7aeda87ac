/* qmoe-bank - create, inspect and run expert bank files. */
#include <stdlib.h>
#include <string.h>

#include "import_families.h"
#include "qmoe_bank_tool.h"

static void help_main(FILE *f)
{
    fputs("usage: qmoe-bank <command> [options]\n"
          "\n"
          "Expert bank files: safetensors files holding the initializers of ONNX Runtime's\n"
          "com.microsoft.QMoE operator for every MoE layer of a model (docs/BANK_FORMAT.md).\n"
          "\n"
          "commands:\n"
          "  create   write a deterministic synthetic bank (seeded weights, quantised)\n"
          "  inspect  validate a bank and print its summary, tensors and region catalogs\n"
          "  run      run one MoE layer of a bank on the CPU engine (.npy in, .npy out)\n"
          "  import   import a model's experts: import hf DIR (a Hugging Face checkpoint),\n"
          "           import gguf FILE (a llama.cpp GGUF file); import --families lists\n"
          "           the families both read, as JSON\n"
          "\n"
          "`qmoe-bank <command> --help` describes each command.\n"
          "exit status: 0 ok, 1 runtime failure, 2 bad usage or invalid file.\n",
          f);
}

/* `qmoe-bank import FORMAT ...`: one entry per source format; each gets
 * argv[0] = the format. */
static int import_main(int argc, char **argv)
{
    static const struct {
        const char *format;
        int (*run)(int argc, char **argv);
    } formats[] = {
        {"hf", qm__cmd_import_hf},
        {"gguf", qm__cmd_import_gguf},
    };
    if (argc >= 2 && strcmp(argv[1], "--families") == 0) {
        qm__families_json(stdout);
        return QM__EXIT_OK;
    }
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        qm__help_import_hf(stdout);
        fputc('\n', stdout);
        qm__help_import_gguf(stdout);
        return QM__EXIT_OK;
    }
    for (size_t i = 0; argc >= 2 && i < sizeof formats / sizeof formats[0]; i++)
        if (strcmp(argv[1], formats[i].format) == 0) return formats[i].run(argc - 1, argv + 1);
    fprintf(stderr,
            "qmoe-bank import: expected a source format (hf or gguf) and its arguments; see "
            "qmoe-bank import --help\n");
    return QM__EXIT_USAGE;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        help_main(stderr);
        return QM__EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        help_main(stdout);
        return QM__EXIT_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("qmoe-bank %s\n", QMOE_VERSION);
        return QM__EXIT_OK;
    }
    if (strcmp(cmd, "create") == 0) return qm__cmd_create(argc - 1, argv + 1);
    if (strcmp(cmd, "inspect") == 0) return qm__cmd_inspect(argc - 1, argv + 1);
    if (strcmp(cmd, "run") == 0) return qm__cmd_run(argc - 1, argv + 1);
    if (strcmp(cmd, "import") == 0) return import_main(argc - 1, argv + 1);
    fprintf(stderr,
            "qmoe-bank: unknown command \"%.64s\" (create, inspect, run, import; see --help)\n",
            cmd);
    return QM__EXIT_USAGE;
}
