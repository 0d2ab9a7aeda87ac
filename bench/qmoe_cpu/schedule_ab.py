#!/usr/bin/env python3
"""The CPU backend's expert schedules side by side, in rounds, on the
fine-grained shapes (issue 23 item 2) and the large-expert ones.

Each round runs, for every case, token count and precision, every variant
(a build directory's qmoe_cpu_bench, with QMOE_CPU_SCHEDULE set or not) in
turn, and measures the 2-thread read bandwidth before and after; the
variants of a row share the round's moments of load. Printed per row: the
medians over rounds of wall ms, CPU ms per call (every thread), the share
of read bandwidth (bytes of the distinct experts the call touched / wall /
the round's read bandwidth) and each variant's wall and CPU time over the
first variant's. With --i8-peak BENCH (a qmoe_cpu_bench whose --fma-peak
and --i8-peak time each thread by its own CPU time, as branch kernels'
does), each round also measures the f32 FMA and the int8 dot peaks with
it, and each row gets its bound: the distinct experts' bytes at the
round's read bandwidth or its arithmetic (6 T k H I operations) at the
precision's peak, whichever takes longer, and the share of it (bound /
wall).

usage: schedule_ab.py --variant NAME=BUILD[:SCHEDULE] ... [--cases qwen3,deepseek]
                      [--tokens 1,16,128] [--precision exact,fast] [--rounds 5]
                      [--iters 20] [--threads 2] [--workdir DIR] [--i8-peak BENCH]

Banks are made with BUILD/tools/qmoe-bank/qmoe-bank create in --workdir
(2 layers each: 0.7-1.0 GB, several times the L3), once. Not a test."""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

# name: (experts, k, hidden, inter); int4, blocks of 32, swiglu interleaved
# (fusion 1), as `qmoe-bank import hf` writes these families.
CASES = {
    "qwen3": (128, 8, 2048, 768),      # Qwen3-30B-A3B
    "deepseek": (64, 6, 2048, 1408),   # DeepSeek-V2-Lite (routed experts)
    "olmoe": (64, 8, 2048, 1024),      # OLMoE-1B-7B
    "gptoss": (32, 4, 2880, 2880),     # GPT-OSS-20B
    "mixtral": (8, 2, 4096, 14336),    # Mixtral-8x7B
}


def make_bank(qmoe_bank, workdir, name):
    e, k, h, i = CASES[name]
    layers = 1 if name == "mixtral" else 2
    path = os.path.join(workdir, f"{name}.bank")
    if not os.path.exists(path):
        subprocess.run([qmoe_bank, "create", "--out", path, "--layers", str(layers),
                        "--experts", str(e), "--hidden", str(h), "--inter", str(i), "--k", str(k),
                        "--bits", "4", "--block-size", "32", "--activation", "swiglu",
                        "--swiglu-fusion", "1", "--seed", "23", "--quiet"], check=True)
    return path


def bench(build, schedule, args):
    env = dict(os.environ)
    env.pop("QMOE_CPU_SCHEDULE", None)
    if schedule:
        env["QMOE_CPU_SCHEDULE"] = schedule
    r = subprocess.run([os.path.join(build, "bench", "qmoe_cpu", "qmoe_cpu_bench")] + args,
                       capture_output=True, text=True, check=True, env=env)
    return [json.loads(line) for line in r.stdout.strip().splitlines()]


def peak(bench_path, flag, key, threads):
    r = subprocess.run([bench_path, flag, "--threads", str(threads)], capture_output=True,
                       text=True, check=True)
    return max(json.loads(line)[key] for line in r.stdout.strip().splitlines())


