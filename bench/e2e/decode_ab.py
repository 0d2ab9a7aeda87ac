#!/usr/bin/env python3
"""Decode alternated: llama.cpp alone against llama.cpp + qmoed (whole_bank)
in one or more daemon variants, round after round in the same minutes, so
that a noisy host's drift falls on every row alike.

Each round runs `llama-bench -p 0 -n DECODE -t THREADS` alone and once per
variant, in an order rotated round by round (so that no row always runs
right after the same one: the memory the last run freed, the page cache),
against a fresh `qmoed --threads THREADS` whose environment the variant
sets (NAME=VAR=VALUE[,VAR=VALUE...]; NAME= for the daemon as it is);
llama-bench gets the variant's environment too (the llama.cpp adapter and
libqmoe-client read some of the same variables); the variable QMOED names
the qmoed binary a variant runs instead (another build, side by side), LLAMA
the llama.cpp install (PREFIX) its llama-bench comes from (one linked with
another build's libqmoe-client), and
POLICY and BUDGET the session llama.cpp asks for (`--qmoed-policy`, default
whole_bank; `--qmoed-budget`, e.g. 50%: a paged session), and
SET=KEY=VALUE[;KEY=VALUE...] the daemon's settings (`--set`, e.g.
SET=io_depth=4). --state-dir gives
every daemon one state_dir, as a long-running daemon keeps one: a paged
session then starts from the hotness profile the earlier runs left
(warm_from_profile). llama-bench decodes the same tokens in every run (its
std::rand() is never seeded), so that profile was made by the very routing
the next run repeats: an upper bound for a daemon whose earlier sessions
saw other prompts. A variant's SET=state_dir=DIR gives that variant alone
one; without either a session starts empty (a lower bound: a decode with
no prompt before it). When a variant pages, the bank's disk is measured
before the first round and after the last (fio, O_DIRECT random reads of
one expert unit at 32 in flight, bench/paging_disk/io_bench.py's), the
bound its paged rows read against. Prints every round's
tok/s, each variant's ratio to the alone run of the same round (pair by
pair), and their medians, with both processes' memory: llama-bench's peak
VmRSS (with its RssAnon: VmRSS counts the GGUF's mapped pages it touched)
and the daemon's peak VmRSS, sampled every 20 ms; and the share of the
CPUs' time the host took from this guest during each run (/proc/stat's
steal: what the neighbours of a shared host disturbed, shown beside the
rows; a host can also slow a run without it showing there, through the
memory bandwidth it shares). --json writes the rounds.

--prefill N times a prompt of N tokens instead of the decode (`-p N -n 0`),
the same rows in prefill tok/s.

usage: decode_ab.py --llama PREFIX --gguf GGUF --bank BANK [--rounds 6] [--decode 64] [--prefill N]
                    [--threads 2] [--precision fast] [--variant NAME=ENV ...] [--json OUT]
                    [--state-dir DIR]
e.g. paged against whole_bank: --variant whole= --variant p50=POLICY=next_use,BUDGET=50%
(GGUF and BANK: what bench/e2e/llama_cpp.py --keep left in its --work folder,
e.g. qwen3-30b-a3b.q4_0.gguf and qwen3-30b-a3b.q4_0.bank.)
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "daemon"))
sys.path.insert(0, os.path.join(ROOT, "bench", "paging_disk"))

import llama_cpp  # noqa: E402  (llama_bench: one llama-bench run, parsed)


def variant(text):
    name, _, env = text.partition("=")
    pairs = [kv.split("=", 1) for kv in env.split(",") if kv]
    if not name or any(len(kv) != 2 for kv in pairs):
        raise argparse.ArgumentTypeError("--variant NAME=VAR=VALUE[,VAR=VALUE...] (NAME= for none): %r" % text)
    return name, dict(pairs)


def cpu_line():
    model, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    fl = line.split(":", 1)[1].split()
                    flags = " ".join(x for x in fl if x.startswith(("avx", "amx")) or x in ("fma", "f16c"))
                    break
    except OSError:
        pass
    return "%s, %d CPUs; %s" % (model or "?", os.cpu_count() or 0, flags)


def cpu_times():
    """/proc/stat's first line: (all ticks, steal ticks), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: the
    # guest times are already inside user and nice.
    return sum(v[:8]), v[7] if len(v) > 7 else 0


def steal_share(t0, t1):
    if not t0 or not t1 or t1[0] <= t0[0]:
        return None
    return (t1[1] - t0[1]) / (t1[0] - t0[0])


def steal_text(share):
    return "" if share is None else " [steal %.1f%%]" % (100 * share)


