#!/usr/bin/env python3
"""session.infer through two builds' daemons side by side, in rounds, on a
bank of your choice, routed by the bank's router: the engine's compute_us
(router logits, routing, the experts, the combine) and the daemon's CPU
time per call, per token count and precision.

Both daemons run all along with the same bank (one page cache), policy
whole_bank; every call sends fresh random hidden states (seeded), so each
call routes to fresh experts. Each round drives both builds' daemons in
turn with the same hidden states (the Python client, one
connection, base64; which build goes first alternates). Printed per round and as medians over rounds: the
median compute_us of each build, the daemon's CPU time per call (/proc:
every thread), and new/old of both.

usage: infer_ab.py --old BUILD --new BUILD --src SOURCE_DIR --bank FILE --hidden H
                   [--tokens 1,16] [--precision exact] [--rounds 5]
                   [--requests 60] [--threads 2] [--old-env K=V] [--new-env K=V]
(BUILD: a build directory with daemon/qmoed)"""
import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True)
ap.add_argument("--new", required=True)
ap.add_argument("--src", required=True)
ap.add_argument("--bank", required=True)
ap.add_argument("--tokens", default="1,16")
ap.add_argument("--precision", default="exact")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--requests", type=int, default=60)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--hidden", type=int, required=True, help="the bank's hidden size")
ap.add_argument("--old-env", action="append", default=[], help="KEY=VALUE for the old daemon")
ap.add_argument("--new-env", action="append", default=[], help="KEY=VALUE for the new daemon")
a = ap.parse_args()
sys.path.insert(0, os.path.join(a.src, "tests", "daemon"))
sys.path.insert(0, os.path.join(a.src, "clients", "python"))
from qmoe_client import Client  # noqa: E402

wd = tempfile.mkdtemp(prefix="infer-ab-")


def start(build, tag):
    env = dict(kv.split("=", 1) for kv in (a.old_env if tag == "old" else a.new_env))
    os.environ["QMOE_BUILD_DIR"] = build
    import importlib
    import qmoed_harness
    importlib.reload(qmoed_harness)
    return qmoed_harness.Daemon(
        models={"m": os.path.abspath(a.bank)}, workdir=tempfile.mkdtemp(prefix=tag, dir=wd),
        env=env,
        args=["--set", "idle_timeout_s=0", "--log-level", "notice", "--threads",
              str(a.threads)] + (["--allow-root"] if os.geteuid() == 0 else []))


def cpu_of(pid):
    """The daemon's CPU seconds, every thread: schedstat's nanoseconds (the
    clock ticks of /proc/PID/stat step by 10 ms, a call's cost at T = 1)."""
    total = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            total += int(open("/proc/%d/task/%s/schedstat" % (pid, tid)).read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


dms = {"old": start(a.old, "old"), "new": start(a.new, "new")}
clients, sessions = {}, {}
for tag, d in dms.items():
    clients[tag] = Client(d.socket)
    sessions[tag] = clients[tag].create_session("m", policy="whole_bank",
                                                precision=a.precision)["session"]


def run(tag, t, xs):
    c, sid, pid = clients[tag], sessions[tag], dms[tag].proc.pid
    comp = []
    c0 = cpu_of(pid)
    for i, x in enumerate(xs):
        r = c.infer(sid, i % 2, x)  # the bank's two layers in turn
        comp.append(r.stats["compute_us"])
    return statistics.median(comp[len(comp) // 10:]), (cpu_of(pid) - c0) * 1e6 / len(xs)


tokens = [int(t) for t in a.tokens.split(",")]
rows = {t: [] for t in tokens}
rng = np.random.default_rng(5)
try:
    # Warm-up: calls of 256 tokens touch (nearly) every expert of both
    # layers, so no timed call pays the mapping's first page faults.
    warm = [rng.standard_normal((256, a.hidden)).astype(np.float32) for _ in range(4)]
    for tag in dms:
        run(tag, 256, warm)
    for i in range(a.rounds):
        la = os.getloadavg()[0]
        for t in tokens:
            xs = [rng.standard_normal((t, a.hidden)).astype(np.float32)
                  for _ in range(a.requests)]
            # Alternate which build goes first: a drift in the load, or the
            # second run finding the page cache warmer, favours neither.
            if i % 2 == 0:
                o, n = run("old", t, xs), run("new", t, xs)
            else:
                n, o = run("new", t, xs), run("old", t, xs)
            rows[t].append((o, n))
            print("round %d load %.1f T=%d | compute_us old %.0f new %.0f (new/old %.2f) | "
                  "daemon CPU us/call old %.0f new %.0f (new/old %.2f)"
                  % (i, la, t, o[0], n[0], n[0] / o[0], o[1], n[1], n[1] / o[1]), flush=True)
finally:
    for c in clients.values():
        c.close()
    for d in dms.values():
        d.stop()
for t in tokens:
    rs = rows[t]
    med = lambda f: statistics.median(f(o, n) for o, n in rs)
    print("MEDIANS T=%d: compute_us old %.0f new %.0f, new/old %.2f | daemon CPU us/call "
          "old %.0f new %.0f, new/old %.2f"
          % (t, med(lambda o, n: o[0]), med(lambda o, n: n[0]), med(lambda o, n: n[0] / o[0]),
             med(lambda o, n: o[1]), med(lambda o, n: n[1]), med(lambda o, n: n[1] / o[1])))
