#!/usr/bin/env python3
"""bench/qmoe_cpu/kernel_ab.py - one fast kernel of two builds side by side on one matrix.

    python3 bench/qmoe_cpu/kernel_ab.py --base BASE_BUILD --build BUILD [--rounds 5] [--kernel avx2]

Alternates the two builds' qmoe_kernel_micro (512 x 2880, blocks of 32,
thread CPU time, best of 10 per run) over (bits, inputs) in rounds and
prints, per shape, the best time of each build and the ratio, as a
Markdown table. Not a test.
"""
import argparse
import json
import os
import subprocess

CASES = [(4, 1), (4, 4), (4, 16), (4, 64), (4, 256), (8, 1), (8, 64)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernel", default="avx2")
    args = ap.parse_args()
    bins = {b: os.path.join(d, "bench", "qmoe_cpu", "qmoe_kernel_micro")
            for b, d in (("base", args.base), ("new", args.build))}
    best = {}
    for _ in range(args.rounds):
        for bits, nx in CASES:
            for name, b in bins.items():
                out = subprocess.run([b, "--bits", str(bits), "--inputs", str(nx), "--reps", "10"],
                                     capture_output=True, text=True, check=True).stdout
                for line in out.splitlines():
                    o = json.loads(line)
                    if o.get("mode") == "fast" and o.get("kernel") == args.kernel and "best_us" in o:
                        key = (name, bits, nx)
                        best[key] = min(best.get(key, 1e30), o["best_us"])
    print("| bits | inputs | base us | build us | speed-up | weight GB/s per core | GOP/s per core |")
    print("|---|---|---|---|---|---|---|")
    for bits, nx in CASES:
        b, n = best[("base", bits, nx)], best[("new", bits, nx)]
        w = 512 * 2880 * bits / 8
        print(f"| {bits} | {nx} | {b:.1f} | {n:.1f} | {b / n:.2f}x | {w / n / 1e3:.2f} "
              f"| {2 * 512 * 2880 * nx / n / 1e3:.1f} |")


if __name__ == "__main__":
    main()
