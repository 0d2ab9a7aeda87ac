#!/usr/bin/env python3
"""Each fast decode kernel's share of one core's read bandwidth, from memory.

    .venv/bin/python bench/qmoe_cpu/decode_share.py --build BUILD [--base-build OLD]
        [--runs 8] [--rows 131072] [--cols 2048] [--inputs 1] [--reps 3]

Runs qmoe_kernel_micro (this build's, and --base-build's in alternation)
on a 4-bit matrix far larger than the caches (default 131072 x 2048: 128
MiB of codes and 32 MiB of f32 scales), one thread, --runs times. Each run
times every fast kernel of the fast table as it serves (NAME), its GEMV
path, and on the same codes in the r8 layout (NAME-r8), and a plain read
of the same bytes before and after (the "read" lines), all by thread CPU
time, so a shared machine's time-slicing cancels; each kernel's share is
its codes-and-scales GB/s over the mean of its run's two read lines. Prints
a Markdown table: per build and kernel, the median share and GB/s over the
runs (and their range). Not a test."""

import argparse
import json
import os
import statistics
import subprocess


def one_run(build, args):
    micro = os.path.join(build, "bench", "qmoe_cpu", "qmoe_kernel_micro")
    out = subprocess.run([micro, "--rows", str(args.rows), "--cols", str(args.cols), "--bits", "4",
                          "--inputs", str(args.inputs), "--reps", str(args.reps)],
                         capture_output=True, text=True, check=True).stdout
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    reads = [o["read_gbps_per_core"] for o in lines if o.get("mode") == "read"]
    read = sum(reads) / len(reads)
    return read, {o["kernel"]: o["read_gbps_per_core"] for o in lines
                  if o.get("mode") == "fast" and "read_gbps_per_core" in o
                  and o["kernel"] != "scalar" and not o["kernel"].endswith("-gemm")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--base-build")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--inputs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    builds = {"new": args.build}
    if args.base_build:
        builds["base"] = args.base_build
    share, gbps, read = {}, {}, []
    for r in range(args.runs):
        for name, build in builds.items():
            rd, ks = one_run(build, args)
            read.append(rd)
            for k, v in ks.items():
                share.setdefault((name, k), []).append(v / rd)
                gbps.setdefault((name, k), []).append(v)
        print(f"run {r}: read {read[-1]:.2f} GB/s per core", flush=True)
    mib = args.rows * args.cols / 2 / 2**20
    print(f"\n{args.rows} x {args.cols} 4-bit ({mib:.0f} MiB of codes), {args.inputs} input(s), "
          f"one thread, {args.runs} runs; plain read median {statistics.median(read):.2f} GB/s "
          f"per core (min {min(read):.2f}, max {max(read):.2f})\n")
    print("| build | kernel | share of the read (median, min-max) | GB/s per core (median) |")
    print("|---|---|---|---|")
    for (b, k), v in sorted(share.items()):
        print(f"| {b} | {k} | {100 * statistics.median(v):.0f}% ({100 * min(v):.0f}-"
              f"{100 * max(v):.0f}%) | {statistics.median(gbps[(b, k)]):.2f} |")


if __name__ == "__main__":
    main()
