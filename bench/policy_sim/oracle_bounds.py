#!/usr/bin/env python3
"""oracle_bounds.py - how much of Belady's lead over an online eviction
policy each kind of knowledge could buy, on a routing trace.

    bench/policy_sim/oracle_bounds.py TRACE.qmtr [...] [--tokens N] [--budgets 0.1,0.5]

policy_sim measures the shipped policies against Belady's MIN. This asks
why they stay where they are: it replays the trace's second half (from a
cold cache, budget = share of all experts, as policy_sim does) through four
victim choices and prints each one's hits as a share of MIN's:

  base        next_use's rank, (until + period/20) / p, with p a per-visit
              decayed frequency (0.99) plus a reuse bump (0.1) for an expert
              its bank's last visit used: a stand-in for the shipped policy
              (within a point of it), with no learning;
  next_visit  base, but told exactly whether each expert is used at its
              bank's next visit (the next token's routing, for the banks
              the current token has passed): the most any predictor of the
              next token could add;
  this_token  base, but told exactly which experts the current token will
              use at the banks it has not reached yet: the most any
              cross-layer predictor (co-occurrence between layers, the
              router of layer l+d on the current hidden state, paths of
              similar tokens) could add to eviction;
  belady      MIN itself.

An expert an oracle says is not used at its next visit is ranked as if its
next use were a full period later. The cache model is policy_sim's minus
waves and pins (every step's experts fit): the experts of the step in
progress are never victims. Python, standard library only; a 1,200-token
Mixtral-shaped trace takes about 15 s per budget. What it shows:
docs/ARCHITECTURE.md, residency/, "What an online policy cannot know".
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import qmoe_trace  # noqa: E402

NEVER = float("inf")
DECAY, BUMP = 0.99, 0.1


def replay(tr, tokens, frac, mode):
    L, E = tr.layers, tr.experts
    T = min(tr.tokens, tokens) if tokens else tr.tokens
    steps = [(l, sorted(set(x for x in tr.row(t, l) if x >= 0)))
             for t in range(T // 2, T) for l in range(L)]
    uses = {}
    for i, (l, s) in enumerate(steps):
        for e in s:
            uses.setdefault((l, e), []).append(i)
    ptr = {}

    def next_use(key, i):  # first step > i that uses key
        u, p = uses.get(key, []), ptr.get(key, 0)
        while p < len(u) and u[p] <= i:
            p += 1
        ptr[key] = p
        return u[p] if p < len(u) else NEVER

    cap = max(tr.k, int(frac * L * E + 0.5))
    resident, count, last_visit, visits = set(), {}, {}, [0] * L
    hits = accesses = 0
    for i, (l, s) in enumerate(steps):
        visits[l] += 1

        def rank(key):
            m = key[0]
            if mode == "belady":
                return next_use(key, i)
            until = (m - l) % L or L  # steps until bank m's next visit
            f = count.get(key, 0.0) * DECAY ** (visits[m] - last_visit.get(key, 0)) * (1 - DECAY)
            p = max(min(f + (BUMP if last_visit.get(key, -1) == visits[m] else 0.0), 1.0), 1e-6)
            told = (mode == "next_visit" or (mode == "this_token" and m > l))
            if told:
                if next_use(key, i) <= i + until:
                    p = 1.0
                else:
                    return until + L / p
            return (until + 0.05 * L) / p

        for e in s:
            key = (l, e)
            accesses += 1
            if key in resident:
                hits += 1
            else:
                if len(resident) >= cap:
                    cands = [c for c in resident if not (c[0] == l and c[1] in s)]
                    resident.discard(max(cands, key=rank))
                resident.add(key)
            if last_visit.get(key, 0) != visits[l]:
                was = count.get(key, 0.0) * DECAY ** (visits[l] - last_visit.get(key, 0))
                count[key] = was + 1.0
                last_visit[key] = visits[l]
    return 100.0 * hits / accesses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--tokens", type=int, default=1200, help="tokens of each trace used (0: all)")
    ap.add_argument("--budgets", default="0.1,0.5", help="shares of all experts")
    a = ap.parse_args(argv)
    modes = ("belady", "base", "next_visit", "this_token")
    print("| trace | budget | belady hit% | base hit% (%MIN) | next_visit oracle (%MIN) | "
          "this_token oracle (%MIN) |\n|---|---|---|---|---|---|")
    for path in a.traces:
        tr = qmoe_trace.read_trace(path)
        for frac in (float(x) for x in a.budgets.split(",")):
            r = {m: replay(tr, a.tokens, frac, m) for m in modes}
            cells = " | ".join("%.1f (%.0f)" % (r[m], 100 * r[m] / r["belady"]) for m in modes[1:])
            print("| %s | %.0f%% | %.1f | %s |" % (os.path.basename(path), 100 * frac, r["belady"],
                                                   cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
