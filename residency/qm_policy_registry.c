/* qm_policy_registry.c - the one list of residency policies. It feeds
 * qm_policy_new, the names the daemon offers, the wire decoder's and the
 * daemon's parameter checks and the help texts; each policy declares its own
 * parameters (qm_policy_impl.h) and the checks here read those tables. */
#include "qm_residency.h"
#include "qm_policy_impl.h"
#include "qm_residency_impl.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Each policy's descriptor, defined in its own file. */
extern const qm__policy_desc qm__policy_whole_bank_desc;
extern const qm__policy_desc qm__policy_static_hot_desc;
extern const qm__policy_desc qm__policy_lru_desc;
extern const qm__policy_desc qm__policy_lfu_desc;
extern const qm__policy_desc qm__policy_arc_desc;
extern const qm__policy_desc qm__policy_layered_lru_desc;
extern const qm__policy_desc qm__policy_next_use_desc;
extern const qm__policy_desc qm__policy_belady_desc;

/* Order is the order policies are listed in (help, error messages). */
static const qm__policy_desc *const registry[] = {
    &qm__policy_whole_bank_desc, &qm__policy_static_hot_desc, &qm__policy_lru_desc,
    &qm__policy_lfu_desc,        &qm__policy_arc_desc,        &qm__policy_layered_lru_desc,
    &qm__policy_next_use_desc,   &qm__policy_belady_desc,
};
#define N_POLICIES (sizeof registry / sizeof registry[0])

/* The first row is the policy of a session that names none. */
const char *qm_policy_default_name(void) { return registry[0]->iface->name; }

static const qm__policy_desc *find(const char *name)
{
    for (size_t i = 0; i < N_POLICIES; i++)
        if (!strcmp(registry[i]->iface->name, name)) return registry[i];
    return NULL;
}

size_t qm_policy_names(char *buf, size_t cap)
{
    size_t len = 0;
    if (cap) buf[0] = '\0';
    for (size_t i = 0; i < N_POLICIES; i++) {
        if (!registry[i]->offered) continue;
        int n = snprintf(len < cap ? buf + len : NULL, len < cap ? cap - len : 0, "%s%s",
                         len ? ", " : "", registry[i]->iface->name);
        len += n > 0 ? (size_t)n : 0;
    }
    return len;
}

size_t qm_policy_count(void) { return N_POLICIES; }
const char *qm_policy_name_at(size_t i)
{
    return i < N_POLICIES ? registry[i]->iface->name : NULL;
}
const char *qm_policy_summary_at(size_t i) { return i < N_POLICIES ? registry[i]->summary : NULL; }
int qm_policy_offered_at(size_t i) { return i < N_POLICIES && registry[i]->offered; }
size_t qm_policy_param_count(size_t i) { return i < N_POLICIES ? registry[i]->n_params : 0; }

const qm_policy_param_spec *qm_policy_param_at(size_t i, size_t j)
{
    return i < N_POLICIES && j < registry[i]->n_params ? &registry[i]->params[j] : NULL;
}

const char *qm_policy_param_name(const qm_policy_param_spec *spec)
{
    return spec ? spec->name : NULL;
}

void qm_policy_param_range(const qm_policy_param_spec *spec, double *min, double *max, double *def,
                           int *integer)
{
    if (min) *min = spec->min;
    if (max) *max = spec->max;
    if (def) *def = spec->def;
    if (integer) *integer = spec->integer;
}

const qm_policy_param_spec *qm_policy_param_find(const char *name, size_t n)
{
    for (size_t i = 0; i < N_POLICIES; i++) {
        if (!registry[i]->offered) continue;
        for (size_t j = 0; j < registry[i]->n_params; j++) {
            const char *p = registry[i]->params[j].name;
            if (strlen(p) == n && !memcmp(p, name, n)) return &registry[i]->params[j];
        }
    }
    return NULL;
}

int qm_policy_accepts_prior(const char *name)
{
    const qm__policy_desc *d = find(name ? name : qm_policy_default_name());
    return d && d->accepts_prior;
}

int qm_policy_accepts_hot(const char *name)
{
    const qm__policy_desc *d = find(name ? name : qm_policy_default_name());
    return d && d->accepts_hot;
}

static const qm_policy_param_spec *spec_of(const qm__policy_desc *d, const char *name)
{
    for (size_t j = 0; j < d->n_params; j++)
        if (!strcmp(d->params[j].name, name)) return &d->params[j];
    return NULL;
}

/* "policy lfu" or "policies lfu, lecar": who accepts knob `name` (or "hot", "prior"). */
static void accepted_by(const char *name, char *buf, size_t cap)
{
    size_t n = 0, len = 0;
    char list[160] = "";
    for (size_t i = 0; i < N_POLICIES; i++) {
        if (!registry[i]->offered) continue;
        int takes = !strcmp(name, "hot")     ? registry[i]->accepts_hot
                    : !strcmp(name, "prior") ? registry[i]->accepts_prior
                                         : spec_of(registry[i], name) != NULL;
        if (!takes) continue;
        int w = snprintf(list + len, sizeof list - len, "%s%s", n ? ", " : "",
                         registry[i]->iface->name);
        if (w > 0 && (size_t)w < sizeof list - len) len += (size_t)w;
        n++;
    }
    snprintf(buf, cap, "%s %s", n == 1 ? "policy" : "policies", n ? list : "(none)");
}