def bound_ms(case, t, precision, nbytes, bw, fma, i8):
    """The larger of the bytes at the read bandwidth and the arithmetic at
    the precision's peak, in ms, and which one it is."""
    e, k, h, i = CASES[case]
    mem = nbytes / (bw * 1e9) * 1e3
    comp = 6.0 * t * k * h * i / ((i8 if precision == "fast" else fma) * 1e9) * 1e3
    return (mem, "memory") if mem >= comp else (comp, "compute")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--cases", default="qwen3,deepseek")
    ap.add_argument("--tokens", default="1,16,128")
    ap.add_argument("--precision", default="exact,fast")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--i8-peak", default="",
                    help="a qmoe_cpu_bench with --i8-peak (and CPU-timed --fma-peak)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "qmoe-schedule-ab"))
    a = ap.parse_args()
    variants = []
    for v in a.variant:
        name, rest = v.split("=", 1)
        build, _, schedule = rest.partition(":")
        variants.append((name, os.path.abspath(build), schedule))
    os.makedirs(a.workdir, exist_ok=True)
    qmoe_bank = os.path.join(variants[-1][1], "tools", "qmoe-bank", "qmoe-bank")
    cases = a.cases.split(",")
    banks = {c: make_bank(qmoe_bank, a.workdir, c) for c in cases}
    tokens = [int(t) for t in a.tokens.split(",")]
    precisions = a.precision.split(",")
    rows = {}
    bws = []
    peaks = []
    for rnd in range(a.rounds):
        stream = lambda: bench(variants[0][1], "", ["--stream-mib", "1024",
                                                    "--threads", str(a.threads)])[0]
        bw0 = stream()["median_gbps"]
        out = {}
        for c in cases:
            for t in tokens:
                for p in precisions:
                    for name, build, schedule in variants:
                        o = bench(build, schedule, ["--bank", banks[c], "--tokens", str(t),
                                                    "--threads", str(a.threads), "--iters",
                                                    str(a.iters), "--precision", p, "--seed",
                                                    str(100 + rnd)])[-1]
                        out[(c, t, p, name)] = o
        bw = (bw0 + stream()["median_gbps"]) / 2
        bws.append(bw)
        pk = None
        if a.i8_peak:
            pk = (peak(a.i8_peak, "--fma-peak", "median_gflops", a.threads),
                  peak(a.i8_peak, "--i8-peak", "median_gops", a.threads))
            peaks.append(pk)
        print(f"round {rnd}: read bandwidth {bw:.2f} GB/s, load {os.getloadavg()[0]:.1f}"
              + (f", FMA peak {pk[0]:.1f} GFLOP/s, int8 peak {pk[1]:.1f} GOP/s" if pk else ""),
              flush=True)
        for key, o in out.items():
            rows.setdefault(key, []).append((o["median_ms"], o["cpu_ms_median"],
                                             o["bytes_per_call"], bw, pk))
    print(f"\nread bandwidth (2 threads) median {statistics.median(bws):.2f} GB/s over "
          f"{len(bws)} rounds, min {min(bws):.2f}, max {max(bws):.2f}")
    if peaks:
        print(f"FMA peak median {statistics.median(p[0] for p in peaks):.1f} GFLOP/s, int8 peak "
              f"median {statistics.median(p[1] for p in peaks):.1f} GOP/s ({a.threads} threads, "
              "thread CPU time)")
    base = variants[0][0]
    extra = " bound ms | % of bound |" if peaks else ""
    print("| case | T | precision | variant | wall ms | CPU ms | MB/call | % read BW | "
          f"wall / {base} | CPU / {base} |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if peaks else ""))
    for c in cases:
        for t in tokens:
            for p in precisions:
                ref = rows[(c, t, p, base)]
                for name, _, _ in variants:
                    rs = rows[(c, t, p, name)]
                    wall = statistics.median(r[0] for r in rs)
                    cpu = statistics.median(r[1] for r in rs)
                    share = statistics.median(r[2] / (r[0] * 1e-3) / (r[3] * 1e9) for r in rs)
                    rw = statistics.median(r[0] / q[0] for r, q in zip(rs, ref))
                    rc = statistics.median(r[1] / q[1] for r, q in zip(rs, ref))
                    line = (f"| {c} | {t} | {p} | {name} | {wall:.2f} | {cpu:.2f} | "
                            f"{rs[0][2] / 1e6:.1f} | {100 * share:.0f}% | {rw:.2f} | {rc:.2f} |")
                    if peaks:
                        bs = [bound_ms(c, t, p, r[2], r[3], r[4][0], r[4][1]) for r in rs]
                        bmed = statistics.median(b[0] for b in bs)
                        what = max(("memory", "compute"), key=[b[1] for b in bs].count)
                        bshare = statistics.median(b[0] / r[0] for b, r in zip(bs, rs))
                        line += f" {bmed:.1f} ({what}) | {100 * bshare:.0f}% |"
                    print(line)


if __name__ == "__main__":
    main()
