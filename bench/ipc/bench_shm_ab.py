#!/usr/bin/env python3
"""session.infer's cost outside the engine at T = 1 on the tiny layer
(H = 64, E = 32, k = 4, as bench_shm.py's first row), two builds side by
side with a redis PING, alternating in rounds (issue 14).

Each round: PING (qmoe-ipc-load, 1 client), the OLD build's qmoed driven by
its own qmoe-shm-bench (base64 then mapped, N calls each), the NEW build's
likewise, PING again. Both daemons run all along (--threads 1), so the
only difference within a round is the code. Printed per round and as
medians over rounds: overhead (end to end minus compute_us) mean and p50,
its ratio to the PING round trip, new/old, and the CPU time per call of
each daemon (/proc) and each client (rusage), both modes together; on a
shared machine the ratios within a round mean more than any absolute time.

usage: bench_shm_ab.py --old BUILD --new BUILD --src SOURCE_DIR [--rounds R] [--requests N]
(BUILD: a build directory with daemon/qmoed and bench/ipc/qmoe-shm-bench,
qmoe-ipc-load; the new one also needs tools/qmoe-bank/qmoe-bank)"""
import argparse, json, os, subprocess, sys, tempfile, time, statistics
ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True); ap.add_argument("--new", required=True)
ap.add_argument("--src", required=True)
ap.add_argument("--rounds", type=int, default=5); ap.add_argument("--requests", type=int, default=3000)
a = ap.parse_args()
sys.path.insert(0, os.path.join(a.src, "tests", "daemon"))
os.environ["QMOE_BUILD_DIR"] = a.new
from qmoed_harness import Daemon, make_bank
wd = tempfile.mkdtemp(prefix="s3ipc-t1-")
tiny = make_bank(os.path.join(wd, "tiny.bank"), layers=2, experts=32, hidden=64, inter=32, k=4,
                 bits=4, block=32, activation="swiglu", fusion=1, router=True, seed=7)
def start(build, tag):
    os.environ["QMOE_BUILD_DIR"] = build
    import importlib, qmoed_harness; importlib.reload(qmoed_harness)
    return qmoed_harness.Daemon(models={"tiny": tiny}, workdir=tempfile.mkdtemp(prefix=tag, dir=wd),
                  args=["--set", "idle_timeout_s=0", "--log-level", "notice", "--threads", "1"] + (["--allow-root"] if os.geteuid() == 0 else []))
dms = {"old": start(a.old, "old"), "new": start(a.new, "new")}
rs = os.path.join(wd, "redis.sock")
redis = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", rs, "--save", "",
                          "--appendonly", "no", "--loglevel", "warning"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not os.path.exists(rs): time.sleep(0.02)
def ping():
    r = subprocess.run([os.path.join(a.new, "bench/ipc/qmoe-ipc-load"), "--socket", rs, "--clients", "1",
                        "--requests", str(a.requests * 4), "--warmup", "500", "--redis-ping"],
                       check=True, capture_output=True, text=True)
    return json.loads(r.stdout)
import resource
def cpu_of(pid):
    f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def infer(tag):
    b = a.old if tag == "old" else a.new
    c0 = cpu_of(dms[tag].proc.pid); r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = infer1(tag, b)
    c1 = cpu_of(dms[tag].proc.pid); r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    calls = 2 * (a.requests + 200) + 10
    out["daemon_cpu_us"] = (c1 - c0) * 1e6 / calls
    out["client_cpu_us"] = ((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)) * 1e6 / calls
    return out
def infer1(tag, b):
    r = subprocess.run([os.path.join(b, "bench/ipc/qmoe-shm-bench"), "--socket", dms[tag].socket,
                        "--model", "tiny", "--tokens", "1", "--requests", str(a.requests), "--warmup", "200"],
                       check=True, capture_output=True, text=True)
    return json.loads(r.stdout)
rows = []
try:
    for i in range(a.rounds):
        la = os.getloadavg()[0]
        p0 = ping(); o = infer("old"); n = infer("new"); p1 = ping()
        pm = (p0["mean_us"] + p1["mean_us"]) / 2
        pp = (p0["p50_us"] + p1["p50_us"]) / 2
        row = {"round": i, "load": la, "ping_mean": pm, "ping_p50": pp}
        for tag, r in (("old", o), ("new", n)):
            for mode in ("base64", "mapped"):
                row[f"{tag}_{mode}_ov_mean"] = r[mode]["overhead_us_mean"]
                row[f"{tag}_{mode}_ov_p50"] = r[mode]["overhead_us_p50"]
                row[f"{tag}_{mode}_comp"] = r[mode]["compute_us_mean"]
            row[f"{tag}_bd"] = r.get("mapped_breakdown")
            row[f"{tag}_dcpu"] = r["daemon_cpu_us"]; row[f"{tag}_ccpu"] = r["client_cpu_us"]
        rows.append(row)
        print("round %d load %.1f | PING mean %.1f p50 %.1f | mapped ov mean old %.1f new %.1f (p50 %.1f / %.1f) | "
              "x PING old %.2f new %.2f | new/old %.2f | base64 old %.1f new %.1f" % (
              i, la, pm, pp, row["old_mapped_ov_mean"], row["new_mapped_ov_mean"], row["old_mapped_ov_p50"],
              row["new_mapped_ov_p50"], row["old_mapped_ov_mean"] / pm, row["new_mapped_ov_mean"] / pm,
              row["new_mapped_ov_mean"] / row["old_mapped_ov_mean"], row["old_base64_ov_mean"],
              row["new_base64_ov_mean"]), flush=True)
        print("   cpu per call (both modes): daemon old %.1f new %.1f | client old %.1f new %.1f" % (
              row["old_dcpu"], row["new_dcpu"], row["old_ccpu"], row["new_ccpu"]), flush=True)
finally:
    redis.terminate(); redis.wait()
    for d in dms.values(): d.stop()
med = lambda k: statistics.median(r[k] for r in rows)
medr = lambda f: statistics.median(f(r) for r in rows)
print("MEDIANS: PING mean %.1f p50 %.1f | mapped ov mean old %.1f new %.1f | p50 old %.1f new %.1f | "
      "x PING mean old %.2f new %.2f | new/old %.2f | base64 ov mean old %.1f new %.1f | compute old %.1f new %.1f" % (
      med("ping_mean"), med("ping_p50"), med("old_mapped_ov_mean"), med("new_mapped_ov_mean"),
      med("old_mapped_ov_p50"), med("new_mapped_ov_p50"),
      medr(lambda r: r["old_mapped_ov_mean"] / r["ping_mean"]), medr(lambda r: r["new_mapped_ov_mean"] / r["ping_mean"]),
      medr(lambda r: r["new_mapped_ov_mean"] / r["old_mapped_ov_mean"]), med("old_base64_ov_mean"),
      med("new_base64_ov_mean"), med("old_mapped_comp"), med("new_mapped_comp")))
print("MEDIAN cpu per call: daemon old %.1f new %.1f | client old %.1f new %.1f" % (
      med("old_dcpu"), med("new_dcpu"), med("old_ccpu"), med("new_ccpu")))
json.dump(rows, open(os.path.join(tempfile.gettempdir(), "s3ipc-t1.json"), "w"), indent=1)