/* The policy's own table decides: known knob, number in range, whole when
 * declared integer. Field names match the wire ("policy_params.<name>"). */
static int check_params(const qm__policy_desc *d, const qm_policy_params *p, qm_status *st)
{
    if (p->version != QM_POLICY_PARAMS_VERSION)
        return qm_status_set_field(st, QM_EINVAL, "policy_params",
                                   "policy parameters version %d, expected %d", p->version,
                                   QM_POLICY_PARAMS_VERSION);
    if (p->n_values && !p->values)
        return qm_status_set_field(st, QM_EINVAL, "policy_params", "%zu values but no array",
                                   p->n_values);
    char field[96], who[200];
    for (size_t i = 0; i < p->n_values; i++) {
        const char *name = p->values[i].name ? p->values[i].name : "(null)";
        snprintf(field, sizeof field, "policy_params.%.64s", name);
        const qm_policy_param_spec *s = spec_of(d, name);
        if (!s) {
            accepted_by(name, who, sizeof who);
            return qm_status_set_field(st, QM_EINVAL, field, "%s applies to %s only", field, who);
        }
        for (size_t j = 0; j < i; j++)
            if (p->values[j].name && !strcmp(p->values[j].name, name))
                return qm_status_set_field(st, QM_EINVAL, field, "%s is given twice", field);
        double v = p->values[i].value;
        if (!(v >= s->min && v <= s->max)) /* also rejects NaN */
            return qm_status_set_field(st, QM_EINVAL, field, "%s %g is outside [%g, %g]", name, v,
                                       s->min, s->max);
        if (s->integer && v != floor(v))
            return qm_status_set_field(st, QM_EINVAL, field, "%s %g is not a whole number", name,
                                       v);
    }
    if (p->hot && !d->accepts_hot) {
        accepted_by("hot", who, sizeof who);
        return qm_status_set_field(st, QM_EINVAL, "policy_params.hot",
                                   "policy_params.hot applies to %s only", who);
    }
    if (p->prior && !d->accepts_prior) {
        accepted_by("prior", who, sizeof who);
        return qm_status_set_field(st, QM_EINVAL, "policy_params.prior",
                                   "policy_params.prior applies to %s only", who);
    }
    if (p->prior && !p->prior_len)
        return qm_status_set_field(st, QM_EINVAL, "policy_params.prior",
                                   "policy_params.prior needs prior_len");
    for (size_t b = 0; p->prior && b < p->n_prior_banks; b++)
        for (size_t e = 0; p->prior[b] && e < p->prior_len[b]; e++)
            if (!(p->prior[b][e] >= 0.0 && p->prior[b][e] <= 1.0)) /* also rejects NaN */
                return qm_status_set_field(st, QM_EINVAL, "policy_params.prior",
                                           "policy_params.prior of layer %zu expert %zu is %g, "
                                           "outside [0, 1]",
                                           b, e, p->prior[b][e]);
    return 0;
}

int qm_policy_params_check(const char *name, const qm_policy_params *params, qm_status *st)
{
    const qm__policy_desc *d = find(name ? name : qm_policy_default_name());
    if (!d || !d->offered) {
        char names[256];
        qm_policy_names(names, sizeof names);
        return qm_status_set_field(st, QM_EINVAL, "policy",
                                   "policy '%.64s' is not supported; supported: %s", name, names);
    }
    return params ? check_params(d, params, st) : 0;
}

double qm__policy_param_in(const qm_policy_params *params, const qm_policy_param_spec *specs,
                           size_t n, const char *name)
{
    for (size_t i = 0; i < params->n_values; i++)
        if (!strcmp(params->values[i].name, name)) return params->values[i].value;
    for (size_t j = 0; j < n; j++)
        if (!strcmp(specs[j].name, name)) return specs[j].def;
    return NAN;
}

int qm_policy_new(const char *name, const qm_policy_params *params, qm_policy *out, qm_status *st)
{
    if (!out) return qm_status_set(st, QM_EINVAL, "no policy to fill");
    out->iface = NULL;
    out->ctx = NULL;
    const qm__policy_desc *d = find(name ? name : qm_policy_default_name());
    char names[256];
    if (!d) {
        qm_policy_names(names, sizeof names);
        return qm_status_set_field(st, QM_EINVAL, "policy",
                                   "unknown policy '%.64s'; expected one of: %s", name, names);
    }
    if (d->refusal) {
        qm_policy_names(names, sizeof names);
        return qm_status_set_field(st, QM_EINVAL, "policy", "policy '%s' %s; expected one of: %s",
                                   d->iface->name, d->refusal, names);
    }
    static const qm_policy_params defaults = {.version = QM_POLICY_PARAMS_VERSION};
    if (!params) params = &defaults;
    int rc = check_params(d, params, st);
    if (rc < 0) return rc;
    if (d->create) return d->create(params, out, st);
    if (d->ctx_size == 0) {
        out->iface = d->iface;
        return 0;
    }
    return qm__policy_alloc(d->iface, d->ctx_size, out, st) ? 0 : QM_ENOMEM;
}
