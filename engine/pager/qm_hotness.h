/* qm_hotness.h - the hotness profile of a model: decayed use counts per
 * (layer, expert), kept by the daemon across sessions, persisted atomically
 * in the state dir, and turned into hottest-first lists for `static_hot`.
 *
 * Not thread-safe: the owner (the daemon's model entry) serialises calls. */
#ifndef QM_HOTNESS_H
#define QM_HOTNESS_H

#include <stddef.h>
#include <stdint.h>

#include "qm_bank.h"
#include "qm_error.h"
#include "qm_residency.h"

typedef struct qm_hotness qm_hotness;

#define QM_HOTNESS_DEFAULT_DECAY 0.999

/* What a profile belongs to. A saved profile whose key differs is ignored
 * at load. `fingerprint`: qm_hotness_fingerprint of the bank (0 = unchecked). */
typedef struct qm_hotness_key {
    uint32_t layers;
    uint32_t experts;
    uint64_t fingerprint;
} qm_hotness_key;

/* Key of an open bank: shape + a hash of its config and file size. */
void qm_hotness_key_of_bank(const qm_bank *bank, qm_hotness_key *out);

/* New empty profile. `decay` in (0, 1]: each record() of a layer multiplies
 * that layer's counts by decay before adding, so popularity fades with use of
 * the layer, not with wall-clock time. Out of range -> QM_EINVAL. */
int qm_hotness_new(const qm_hotness_key *key, double decay, qm_hotness **out, qm_status *st);
void qm_hotness_free(qm_hotness *h); /* accepts NULL */

/* Records one request of `layer`: every expert in route[0..n) (entries
 * >= experts, e.g. QM_ROUTE_DROPPED, are skipped; repeats count once per
 * request). Unknown layers are ignored. */
void qm_hotness_record(qm_hotness *h, uint32_t layer, const uint32_t *route, size_t n);
double qm_hotness_count(const qm_hotness *h, uint32_t layer, uint32_t expert);
uint64_t qm_hotness_records(const qm_hotness *h); /* record() calls so far (incl. loaded) */

/* Hottest-first experts of `layer` with a count > 0 (ties: lower index
 * first). Writes up to `cap`; returns how many there are (or negative). */
int qm_hotness_hottest(const qm_hotness *h, uint32_t layer, uint32_t *out, size_t cap);

/* Every expert with a count > 0, of every layer, hottest first across
 * layers (by count; ties to the lower layer, then the lower expert): up to
 * `cap` of them as (layers[i], experts[i]). Returns how many there are in
 * all (>= 0), or QM_EINVAL, or QM_ENOMEM. What warm_from_profile loads
 * into a new session, and policy_sim --warm models. */
long qm_hotness_hottest_all(const qm_hotness *h, uint32_t *layers, uint32_t *experts,
                            size_t cap);

/* Fills `params->hot`, `hot_len`, `n_hot_banks` with hottest-first lists of
 * every layer, for qm_policy_new("static_hot", params). The arrays belong to
 * the profile and stay valid until its next record/load/free. Other fields of
 * `params` are left alone. */
int qm_hotness_policy_params(qm_hotness *h, qm_policy_params *params, qm_status *st);

/* Fills `params->prior`, `prior_len`, `n_prior_banks` with each layer's
 * per-visit frequencies (an expert's decayed count over what one use a
 * record would have summed, in [0, 1]; a layer with none: NULL) and
 * `prior_visits` with what a layer's records weigh (as many, decayed: the
 * prior never counts for more), for a policy that takes a prior
 * (qm_policy_accepts_prior: next_use). The arrays
 * belong to the profile and stay valid until its next record/load/free;
 * other fields of `params` are left alone. */
int qm_hotness_policy_prior(qm_hotness *h, qm_policy_params *params, qm_status *st);

/* Saves atomically: writes `path`.tmp.<pid>, fsyncs it, renames it over
 * `path`, fsyncs the directory. On failure `path` is untouched. */
int qm_hotness_save(const qm_hotness *h, const char *path, qm_status *st);

/* Loads `path` for `key`. Always gives a profile in *out unless memory runs
 * out (QM_ENOMEM): a missing file gives an empty profile silently; a corrupt,
 * truncated or mismatched file gives an empty profile and one sentence in
 * `warning` (cleared otherwise). `warning` may be NULL. */
int qm_hotness_load(const char *path, const qm_hotness_key *key, double decay, qm_hotness **out,
                    char *warning, size_t warning_cap, qm_status *st);

#endif
