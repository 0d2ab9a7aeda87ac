/* qm_pager_trial.c - does prefetch pay on this session: see qm_pager_trial.h. */
#include "qm_pager_trial.h"

#include <string.h>

void qm__pf_trial_init(qm__pf_trial *t, int on, uint32_t layers)
{
    memset(t, 0, sizeof *t);
    t->on = on ? 1 : 0;
    if (layers == 0)
        layers = 1;
    if (layers > 1u << 20)
        layers = 1u << 20;
    uint32_t w = QM__TRIAL_WINDOW_TOKENS * layers;
    t->window_calls = w < QM__TRIAL_MIN_WINDOW_CALLS ? QM__TRIAL_MIN_WINDOW_CALLS : w;
    t->settle_calls = layers;
    t->settle = QM__TRIAL_START_TOKENS * layers; /* the budget just filled */
    /* Prefetch starts held, kept as a decision is (QM__TRIAL_KEEP_WINDOWS),
     * and is then measured: a read has to show that it pays. */
    if (t->on) {
        t->held = 1;
        t->last_hold = 1;
        t->keep = t->keep_left = QM__TRIAL_KEEP_WINDOWS;
    }
}

/* The mode of exploring window `step`: A B B A from `first`, so that a
 * trend (a cache still filling) weighs on both modes alike. */
static int explore_mode(const qm__pf_trial *t, uint32_t step)
{
    return t->first ^ (step == 1 || step == 2);
}

/* From the next call on, mode `held`. A switch lets a token's calls pass
 * before the clock starts again (the cache they find is the other mode's);
 * the same mode goes on with a new window from this call. */
static void trial_enter(qm__pf_trial *t, int held, uint64_t now_us)
{
    if (held != t->held) {
        t->held = (uint8_t)held;
        t->settle = t->settle_calls;
        t->calls = 0;
        return;
    }
    t->calls = 1;
    t->start_us = now_us;
    t->tokens = 0;
}

/* Both modes measured: the faster one is kept (held only when it is
 * QM__TRIAL_MARGIN faster: fetching is the default). */
static void trial_decide(qm__pf_trial *t, uint64_t now_us)
{
    for (int m = 0; m < 2; m++)
        t->ns_per_token[m] = t->sum_tokens[m] ? t->sum_us[m] * 1000u / t->sum_tokens[m] : 0;
    int hold = t->sum_tokens[0] && t->sum_tokens[1] &&
               (double)t->ns_per_token[1] < (double)t->ns_per_token[0] * (1.0 - QM__TRIAL_MARGIN);
    /* The same answer again: measured half as often (a measurement costs
     * the losing mode's windows), down to one in QM__TRIAL_KEEP_MAX. */
    if (t->decisions && hold == t->last_hold)
        t->keep = t->keep * 2 > QM__TRIAL_KEEP_MAX ? QM__TRIAL_KEEP_MAX : t->keep * 2;
    else
        t->keep = QM__TRIAL_KEEP_WINDOWS;
    t->last_hold = (uint8_t)hold;
    t->decisions++;
    t->decisions_held += (uint64_t)hold;
    t->exploring = 0;
    t->keep_left = t->keep;
    trial_enter(t, hold, now_us);
}

/* The open window is complete at now_us. */
static void trial_close(qm__pf_trial *t, uint64_t now_us)
{
    int m = t->held;
    if (t->exploring) {
        t->sum_us[m] += now_us - t->start_us;
        t->sum_tokens[m] += t->tokens;
        t->windows[m]++;
        if (++t->step == QM__TRIAL_EXPLORE_STEPS)
            trial_decide(t, now_us);
        else
            trial_enter(t, explore_mode(t, t->step), now_us);
        return;
    }
    if (--t->keep_left > 0) {
        trial_enter(t, m, now_us);
        return;
    }
    /* Measure again, from the mode kept: A B B A switches twice. */
    memset(t->sum_us, 0, sizeof t->sum_us);
    memset(t->sum_tokens, 0, sizeof t->sum_tokens);
    memset(t->windows, 0, sizeof t->windows);
    t->exploring = 1;
    t->step = 0;
    t->first = (uint8_t)m;
    trial_enter(t, m, now_us);
}

int qm__pf_trial_call(qm__pf_trial *t, uint32_t n_tokens, uint64_t now_us)
{
    if (!t->on)
        return 0;
    int prefill = n_tokens > QM__TRIAL_MAX_TOKENS;
    int paused = t->last_us && (now_us < t->last_us || now_us - t->last_us > QM__TRIAL_GAP_US);
    t->last_us = now_us;
    if (prefill || paused)
        t->calls = 0; /* the open window is dropped */
    if (prefill)
        return t->held;
    if (t->settle) {
        t->settle--;
        return t->held;
    }
    if (t->calls == 0) {
        t->calls = 1;
        t->start_us = now_us;
        t->tokens = 0;
        return t->held;
    }
    t->tokens += n_tokens;
    if (++t->calls > t->window_calls)
        trial_close(t, now_us);
    return t->held;
}
