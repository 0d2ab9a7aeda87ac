#!/usr/bin/env python3
"""IPC benchmark: qmoed's socket + JSON-RPC codec against redis on a Unix
socket, and session.infer end to end against the engine's own compute time.

Both servers run in this process's lifetime on private sockets. Round trips
are driven by qmoe-ipc-load (one epoll thread, closed loop, like
redis-benchmark); redis is also measured by redis-benchmark itself.

usage: bench_ipc.py --build BUILD_DIR [--record docs/BENCHMARKS.md] [--quick]
"""
import argparse
import base64
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "daemon"))


def load(build, sock, clients, requests, warmup, line=None, line_file=None, redis=False):
    cmd = [os.path.join(build, "bench", "ipc", "qmoe-ipc-load"), "--socket", sock,
           "--clients", str(clients), "--requests", str(requests), "--warmup", str(warmup)]
    if redis:
        cmd.append("--redis-ping")
    elif line_file:
        cmd += ["--line-file", line_file]
    else:
        cmd += ["--line", line]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def redis_benchmark(sock, clients, requests):
    out = subprocess.run(["redis-benchmark", "-s", sock, "-t", "ping_mbulk", "-c", str(clients),
                          "-n", str(requests), "--csv", "--precision", "3"],
                         check=True, capture_output=True, text=True).stdout
    rows = [l.replace('"', "").split(",") for l in out.strip().splitlines()]
    head, vals = rows[0], rows[-1]
    r = dict(zip(head, vals))
    return {"rps": float(r["rps"]), "p50_us": float(r["p50_latency_ms"]) * 1000,
            "p99_us": float(r["p99_latency_ms"]) * 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--record")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "qmoe-bench-ipc"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.environ["QMOE_BUILD_DIR"] = a.build
    from qmoed_harness import Client, Daemon, make_bank

    os.makedirs(a.workdir, exist_ok=True)
    n1, n50, ninf = (5000, 20000, 50) if a.quick else (50000, 200000, 300)
    bank = make_bank(os.path.join(a.workdir, "gptoss20b-like-%dl.bank" % a.layers),
                     layers=a.layers, experts=32, hidden=2880, inter=2880, k=4, bits=4, block=32,
                     activation="swiglu", fusion=1, router=True, seed=7)
    results = {}
    run_dir = tempfile.mkdtemp(prefix="bench-ipc-")
    dm = Daemon(models={"gptoss": bank}, workdir=run_dir,
                args=["--set", "idle_timeout_s=0", "--log-level", "notice"])
    redis_sock = os.path.join(run_dir, "redis.sock")
    redis = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", redis_sock,
                              "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while not os.path.exists(redis_sock) and time.time() < deadline:
            time.sleep(0.02)
        status = '{"jsonrpc":"2.0","id":1,"method":"daemon.status"}'
        for clients, n in ((1, n1), (50, n50)):
            results["qmoed_status_c%d" % clients] = load(a.build, dm.socket, clients, n,
                                                         n // 10, line=status)
            results["redis_load_c%d" % clients] = load(a.build, redis_sock, clients, n, n // 10,
                                                       redis=True)
            results["redis_benchmark_c%d" % clients] = redis_benchmark(redis_sock, clients, n)

        # session.infer at T = 1 on the GPT-OSS-20B-like layer.
        c = dm.client()
        sid = c.call("session.create", {"model": "gptoss"})["session"]
        import numpy as np
        x = np.random.default_rng(1).standard_normal((1, 2880)).astype(np.float32)
        req = {"jsonrpc": "2.0", "id": 1, "method": "session.infer",
               "params": {"session": sid, "layer": 0,
                          "hidden": {"dtype": "f32", "shape": [1, 2880],
                                     "data": base64.b64encode(x.tobytes()).decode()}}}
        line_file = os.path.join(run_dir, "infer.json")
        with open(line_file, "w") as f:
            f.write(json.dumps(req))
        r = load(a.build, dm.socket, 1, ninf, max(ninf // 10, 5), line_file=line_file)
        results["infer_t1"] = r
        results["infer_t1_request_bytes"] = os.path.getsize(line_file)
        tele = c.call("telemetry.get", {"session": sid})
        results["infer_t1_daemon_p50_us"] = tele["p50_us"]
        c.close()
    finally:
        redis.terminate()
        redis.wait()
        dm.stop()

    q1, q50 = results["qmoed_status_c1"], results["qmoed_status_c50"]
    rb1, rb50 = results["redis_benchmark_c1"], results["redis_benchmark_c50"]
    rl1, rl50 = results["redis_load_c1"], results["redis_load_c50"]
    inf = results["infer_t1"]
    overhead = inf["mean_us"] - inf["compute_us_mean"]
    lines = [
        "## IPC",
        "",
        "`cmake --build build --target bench-ipc` (bench/ipc/bench_ipc.py), %s, %s, %d cores. "
        "qmoed (CPU backend, release build) and a private `redis-server %s` (`--port 0 "
        "--unixsocket`, no persistence) on Unix sockets in the same run. Round trips are "
        "closed-loop: each client sends one request and waits for its answer. `qmoe-ipc-load` "
        "is one epoll thread driving every connection (it speaks both protocols); "
        "`redis-benchmark -t ping_mbulk` is redis's own client."
        % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), platform.machine(),
           os.cpu_count(), subprocess.run(["redis-server", "--version"], capture_output=True,
                                          text=True).stdout.split()[2].split("=")[1]),
        "",
        "| round trip | clients | requests/s | p50 µs | p99 µs |",
        "|---|---|---|---|---|",
        "| qmoed `daemon.status` (qmoe-ipc-load) | 1 | %.0f | %.1f | %.1f |"
        % (q1["rps"], q1["p50_us"], q1["p99_us"]),
        "| redis `PING` (qmoe-ipc-load) | 1 | %.0f | %.1f | %.1f |"
        % (rl1["rps"], rl1["p50_us"], rl1["p99_us"]),
        "| redis `ping_mbulk` (redis-benchmark) | 1 | %.0f | %.1f | %.1f |"
        % (rb1["rps"], rb1["p50_us"], rb1["p99_us"]),
        "| qmoed `daemon.status` (qmoe-ipc-load) | 50 | %.0f | %.1f | %.1f |"
        % (q50["rps"], q50["p50_us"], q50["p99_us"]),
        "| redis `PING` (qmoe-ipc-load) | 50 | %.0f | %.1f | %.1f |"
        % (rl50["rps"], rl50["p50_us"], rl50["p99_us"]),
        "| redis `ping_mbulk` (redis-benchmark) | 50 | %.0f | %.1f | %.1f |"
        % (rb50["rps"], rb50["p50_us"], rb50["p99_us"]),
        "",
        "Ratios against redis-benchmark's figure (target ≥ 1.0× with 1 client, ≥ 0.8× with "
        "50): **%.2f×** with 1 client, **%.2f×** with 50. Against redis driven by the same "
        "client: %.2f× and %.2f×."
        % (q1["rps"] / rb1["rps"], q50["rps"] / rb50["rps"], q1["rps"] / rl1["rps"],
           q50["rps"] / rl50["rps"]),
        "",
        "`session.infer` at T = 1, GPT-OSS-20B-like layer (H = I = 2880, E = 32, k = 4, swiglu "
        "interleaved, int4 block 32, %d layers generated by `qmoe-bank create`), policy "
        "whole_bank, f32 hidden (request line %d bytes), 1 client, %d requests:"
        % (a.layers, results["infer_t1_request_bytes"], inf["requests"]),
        "",
        "| end to end through the socket, mean | p50 | p99 | engine `compute_us`, mean | "
        "socket + codec + queue overhead |",
        "|---|---|---|---|---|",
        "| %.0f µs | %.0f µs | %.0f µs | %.0f µs | %.0f µs = **%.1f%%** of engine time |"
        % (inf["mean_us"], inf["p50_us"], inf["p99_us"], inf["compute_us_mean"], overhead,
           100.0 * overhead / inf["compute_us_mean"] if inf["compute_us_mean"] else 0),
        "",
        "(target ≤ 5%%). The daemon's own `p50_us` for these calls (frame decoded to response "
        "encoded) was %d µs." % results["infer_t1_daemon_p50_us"],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    print(json.dumps(results, indent=1), file=sys.stderr)
    if a.record:
        old = open(a.record).read() if os.path.exists(a.record) else "# Benchmarks\n\n"
        start = old.find("## IPC\n")
        if start >= 0:
            end = old.find("\n## ", start + 1)
            old = old[:start] + (old[end + 1:] if end >= 0 else "")
        if not old.endswith("\n\n"):
            old = old.rstrip("\n") + "\n\n"
        with open(a.record, "w") as f:
            f.write(old + text)


if __name__ == "__main__":
    main()
