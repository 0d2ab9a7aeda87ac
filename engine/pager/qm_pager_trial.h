/* qm_pager_trial.h - does prefetch pay on this session? Measured, not
 * assumed.
 *
 * The gates of qm_pager_prefetch.c judge each prediction source by what it
 * predicts (precision) and by how many of its prefetches were used before
 * eviction. Neither says whether prefetching made the session faster: a
 * prefetch that was used still took the disk's time, which under a memory
 * cap is the bound, and one that was not took it for nothing and may have
 * evicted an expert the next token needed. Measured on this project's VMs
 * (llama.cpp + qmoed at 1/3 of the GGUF, 2026-12-04, alternated pairs),
 * prefetch as the gates allowed it cost the Mixtral-8x7B shape a quarter
 * of its decode (1.78-1.91 against 2.35-2.68 tok/s without prefetch, 1.35
 * against 0.87 GB read a token); on the Qwen3-30B-A3B and GPT-OSS-20B
 * shapes the difference stayed within the host's noise.
 *
 * So the trial times the session itself. Once its budget is full (the
 * pager calls it from the first eviction on: until then a prefetch evicts
 * nothing) prefetch is held (predicted and scored as always, nothing read)
 * for two tokens and 32 windows of about two tokens (2 x layers forward
 * calls), about 66 tokens; then, in such windows, it runs prefetch held and
 * prefetch fetched in the order A B B A (a trend weighs on both alike),
 * the first token after each switch left out of the clock (the cache it
 * finds is the other mode's); then keeps the mode whose windows took less
 * wall time per token (held only when that is at least 3% faster) for 32
 * windows, and measures again; each time the answer is the same as the
 * last, it keeps it twice as long (up to 512 windows, about 1000 tokens: a
 * measurement costs the losing mode's windows). Held first because,
 * measured on machine B (2026-12-05, llama.cpp decode, a build starting
 * held against the one starting with A B B A fetched first, in turns),
 * starting held was as fast or faster in every regime tried: next_use at
 * 25% of the Qwen3-30B-A3B shape's bank 1.08x, 50% / 25% of GPT-OSS-20B's
 * 1.07x / 1.07x, under a cgroup cap of half the GPT-OSS GGUF 1.05-1.10x and
 * of a third of the Qwen3 GGUF 1.05-1.11x, of half the Qwen3 GGUF parity:
 * the fetched windows of the first measurement (and of a session too short
 * for one) read for guesses that were wrong as often as right. Wall time between forward calls is what the engine sees: the
 * calls' compute and stalls, and whatever the engine does between them. A
 * call of more than 64 tokens (a prefill) or a pause of over a second
 * between calls drops the open window.
 *
 * The state machine alone, on the times it is given: tested without a
 * pager, and in one (tests/paging/test_paging_edges.c). */
#ifndef QM_PAGER_TRIAL_H
#define QM_PAGER_TRIAL_H

#include <stdint.h>

#define QM__TRIAL_WINDOW_TOKENS 2u   /* a window: this many x layers calls */
#define QM__TRIAL_MIN_WINDOW_CALLS 16u
#define QM__TRIAL_EXPLORE_STEPS 4u   /* windows A B B A, before deciding */
#define QM__TRIAL_START_TOKENS 2u    /* the first tokens it sees, left out */
#define QM__TRIAL_KEEP_WINDOWS 32u   /* the winner's, before measuring again */
#define QM__TRIAL_KEEP_MAX 512u      /* ... doubled while the answer holds, to this */
#define QM__TRIAL_MAX_TOKENS 64u     /* a larger call is a prefill: the window restarts */
#define QM__TRIAL_GAP_US 1000000u    /* a longer pause restarts the window */
#define QM__TRIAL_MARGIN 0.03        /* held wins only when this much faster */

typedef struct qm__pf_trial {
    uint8_t on;        /* the trial runs (else prefetch is never held by it) */
    uint8_t held;      /* prefetch held in this window */
    uint8_t exploring; /* alternating modes; else keeping the winner */
    uint8_t first;     /* exploring: the mode of windows 0 and 3 */
    uint32_t step;     /* exploring: the open window's place in A B B A */
    uint32_t window_calls, settle_calls;
    uint32_t settle;        /* calls left before the window's clock starts */
    uint32_t calls;         /* calls in the open window (0: none open) */
    uint64_t start_us, last_us, tokens;
    uint64_t sum_us[2], sum_tokens[2]; /* exploring: per mode, 0 fetched, 1 held */
    uint32_t windows[2];               /* exploring: per mode, closed */
    uint32_t keep, keep_left; /* windows the winner is kept; left of them */
    uint8_t last_hold;        /* the last decision */
    /* What the last measurement found, ns per token of a layer call, per
     * mode (0: not measured yet); how many measurements held prefetch. */
    uint64_t ns_per_token[2];
    uint64_t decisions, decisions_held;
} qm__pf_trial;

/* on: whether the trial runs; layers: the forward calls a token makes. */
void qm__pf_trial_init(qm__pf_trial *t, int on, uint32_t layers);
/* A forward call of n_tokens ended at now_us: 1 when the prediction it
 * makes for the next calls must not be fetched. */
int qm__pf_trial_call(qm__pf_trial *t, uint32_t n_tokens, uint64_t now_us);

#endif
