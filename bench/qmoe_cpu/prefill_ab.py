#!/usr/bin/env python3
"""Exact-mode prefill side by side: this build's qmoe_cpu_bench, optionally
another build's (--base-build: the same layer before a change), and
onnxruntime's default path, interleaved round by round in one process so a
shared machine's load hits all of them alike.

    .venv/bin/python bench/qmoe_cpu/prefill_ab.py --build BUILD [--base-build OLD]
        [--case gptoss] [--tokens 512] [--rounds 5] [--threads 2]

Each round: the FMA peak (qmoe_cpu_bench --fma-peak, AVX-512 where the CPU
has it, else AVX2), 2 timed calls of each engine after 1 warm-up (fresh
random inputs and routing per call), the load average. Prints one line per
round, then medians, GFLOP/s, % of the median FMA peak, and the median of
the per-round ratios onnxruntime default / ours. One layer of the case
(run.py's CASES and bank). Not a test."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def main():
    ap = run.ab_parser("gptoss", 5)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    c = dict(run.CASES[args.case], layers=1)
    benches = {"new": os.path.join(args.build, "bench", "qmoe_cpu", "qmoe_cpu_bench")}
    if args.base_build:
        benches["base"] = os.path.join(args.base_build, "bench", "qmoe_cpu", "qmoe_cpu_bench")
    with run.temp_bank("qmoe-prefill-ab-") as bank:
        cfg, tensors = run.make_bank(bank, c, args.seed)
        sessions = run.ort_sessions(cfg, tensors, False, args.threads)
        del tensors
        rng = np.random.default_rng(args.seed)
        ms = {name: [] for name in list(benches) + ["ort"]}
        ratios = {name: [] for name in benches}
        peaks = []
        for rnd in range(args.rounds):
            p = run.fma_peak(benches["new"], args.threads)
            peaks.append(p.get("avx512", p.get("avx2", float("nan"))))
            med = {}
            for name, b in benches.items():
                o = run.time_ours(b, bank, args.tokens, 2, 1, args.threads, args.seed + rnd)
                ms[name] += o["samples_ms"]
                med[name] = o["median_ms"]
            d, load = run.ort_round(sessions, cfg, args.tokens, 2, 1, rng, med, ratios)
            ms["ort"] += d
            print(f"round {rnd}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items())
                  + f", ort default {run.med(d):.1f} ms, FMA peak {peaks[-1]:.1f} GFLOP/s, "
                  f"load {load}", flush=True)
    flop = 2.0 * args.tokens * c["k"] * c["H"] * c["I"] * 3
    peak = run.med(peaks)
    print(f"{args.case} T={args.tokens}, {args.threads} threads, {args.rounds} rounds; "
          f"FMA peak median {peak:.1f} GFLOP/s (min {min(peaks):.1f}, max {max(peaks):.1f})")
    for name, v in ms.items():
        m = run.med(v)
        print(f"{name}: median {m:.1f} ms (min {min(v):.1f}, max {max(v):.1f}), "
              f"{flop / m / 1e6:.1f} GFLOP/s, {100 * flop / m / 1e6 / peak:.0f}% of the FMA peak")
    for name, v in ratios.items():
        print(f"ort default / {name}: {run.med(v):.2f} (per round: "
              + ", ".join(f"{x:.2f}" for x in v) + ")")


if __name__ == "__main__":
    main()
