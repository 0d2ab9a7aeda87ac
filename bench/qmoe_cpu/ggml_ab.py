#!/usr/bin/env python3
"""qmoed's fast decode against llama.cpp's repacked Q4_0, side by side.

    .venv/bin/python bench/qmoe_cpu/ggml_ab.py --build BUILD --ggml GGML/ggml_moe_bench
        [--cases qwen3,gptoss] [--tokens 1,16] [--rounds 6] [--threads 2] [--iters 20]

For each case of run.py's CASES (its random bank) and token count, in
rounds: qmoe_cpu_bench --precision fast --r8 1 (a whole-bank pager in the
r8 layout, as a fast daemon session runs on the CPU) and ggml_moe_bench
--type q4_0 --repack 1 (ggml's MUL_MAT_ID on the CPU_REPACK buffer, what
llama.cpp runs on x86; fresh expert ids each call), then the STREAM-like
read of qmoe_cpu_bench. Without onnxruntime, so a round takes seconds.
Prints per case and T: medians (ms), the median of the per-round ratios
ggml / qmoed (> 1: qmoed faster), the fastest single call of each (on a
shared machine the one least disturbed; ggml's thread pool spins, so a
loaded machine stretches its medians most), and qmoed's share of the read
bandwidth (its bank's bytes per call / median / read). Our bank's scales are f16 by
default (--scales: what an import of a GGUF Q4_0 holds, so both read the
same bytes; run.py's banks have f32 scales, 11% more bytes than ggml's
Q4_0). Not a test."""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--ggml", required=True, help="ggml_moe_bench (bench/qmoe_cpu/ggml/build.sh)")
    ap.add_argument("--cases", default="qwen3,gptoss")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scales", choices=("f16", "f32"), default="f16",
                    help="our bank's scale dtype (f16: a GGUF Q4_0 import's, ggml's bytes)")
    args = ap.parse_args()
    bench = os.path.join(args.build, "bench", "qmoe_cpu", "qmoe_cpu_bench")
    model, flags = run.cpu_text()
    print(f"# CPU: {model}; flags: {' '.join(flags)}; {args.threads} threads", flush=True)
    rows = []
    for name in args.cases.split(","):
        c = run.CASES[name]
        with run.temp_bank(f"qmoe-ggml-ab-{name}-") as bank:
            run.make_bank(bank, c, args.seed,
                          np.float16 if args.scales == "f16" else np.float32)
            for t in (int(x) for x in args.tokens.split(",")):
                ours, theirs, ratios, bw, nbytes, kernels = [], [], [], [], 0, ""
                for rnd in range(args.rounds):
                    o = run.time_ours(bench, bank, t, args.iters, 3, args.threads,
                                      args.seed + rnd, "fast")
                    g = run.time_ggml(args.ggml, c, "q4_0", t, args.iters, 3, args.threads,
                                      args.seed + rnd, repack=True)
                    bw.append(run.stream(bench, args.threads, 2048)["median_gbps"])
                    ours += o["samples_ms"]
                    theirs += g["samples_ms"]
                    ratios.append(run.med(g["samples_ms"]) / o["median_ms"])
                    nbytes, kernels = o["bytes_per_call"], o["backend"]
                    print(f"{name} T={t} round {rnd}: qmoed fast {o['median_ms']:.2f} ms, ggml "
                          f"q4_0 repacked {run.med(g['samples_ms']):.2f} ms, read {bw[-1]:.2f} "
                          f"GB/s", flush=True)
                m = run.med(ours)
                rows.append((name, t, m, run.med(theirs), run.med(ratios), min(ratios), max(ratios),
                             100 * nbytes / (m * 1e-3) / 1e9 / run.med(bw), run.med(bw), kernels,
                             min(ours), min(theirs)))
    print("\n| case | T | qmoed fast ms | ggml Q4_0 repacked ms | ggml / qmoed (min-max) | "
          "fastest call: qmoed, ggml, ggml / qmoed | qmoed % read BW | read GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f}x ({r[5]:.2f}-{r[6]:.2f}) "
              f"| {r[10]:.2f}, {r[11]:.2f}, {r[11] / r[10]:.2f}x | {r[7]:.0f}% | {r[8]:.2f} |")
    print(f"\nqmoed kernels: {rows[-1][9] if rows else '?'}")


if __name__ == "__main__":
    main()
