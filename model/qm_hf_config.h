/* qm_hf_config.h - the JSON files of a Hugging Face checkpoint, as typed lookups.
 *
 * `qmoe-bank import hf` reads config.json and model.safetensors.index.json;
 * like the safetensors header codec beside it, this is a codec of untrusted
 * file bytes, so model/ parses both and the importer asks typed questions
 * ("the number at key K") without seeing cJSON. Keys address nested objects with
 * '/' ("quantization_config/quant_method"), because tensor names and config
 * keys contain dots. The text is untrusted: nesting is bounded before cJSON
 * sees it, and every lookup checks the value's type. */
#ifndef QM_HF_CONFIG_H
#define QM_HF_CONFIG_H

#include <stddef.h>

#include "qm_error.h"

typedef struct qm_hf_json qm_hf_json;

/* Parses n bytes of JSON whose top level must be an object. `what` names the
 * file in error sentences ("config.json"). The caller owns *out and frees it
 * with qm_hf_json_free (accepts NULL). QM_EPARSE with a sentence on bad text. */
int qm_hf_json_parse(const char *text, size_t n, const char *what, qm_hf_json **out, qm_status *st);
void qm_hf_json_free(qm_hf_json *j);

/* Typed lookups. Each returns 0 and writes *out when the key holds a value of
 * that type, QM_ENOT_FOUND when the key is absent or JSON null, and QM_EINVAL
 * when it holds another type (with a sentence naming the file, the key and
 * the type expected). Strings are borrowed from j. */
int qm_hf_json_number(const qm_hf_json *j, const char *key, double *out, qm_status *st);
int qm_hf_json_bool(const qm_hf_json *j, const char *key, int *out, qm_status *st);
int qm_hf_json_string(const qm_hf_json *j, const char *key, const char **out, qm_status *st);
/* An array: its length in *len (QM_EINVAL when not an array). */
int qm_hf_json_array_len(const qm_hf_json *j, const char *key, size_t *len, qm_status *st);
/* Item i of the array at key, as a number or a string. */
int qm_hf_json_array_number(const qm_hf_json *j, const char *key, size_t i, double *out,
                            qm_status *st);
int qm_hf_json_array_string(const qm_hf_json *j, const char *key, size_t i, const char **out,
                            qm_status *st);

/* Every item of the array at key as a number, in one walk (an index lookup
 * per item would cost the array's length each): *out is an array of *n
 * doubles the caller frees with qm_free (NULL when empty). QM_EINVAL naming
 * the key when an item is not a number. */
int qm_hf_json_numbers(const qm_hf_json *j, const char *key, double **out, size_t *n,
                       qm_status *st);

/* The members of the object at key (e.g. "weight_map" of an index file),
 * each a (name, string value) pair. *names and *values are arrays of n
 * borrowed pointers, owned by the caller (free both arrays with qm_free, not
 * the strings). A member whose value is not a string is QM_EINVAL naming it. */
int qm_hf_json_string_map(const qm_hf_json *j, const char *key, const char ***names,
                          const char ***values, size_t *n, qm_status *st);

#endif
