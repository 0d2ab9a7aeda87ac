#!/usr/bin/env python3
"""Decode (T = 1) on the same bank with f16 and with f32 scales, side by side:
what the f16 default of `qmoe-bank import` and `create` costs or saves.

    .venv/bin/python bench/qmoe_cpu/scales_ab.py --build BUILD [--case gptoss]
        [--rounds 8] [--iters 10] [--threads 2]

One bank of run.py's case (random codes, f32 scales), and a copy whose scales
are those values rounded to f16 (everything else byte for byte). Each round
times both banks in both precisions with qmoe_cpu_bench (--iters calls after
3 warm-ups, fresh inputs and routing per call, the layers cycled), in
alternating order; the median wall and CPU ms per call over all rounds, the
bytes per call, and the median per-round ratio f32/f16 (above 1: f16 is
faster). Not a test."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import qmoebank  # noqa: E402


def main():
    args = run.ab_parser("gptoss", 8, iters=10).parse_args()
    c = run.CASES[args.case]
    bench = os.path.join(args.build, "bench", "qmoe_cpu", "qmoe_cpu_bench")
    with run.temp_bank("qmoe-scales-ab-32-") as b32, run.temp_bank("qmoe-scales-ab-16-") as b16:
        cfg, tensors = run.make_bank(b32, c, args.seed)
        qmoebank.save_bank(b16, cfg, {k: (a.astype(np.float16) if k.endswith(".scales") else a)
                                      for k, a in tensors.items()})
        del tensors
        sizes = {"f32": os.path.getsize(b32), "f16": os.path.getsize(b16)}
        keys = [(s, p) for p in ("exact", "fast") for s in ("f32", "f16")]
        wall = {k: [] for k in keys}
        cpu = {k: [] for k in keys}
        nbytes = {}
        ratio = {p: [] for p in ("exact", "fast")}
        for rnd in range(args.rounds):
            med = {}
            order = keys if rnd % 2 == 0 else keys[::-1]
            for s, p in order:
                o = run.time_ours(bench, b16 if s == "f16" else b32, 1, args.iters, 3,
                                  args.threads, args.seed + rnd, p)
                nbytes[s] = run.tally(o, (s, p), wall, cpu, med)
            for p in ratio:
                ratio[p].append(med[("f32", p)] / med[("f16", p)])
            print(f"round {rnd}: " + ", ".join(f"{s} {p} {med[(s, p)]:.2f} ms" for s, p in keys)
                  + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"case {args.case}: bank {sizes['f32']} bytes (f32 scales), {sizes['f16']} (f16)")
    for s, p in keys:
        print(f"{s} scales {p:5s}: median {np.median(wall[(s, p)]):.2f} ms wall, "
              f"{np.median(cpu[(s, p)]):.2f} ms CPU per call, {nbytes[s]} bytes per call")
    for p in ratio:
        print(f"{p}: median per-round ratio f32/f16 wall time {np.median(ratio[p]):.3f} "
              f"(rounds {', '.join(f'{r:.2f}' for r in ratio[p])})")


if __name__ == "__main__":
    main()