def unit_bytes(build, bank):
    """The bank's bytes_per_expert (qmoe-bank inspect), or None."""
    import re
    import subprocess
    tool = os.path.join(build, "tools", "qmoe-bank", "qmoe-bank")
    try:
        out = subprocess.run([tool, "inspect", bank], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return None
    m = re.search(r"^bytes_per_expert: (\d+)", out, re.M)
    return int(m.group(1)) if m else None


def disk(build, bank):
    """fio's O_DIRECT random-read rate of the bank, one expert unit a read
    (rounded up to 4 KiB), 32 in flight: (bytes/s, text)."""
    import io_bench
    unit = unit_bytes(build, bank)
    if not unit:
        return None, "the bank's unit size is unknown (qmoe-bank inspect failed)"
    block = (unit + 4095) // 4096 * 4096
    llama_cpp.drop_cached([bank])
    got = io_bench.fio(bank, "qmoed-units", "randread", 32, 5, block=block)
    if not got:
        return None, "fio is missing or failed (scripts/setup.sh installs it)"
    return float(got[0]), "%.2f GB/s (fio, %s, %d-byte O_DIRECT random reads, 32 in flight)" % (
        got[0] / 1e9, got[1], block)


def hits_text(rate):
    return "—" if rate is None else "%.3f" % rate


def mem(rounds, key, anon=None):
    """Peak bytes, median over the rounds, in GB (with the anonymous part)."""
    gb = statistics.median(x[key] for x in rounds) / 1e9
    if anon is None:
        return "%.2f GB" % gb
    return "%.2f GB (%.2f)" % (gb, statistics.median(x[anon] for x in rounds) / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True, help="PREFIX that clients/llama.cpp/build.sh installed")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--bank", required=True)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="qmoed's build tree")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prompt of this many tokens instead (llama-bench -p N -n 0): "
                         "prefill tok/s in every row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["exact", "fast"], default="fast")
    ap.add_argument("--variant", type=variant, action="append",
                    help="NAME=VAR=VALUE[,...]: a daemon variant (default: one, the daemon as it is); "
                         "VAR QMOED: the qmoed binary to run (another build); LLAMA: the llama.cpp "
                         "PREFIX its llama-bench comes from")
    ap.add_argument("--json", help="also write the rounds here")
    ap.add_argument("--state-dir", help="every daemon's state_dir (hotness profiles kept between runs)")
    a = ap.parse_args()
    os.environ["QMOE_BUILD_DIR"] = os.path.abspath(a.build)
    from qmoed_harness import Daemon
    variants = a.variant or [("qmoed", {})]
    # --prefill: every run times a prompt (no decode) and the rows compare that.
    n_gen, key = (0, "prefill_tok_s") if a.prefill else (a.decode, "decode_tok_s")
    # llama.cpp asks the daemon for the model named as the GGUF's file.
    model = os.path.splitext(os.path.basename(a.gguf))[0]
    print("# %s" % cpu_line(), flush=True)
    pages = any("BUDGET" in env for _, env in variants)
    disk_rates = []
    if pages:
        rate, text = disk(a.build, a.bank)
        disk_rates.append(rate)
        print("# the disk before the rounds: %s" % text, flush=True)
    rounds = []
    for r in range(a.rounds):
        # Each round runs alone and the variants in a rotated order: what runs
        # right after another (the page cache, the memory the last run freed)
        # falls on every row in turn.
        order = [None] + list(variants)
        order = order[r % len(order):] + order[:r % len(order)]
        row = {"order": ["alone" if v is None else v[0] for v in order]}
        for v in order:
            t0 = cpu_times()
            if v is None:
                res = llama_cpp.llama_bench(a, a.gguf, prompt=a.prefill, decode=n_gen)
                row.update({"alone": res.get(key), "alone_rss": res["engine"]["VmRSS"],
                            "alone_anon": res["engine"]["RssAnon"],
                            "alone_steal": steal_share(t0, cpu_times())})
                continue
            name, env = v
            # QMOED=PATH: that qmoed binary (another build, side by side);
            # POLICY and BUDGET: the session llama.cpp asks for.
            binary = env.get("QMOED")
            # LLAMA=PREFIX: that llama.cpp install (e.g. linked with another
            # build's libqmoe-client), for this variant's runs.
            va = argparse.Namespace(**vars(a))
            if "LLAMA" in env:
                va.llama = env["LLAMA"]
            session = ["--qmoed-policy", env.get("POLICY", "whole_bank")]
            if "BUDGET" in env:
                session += ["--qmoed-budget", env["BUDGET"]]
            sets = [kv for kv in env.get("SET", "").split(";") if kv]
            env = {k: val for k, val in env.items()
                   if k not in ("QMOED", "LLAMA", "POLICY", "BUDGET", "SET")}
            args = ["--threads", str(a.threads), "--log-level", "warning"]
            for kv in sets:  # SET=KEY=VALUE[;KEY=VALUE...]: the daemon's --set
                args += ["--set", kv]
            if a.state_dir:
                os.makedirs(a.state_dir, exist_ok=True)
                args += ["--set", "state_dir=" + os.path.abspath(a.state_dir)]
            dm = Daemon(models={model: a.bank}, env=env, binary=binary, args=args)
            try:
                res = llama_cpp.llama_bench(va, a.gguf, prompt=a.prefill, decode=n_gen,
                                            daemon_pid=dm.proc.pid, env=env,
                                            extra=["--qmoed", dm.socket] + session +
                                                  ["--qmoed-precision", a.precision])
            finally:
                row[name + "_steal"] = steal_share(t0, cpu_times())
                dm.stop()
                shutil.rmtree(dm.dir, ignore_errors=True)  # the harness's temp dir
            if res["rc"] != 0:
                sys.exit("llama-bench with qmoed (%s) failed:\n%s" % (name, res["log_tail"]))
            row[name] = res.get(key)
            row[name + "_beyond_us"] = res.get("call_overhead_us")
            row[name + "_compute_us"] = res.get("compute_us")
            row[name + "_hit_rate"] = res.get("hit_rate")
            row[name + "_rss"] = res["engine"]["VmRSS"]
            row[name + "_anon"] = res["engine"]["RssAnon"]
            row[name + "_qmoed_rss"] = res["daemon"]["VmRSS"]
        rounds.append(row)
        print("round %d (%s): alone %.2f%s | %s" % (
            r + 1, ", ".join(row["order"]), row["alone"], steal_text(row["alone_steal"]), " | ".join(
                "%s %.2f (%.3fx; a call %.0f us compute + %.0f us; hits %s)%s" % (
                    n, row[n], row[n] / row["alone"], row[n + "_compute_us"] or 0, row[n + "_beyond_us"] or 0,
                    hits_text(row[n + "_hit_rate"]), steal_text(row[n + "_steal"]))
                for n, _ in variants)), flush=True)
    if pages:
        rate, text = disk(a.build, a.bank)
        disk_rates.append(rate)
        print("# the disk after the rounds: %s" % text, flush=True)
    print()
    print("| row | %s tok/s, median of %d | / alone, pair by pair: median (range) "
          "| a layer call: compute, beyond it (medians) | hit rate | llama-bench peak RSS (anon) | qmoed peak RSS |"
          % ("prefill (%d tokens)" % a.prefill if a.prefill else "decode", a.rounds))
    print("|---|---|---|---|---|---|---|")
    print("| llama.cpp alone | %.2f | — | — | — | %s | — |" % (
        statistics.median(x["alone"] for x in rounds), mem(rounds, "alone_rss", "alone_anon")))
    for n, _ in variants:
        ratios = [x[n] / x["alone"] for x in rounds]
        hits = [x[n + "_hit_rate"] for x in rounds if x[n + "_hit_rate"] is not None]
        print("| + qmoed %s | %.2f | **%.3fx** (%.3f-%.3f) | %.0f us, %.0f us | %s | %s | %s |" % (
            n, statistics.median(x[n] for x in rounds), statistics.median(ratios), min(ratios), max(ratios),
            statistics.median(x[n + "_compute_us"] or 0 for x in rounds),
            statistics.median(x[n + "_beyond_us"] or 0 for x in rounds),
            hits_text(statistics.median(hits) if hits else None),
            mem(rounds, n + "_rss", n + "_anon"), mem(rounds, n + "_qmoed_rss")))
    steals = [x[k] for x in rounds for k in x if k.endswith("steal") and x[k] is not None]
    if steals:
        print("\nthe host's steal per run: median %.1f%%, largest %.1f%% (of %d runs)" % (
            100 * statistics.median(steals), 100 * max(steals), len(steals)))
    # Every further variant against the first, pair by pair (e.g. a paged
    # session against whole_bank, or a build against another).
    n0 = variants[0][0]
    for n1, _ in variants[1:]:
        ratios = [x[n1] / x[n0] for x in rounds]
        print("%s%s / %s, pair by pair: median %.3fx (%.3f-%.3f)" % (
            "\n" if n1 == variants[1][0] else "", n1, n0, statistics.median(ratios), min(ratios),
            max(ratios)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_line(), "rounds": rounds, "disk_bytes_per_s": disk_rates}, f, indent=1)


if __name__ == "__main__":
    main()
