#!/usr/bin/env python3
"""bench/paging_disk/io_bench.py - paged CPU decode against the disk's bound, in one run.

    python3 bench/paging_disk/io_bench.py BUILD_DIR [--bank FILE | --layers N --dir DIR]
        [--tokens 48] [--warm 8] [--reps 3] [--budgets 0.5,0.25] [--policy next_use]
        [--precision fast] [--io-depth 32] [--threads 2] [--old] [--trial-ab]
        [--fio-seconds 8] [--trace FILE] [--json OUT]

1. The disk, with fio on the bank file itself (O_DIRECT, read only, 2 MiB
   reads): random at queue depth 1, random at the queue depth qmoed uses
   (--io-depth), sequential at that depth. Without fio the rows' I/O bound
   uses the rate the pager measured while its reads were in flight.
2. Decode (T = 1 layer calls, one per layer per token, a synthetic decode
   trace or --trace) with bench/paging_disk's paging_from_disk, each row in a
   fresh process after the bank left the page cache: `resident` (a
   whole_bank session: every bank in memory before the first call), then per
   budget `direct` (the policy at that share of the bank's expert bytes,
   misses read with O_DIRECT through io_uring, or the pool where the kernel
   refuses it) and, with --old, `direct-old` (the engine before: one read at
   a time, a call waiting for all of its misses). The rows alternate, --reps
   times, since a shared machine's load moves tokens/s between runs; the
   table shows medians.

Per row: decode tokens/s and layer calls/s, x resident, hit rate, MiB read
per token, stall ms per token, reads in flight (mean of each call's most /
the most), the I/O time per token (misses x expert bytes / the disk's random
rate at qmoed's depth) and the bounds it sets: I/O alone (1 / I/O time) and
overlapped with compute (min of that and resident), and the share of the
overlapped bound the row reached; disk busy: every byte the pager read per
token (prefetches too) x tokens/s / that rate, how much of the disk the
row used; with --old, new/old per budget; with --trial-ab, a
`direct-notrial` row per budget (the prefetch trial off,
engine/pager/qm_pager_trial.h) and trial on/off.

Without --bank a Qwen3-30B-A3B-shaped bank (128 experts, top-8, H 2048,
I 768, int4 blocks of 32, f16 scales) of --layers layers (default 4, about
1.3 GB) is made in --dir (default /var/tmp; its filesystem must take
O_DIRECT) and kept for the next run.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys


def sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def make_bank(build, layers, d):
    path = os.path.join(d, "qwen3like-L%d.bank" % layers)
    if os.path.exists(path):
        return path
    tool = os.path.join(build, "tools", "qmoe-bank", "qmoe-bank")
    print("# making %s (%d layers) ..." % (path, layers), file=sys.stderr)
    p = sh([tool, "create", "--out", path, "--layers", str(layers), "--experts", "128",
            "--hidden", "2048", "--inter", "768", "--k", "8", "--bits", "4", "--block-size", "32",
            "--activation", "swiglu", "--router", "--no-bias", "--quiet"])
    if p.returncode:
        sys.exit("io_bench: qmoe-bank create failed: %s" % p.stderr)
    return path


def fio(path, name, rw, depth, seconds, block="2M"):
    """fio's read rate (bytes/s) of one job on the bank file, and the engine
    that ran it, or None; `block` bytes per read (bench/e2e/capped_sweep.py
    reads one expert unit)."""
    if not shutil.which("fio"):
        return None
    for engine in ("io_uring", "libaio", "psync"):
        p = sh(["fio", "--name=" + name, "--filename=" + path, "--readonly", "--direct=1",
                "--rw=" + rw, "--bs=%s" % block, "--iodepth=%d" % depth, "--ioengine=" + engine,
                "--runtime=%d" % seconds, "--time_based", "--output-format=json",
                "--invalidate=1"])
        if p.returncode == 0:
            try:
                job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
                return job["read"]["bw_bytes"], engine
            except (ValueError, KeyError, IndexError):
                pass
    return None


def run_row(binary, bank, row, a):
    args = [binary, "--bank", bank, "--tokens", str(a.tokens), "--warm", str(a.warm),
            "--threads", str(a.threads), "--precision", a.precision, "--mode", row["mode"]]
    if row["mode"] == "direct":
        args += ["--policy", a.policy, "--budget", str(row["budget"]), "--io", row["io"],
                 "--io-depth", str(1 if row["io"] == "serial" else a.io_depth),
                 "--prefetch-trial", row.get("trial", "auto")]
    if a.trace:
        args += ["--trace", a.trace]
    p = sh(args, timeout=3600)
    if p.returncode:
        sys.exit("io_bench: %s failed:\n%s" % (" ".join(args), p.stderr))
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--bank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budgets", default="0.5,0.25")
    ap.add_argument("--policy", default="next_use")
    ap.add_argument("--precision", default="fast", choices=("exact", "fast"))
    ap.add_argument("--io-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old", action="store_true", help="add the engine before (serial) per budget")
    ap.add_argument("--trial-ab", action="store_true",
                    help="add a row per budget with the prefetch trial off (engine/pager/qm_pager_trial.h)")
    ap.add_argument("--fio-seconds", type=int, default=8)
    ap.add_argument("--trace")
    ap.add_argument("--json", help="also write every run's JSON line here")
    a = ap.parse_args()
    binary = os.path.join(a.build, "bench", "paging_disk", "paging_from_disk")
    bank = a.bank or make_bank(a.build, a.layers, a.dir)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    print("# %s, %d cores (%s), load %s, kernel %s" % (
        datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), os.cpu_count(), cpu,
        " ".join(open("/proc/loadavg").read().split()[:3]), platform.release()))
    disk = {}
    for key, rw, depth in (("rand1", "randread", 1), ("randN", "randread", a.io_depth),
                           ("seqN", "read", a.io_depth)):
        disk[key] = fio(bank, key, rw, depth, a.fio_seconds)
    if disk["randN"]:
        print("# disk (fio %s, O_DIRECT, 2 MiB reads of the bank file): random QD1 %.0f MB/s, "
              "random QD%d %.0f MB/s, sequential QD%d %.0f MB/s" % (
                  disk["randN"][1], disk["rand1"][0] / 1e6, a.io_depth, disk["randN"][0] / 1e6,
                  a.io_depth, disk["seqN"][0] / 1e6))
    else:
        print("# disk: fio not installed (scripts/setup.sh installs it); the I/O bound uses "
              "the rate the pager measured")

    rows = [{"name": "resident", "mode": "resident", "budget": 1.0, "io": "-"}]
    for b in (float(x) for x in a.budgets.split(",")):
        rows.append({"name": "direct", "mode": "direct", "budget": b, "io": "auto"})
        if a.trial_ab:
            rows.append({"name": "direct-notrial", "mode": "direct", "budget": b, "io": "auto",
                         "trial": "off"})
        if a.old:
            rows.append({"name": "direct-old", "mode": "direct", "budget": b, "io": "serial"})
    runs = {i: [] for i in range(len(rows))}
    log = open(a.json, "w") if a.json else None
    for _ in range(a.reps):
        for i, row in enumerate(rows):
            r = run_row(binary, bank, row, a)
            runs[i].append(r)
            if log:
                log.write(json.dumps(r) + "\n")
    first = runs[0][0]
    print("# bank %s: %d layers, %d experts, top-%d, %.2f GiB of experts, %.2f MiB per expert; "
          "%s precision, %d threads, %s, %d tokens after %d warm-up, median of %d" % (
              bank, first["layers"], first["experts"], first["k"], first["expert_gib"],
              first["expert_bytes"] / 1048576, a.precision, a.threads,
              "trace " + a.trace if a.trace else "synthetic trace", a.tokens, a.warm, a.reps))

    def med(i, key):
        return statistics.median(r[key] for r in runs[i])

    resident = med(0, "tokens_per_s")
    hdr = ("row", "engine", "budget", "tok/s", "calls/s", "x resident", "hit rate",
           "MiB/token", "stall ms/token", "in flight", "I/O ms/token", "I/O bound tok/s",
           "overlap bound", "of bound", "disk busy")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    new_of = {}
    for i, row in enumerate(rows):
        tps = med(i, "tokens_per_s")
        cells = [row["name"], runs[i][0]["io"] + (" QD%d" % runs[i][0]["io_depth"]
                                                  if row["mode"] == "direct" else ""),
                 "%.0f%%" % (100 * row["budget"]), "%.2f" % tps, "%.1f" % med(i, "calls_per_s"),
                 "%.2f" % (tps / resident), "%.3f" % med(i, "hit_rate")]
        if row["mode"] == "direct":
            rate = disk["randN"][0] if disk["randN"] else med(i, "disk_mb_per_s") * 1e6
            io_ms = med(i, "misses_per_token") * first["expert_bytes"] / rate * 1e3 if rate else 0
            bound = 1e3 / io_ms if io_ms else float("inf")
            overlap = min(bound, resident)
            cells += ["%.1f" % med(i, "pager_disk_mib_per_token"),
                      "%.1f" % med(i, "stall_ms_per_token"),
                      "%.1f/%d" % (med(i, "reads_in_flight_mean"),
                                   max(r["reads_in_flight_peak"] for r in runs[i])),
                      "%.1f" % io_ms, "%.1f" % bound, "%.1f" % overlap,
                      "%.2f" % (tps / overlap),
                      "%.0f%%" % (100 * med(i, "pager_disk_mib_per_token") * 1048576 * tps / rate
                                  if rate else 0)]
            new_of.setdefault(row["budget"], {})[row["io"] + ("-" + row["trial"] if "trial" in row else "")] = tps
        else:
            cells += ["-"] * 8
        print("| " + " | ".join(cells) + " |")
    for b, d in new_of.items():
        if "auto" in d and "auto-off" in d:
            print("# budget %.0f%%: prefetch trial on/off %.2f (%.2f / %.2f tok/s)" % (
                100 * b, d["auto"] / d["auto-off"], d["auto"], d["auto-off"]))
        if "auto" in d and "serial" in d:
            print("# budget %.0f%%: new/old %.2f (%.2f / %.2f tok/s)" % (
                100 * b, d["auto"] / d["serial"], d["auto"], d["serial"]))
    print("# all rows: " + "; ".join("%s %s: %s" % (
        row["name"], "%.0f%%" % (100 * row["budget"]),
        " ".join("%.2f" % r["tokens_per_s"] for r in runs[i])) for i, row in enumerate(rows)))


if __name__ == "__main__":
    main()
