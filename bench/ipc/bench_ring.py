#!/usr/bin/env python3
"""Where a layer call goes (issue 39), in one run: the machine's floor (a
futex word and a Unix socket handed back and forth between two processes,
calls 1 ms apart so both sides are asleep, as in decode) beside qmoed's
call ring and socket calls at T = 1, 1 ms apart, on a tiny bank (compute
about nothing: the protocol's own cost) and on the Qwen3-30B-A3B shape
(hidden 2048, 128 experts of 768, k = 8, int4 blocks of 32; --layers of
them, fast precision as llama.cpp + qmoed decodes), the engine's own
routing with fresh experts every call; the daemon's CPU time per call
(every thread, /proc/PID/task/*/schedstat) and its CPU seconds over
--idle-s seconds with the rings open and no call (/proc/PID/stat).

"Beyond compute" is each call's end-to-end time in the client
(libqmoe-client's qm_client_session_infer_mapped) minus the engine's
compute_us from its answer. Ring and socket calls alternate in blocks of
100 on one session (qm_client_set_ring), floors likewise.

usage: bench_ring.py --build BUILD [--calls 1000] [--gap-us 1000] [--layers 4]
                     [--idle-s 10] [--threads 0] [--workdir DIR] [--skip-qwen]
                     [--evict-mib M] [--anticipate]
--anticipate: the ring is opened asking the daemon to anticipate its calls
(session.ring's `anticipate`: it wakes ahead of each call its tempo says is
due and spins for it), against a floor that still sleeps.
--evict-mib M: before each call (the floor's and qmoed's alike) two threads
read M MiB between them, as an engine's attention reads its weights between
two layer calls, so that the call finds the caches cold.
Prints the JSON of every part, then the table and the targets' lines.
"""
import json
import os
import shutil
import subprocess
import tempfile

import bench_common


def main():
    ap = bench_common.parser("qmoe-bench-ring")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--gap-us", type=float, default=1000)
    ap.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-shaped bank")
    ap.add_argument("--idle-s", type=float, default=10)
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--anticipate", action="store_true",
                    help="open the ring asking the daemon to anticipate its calls "
                         "(session.ring's anticipate); the floor still sleeps")
    ap.add_argument("--evict-mib", type=float, default=0,
                    help="before each call (floor and qmoed alike) two threads read this many MiB "
                         "between them, as an engine's own work between layer calls does: the "
                         "caches then hold none of either side's state")
    a = ap.parse_args()
    h = bench_common.harness(a.build)
    bench = os.path.join(a.build, "bench", "ipc", "qmoe-ring-bench")
    out = {}
    ev = ["--evict-mib", str(a.evict_mib)] if a.evict_mib else []
    r = subprocess.run([bench, "floor", "--calls", str(a.calls), "--gap-us", str(a.gap_us)] + ev,
                       check=True, capture_output=True, text=True)
    out["floor"] = json.loads(r.stdout)

    cases = [("tiny", "exact", bench_common.tiny_bank(h, a.workdir))]
    if not a.skip_qwen:
        cases.append(("qwen3-30b-a3b", "fast", h.make_bank(
            os.path.join(a.workdir, "qwen3-30b-a3b-%dl.bank" % a.layers), layers=a.layers,
            experts=128, hidden=2048, inter=768, k=8, bits=4, block=32, activation="swiglu",
            fusion=1, router=True, seed=7)))
    for name, precision, bank in cases:
        run_dir = tempfile.mkdtemp(prefix="bench-ring-", dir=a.workdir)
        dm = h.Daemon(models={name: bank}, workdir=run_dir,
                    args=["--set", "idle_timeout_s=0", "--log-level", "notice",
                          "--threads", str(a.threads)])
        try:
            r = subprocess.run([bench, "calls", "--socket", dm.socket, "--model", name,
                                "--calls", str(a.calls), "--gap-us", str(a.gap_us),
                                "--precision", precision, "--daemon-pid", str(dm.proc.pid),
                                "--idle-s", str(a.idle_s)] + ev +
                               (["--anticipate", "1"] if a.anticipate else []),
                               check=True, capture_output=True, text=True, timeout=3600)
            out[name] = json.loads(r.stdout)
        finally:
            dm.stop()
            shutil.rmtree(run_dir, ignore_errors=True)  # the daemon's; the banks stay in --workdir
    print(json.dumps(out, indent=1))
    report(out, a)


def report(out, a):
    fl = out["floor"]
    futex, sock = fl["futex_us"], fl["socket_us"]
    print()
    print("Floor, two processes, calls %.0f us apart%s, %d calls each: futex p50 %.1f us (p90 %.1f), "
          "Unix socket p50 %.1f us (p90 %.1f)" % (
              a.gap_us, ", %.0f MiB read by two threads before each" % a.evict_mib if a.evict_mib else "",
              fl["calls"], futex["p50"], futex["p90"], sock["p50"], sock["p90"]))
    print()
    print("| bank | transport | end to end p50 (p90) | compute_us p50 | beyond compute p50 (p90) "
          "| / futex floor | daemon CPU per call |")
    print("|---|---|---|---|---|---|---|")
    for name in [k for k in out if k != "floor"]:
        for t in ("ring", "socket"):
            r = out[name][t]
            label = "ring (anticipating)" if t == "ring" and a.anticipate else t
            print("| %s | %s | %.1f (%.1f) us | %.1f us | %.1f (%.1f) us | %.2fx | %.1f us |" % (
                name, label, r["e2e_us"]["p50"], r["e2e_us"]["p90"], r["compute_us"]["p50"],
                r["rest_us"]["p50"], r["rest_us"]["p90"], r["rest_us"]["p50"] / futex["p50"],
                r["daemon_cpu_us_per_call"]))
    print()
    for name in [k for k in out if k != "floor"]:
        d = out[name]
        ring, sck = d["ring"], d["socket"]
        rest = ring["rest_us"]["p50"]
        print("%s: ring beyond compute %.1f us p50 = %.2fx the futex floor (target <= 1.5x: %s), "
              "<= 30 us: %s; daemon CPU per call ring %.1f us vs socket %.1f us (%.2fx; target "
              "<= 1.10x: %s); idle with the ring open: %.3f CPU-s over %.0f s (schedstat %.0f us; "
              "target 0: %s)" % (
                  name, rest, rest / futex["p50"], "met" if rest <= 1.5 * futex["p50"] else "missed",
                  "met" if rest <= 30 else "missed", ring["daemon_cpu_us_per_call"],
                  sck["daemon_cpu_us_per_call"],
                  ring["daemon_cpu_us_per_call"] / max(sck["daemon_cpu_us_per_call"], 1e-9),
                  "met" if ring["daemon_cpu_us_per_call"] <= 1.1 * sck["daemon_cpu_us_per_call"]
                  else "missed", d["idle_cpu_s"], d["idle_s"], d["idle_cpu_us_schedstat"],
                  "met" if d["idle_cpu_s"] == 0 else "missed"))


if __name__ == "__main__":
    main()
