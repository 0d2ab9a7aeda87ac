/* fuzz_bank_open.c - libFuzzer over qm_bank_open_memory and the catalogs.
 * A bank's qmoe.source, which the daemon splices into its answers, must
 * come out as one line of JSON in well-formed UTF-8 whatever the file
 * holds. */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qm_bank.h"
#include "qm_json.h"
#include "qm_residency.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* An exact-size copy: any read past the end is an ASan report. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    qm_bank *bank = NULL;
    qm_status st;
    if (qm_bank_open_memory(buf, size, &bank, &st) == 0) {
        const qm_bank_config *c = qm_bank_get_config(bank);
        const char *src = qm_bank_source_json(bank);
        for (size_t i = 0, n = src ? strlen(src) : 0; i < n;) {
            size_t k = qm_utf8_valid_len((const unsigned char *)src + i, n - i);
            if (!k || src[i] == '\n')
                abort();
            i += k;
        }
        cJSON *sj = src ? cJSON_Parse(src) : NULL;
        if (src && !cJSON_IsObject(sj))
            abort();
        cJSON_Delete(sj);
        volatile uint8_t sink = 0;
        for (uint32_t l = 0; l < c->layers; l++) {
            const qm_layer_view *lv = qm_bank_layer(bank, l);
            for (int t = 0; t < QM_T_COUNT; t++)
                if (lv->t[t].present && lv->t[t].nbytes)
                    sink ^= ((const uint8_t *)lv->t[t].data)[lv->t[t].nbytes - 1];
            qm_region_catalog *cat = NULL;
            if (qm_bank_build_catalog(bank, l, &cat, &st) == 0)
                qm_catalog_free(cat);
        }
        (void)sink;
        qm_bank_close(bank);
    } else if (st.msg[0] == '\0') {
        abort(); /* every failure must carry a sentence */
    }
    free(buf);
    return 0;
}
