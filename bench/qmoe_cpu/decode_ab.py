#!/usr/bin/env python3
"""Decode (T = 1) side by side: this build's qmoe_cpu_bench in both
precisions, optionally another build's (--base-build: before a change),
onnxruntime's default path and the machine's read bandwidth, interleaved
round by round in one process so a shared machine's load hits all alike.

    .venv/bin/python bench/qmoe_cpu/decode_ab.py --build BUILD [--base-build OLD]
        [--case mixtral] [--rounds 8] [--iters 10] [--threads 2]

Each round: the STREAM-like read (qmoe_cpu_bench --stream-mib 2048), then
per build and precision --iters timed calls after 3 warm-ups (fresh random
inputs and routing per call, the bank's layers cycled: run.py's CASES and
bank), onnxruntime default the same, the load average. Prints one line per
round, then per engine: median wall ms, median process CPU ms per call,
% of the median read bandwidth by wall time, GB/s by CPU time (weight
bytes per call / (CPU time / threads): what the call reads per second of
the threads' own time, the figure a loaded machine moves least; the read
probe is timed by the wall clock, so the two do not divide), and the
median of the per-round ratios onnxruntime default / ours. Not a test."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def main():
    args = run.ab_parser("mixtral", 8, iters=10).parse_args()
    c = run.CASES[args.case]
    builds = {"new": args.build}
    if args.base_build:
        builds["base"] = args.base_build
    benches = {f"{b} {p}": (os.path.join(d, "bench", "qmoe_cpu", "qmoe_cpu_bench"), p)
               for b, d in builds.items() for p in ("exact", "fast")}
    wall = {k: [] for k in list(benches) + ["ort"]}
    cpu = {k: [] for k in benches}
    ratios = {k: [] for k in benches}
    bw, nbytes = [], 0
    with run.temp_bank("qmoe-decode-ab-") as bank:
        cfg, tensors = run.make_bank(bank, c, args.seed)
        sessions = run.ort_sessions(cfg, tensors, False, args.threads)
        del tensors
        rng = np.random.default_rng(args.seed)
        for rnd in range(args.rounds):
            bw.append(run.stream(benches["new exact"][0], args.threads, 2048)["median_gbps"])
            med = {}
            for name, (b, prec) in benches.items():
                o = run.time_ours(b, bank, 1, args.iters, 3, args.threads, args.seed + rnd, prec)
                nbytes = run.tally(o, name, wall, cpu, med)
            d, load = run.ort_round(sessions, cfg, 1, args.iters, 2, rng, med, ratios)
            wall["ort"] += d
            print(f"round {rnd}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f", ort default {run.med(d):.1f} ms; read {bw[-1]:.2f} GB/s; load {load}",
                  flush=True)
    b = run.med(bw)
    print(f"{args.case} T=1, {args.threads} threads, {args.rounds} rounds x {args.iters} calls; "
          f"{nbytes / 1e6:.1f} MB of weights per call; read bandwidth median {b:.2f} GB/s "
          f"(min {min(bw):.2f}, max {max(bw):.2f})")
    for name, v in wall.items():
        m = run.med(v)
        line = (f"{name}: wall median {m:.2f} ms (min {min(v):.2f}, max {max(v):.2f}), "
                f"{100 * nbytes / m / 1e6 / b:.0f}% of read BW")
        if name in cpu:
            cm = run.med(cpu[name])
            line += (f"; CPU {cm:.2f} ms per call, {nbytes / (cm / args.threads) / 1e6:.1f}"
                     f" GB/s per thread-second; ort default / ours {run.med(ratios[name]):.2f}"
                     " (per round " + ", ".join(f"{x:.2f}" for x in ratios[name]) + ")")
        print(line)


if __name__ == "__main__":
    main()
