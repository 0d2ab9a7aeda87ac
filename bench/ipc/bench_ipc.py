#!/usr/bin/env python3
"""IPC benchmark: qmoed's socket + JSON-RPC codec against redis on a Unix
socket, and session.infer end to end against the engine's own compute time.

Both servers run in this process's lifetime on private sockets. Round trips
are driven by qmoe-ipc-load (one epoll thread, closed loop, like
redis-benchmark); redis is also measured by redis-benchmark itself.

usage: bench_ipc.py --build BUILD_DIR [--out FILE] [--quick]

The table goes to stdout, and with --out also into FILE (replaced); the raw
figures go to stderr as JSON. docs/BENCHMARKS.md "The call's cost" shows it.
"""
import base64
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import bench_common


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
    ap = bench_common.parser("qmoe-bench-ipc", threads=False)
    ap.add_argument("--out", help="also write the table to this file (replaced)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    h = bench_common.harness(a.build)
    n1, n50, ninf = (3000, 10000, 30) if a.quick else (20000, 50000, 100)
    bank = bench_common.gptoss_bank(h, a.workdir, a.layers)
    results = {}
    run_dir = tempfile.mkdtemp(prefix="bench-ipc-")
    dm = h.Daemon(models={"gptoss": bank}, workdir=run_dir,
                  args=["--set", "idle_timeout_s=0", "--log-level", "notice"])
    redis, redis_sock = bench_common.start_redis(run_dir)
    try:
        status = '{"jsonrpc":"2.0","id":1,"method":"daemon.status"}'
        # Interleaved repetitions: on a shared machine the load drifts, so
        # each contender gets the same mix of quiet and busy moments.
        runs = {}
        for rep in range(a.reps):
            for clients, n in ((1, n1), (50, n50)):
                for name, fn in (
                        ("qmoed", lambda: load(a.build, dm.socket, clients, n, n // 10,
                                               line=status)),
                        ("redis_load", lambda: load(a.build, redis_sock, clients, n, n // 10,
                                                    redis=True)),
                        ("redis_benchmark", lambda: redis_benchmark(redis_sock, clients, n))):
                    runs.setdefault("%s_c%d" % (name, clients), []).append(fn())
        for key, rs in runs.items():
            rs.sort(key=lambda r: r["rps"])
            med = rs[len(rs) // 2]
            results[key] = {"rps": med["rps"], "p50_us": med["p50_us"], "p99_us": med["p99_us"],
                            "best_rps": rs[-1]["rps"], "all_rps": [r["rps"] for r in rs]}

        # session.infer at T = 1 on the GPT-OSS-20B-like layer.
        import numpy as np
        x = np.random.default_rng(1).standard_normal((1, 2880)).astype(np.float32)

        def infer_run(daemon, tag):
            c = daemon.client()
            sid = c.call("session.create", {"model": "gptoss"})["session"]
            req = {"jsonrpc": "2.0", "id": 1, "method": "session.infer",
                   "params": {"session": sid, "layer": 0,
                              "hidden": {"dtype": "f32", "shape": [1, 2880],
                                         "data": base64.b64encode(x.tobytes()).decode()}}}
            line_file = os.path.join(run_dir, "infer.json")
            with open(line_file, "w") as f:
                f.write(json.dumps(req))
            r = load(a.build, daemon.socket, 1, ninf, max(ninf // 10, 5), line_file=line_file)
            r["request_bytes"] = os.path.getsize(line_file)
            r["daemon_p50_us"] = c.call("telemetry.get", {"session": sid})["p50_us"]
            c.call("session.close", {"session": sid})
            c.close()
            results[tag] = r

        infer_run(dm, "infer_t1")
        dm1 = h.Daemon(models={"gptoss": bank}, workdir=run_dir,
                     socket_path=os.path.join(run_dir, "t1.sock"),
                     args=["--threads", "1", "--workers", "1", "--log-level", "notice"])
        try:
            infer_run(dm1, "infer_t1_threads1")
        finally:
            dm1.stop()
    finally:
        redis.terminate()
        redis.wait()
        dm.stop()

    q1, q50 = results["qmoed_c1"], results["qmoed_c50"]
    rb1, rb50 = results["redis_benchmark_c1"], results["redis_benchmark_c50"]
    rl1, rl50 = results["redis_load_c1"], results["redis_load_c50"]

    def infer_row(r, label):
        over = r["mean_us"] - r["compute_us_mean"]
        eng = r["compute_us_mean"] or 1
        return ("| %s | %.0f µs | %.0f µs | %.0f µs | %.0f µs | %.0f µs = **%.1f%%** | "
                "%.0f µs | %.0f µs = **%.2f%%** |"
                % (label, r["mean_us"], r["p50_us"], r["p99_us"], r["compute_us_mean"], over,
                   100.0 * over / eng, r["queue_us_mean"], r["codec_us_mean"],
                   100.0 * r["codec_us_mean"] / eng))

    def row(label, clients, r):
        return ("| %s | %d | %.0f | %.0f | %.1f | %.1f |"
                % (label, clients, r["rps"], r["best_rps"], r["p50_us"], r["p99_us"]))

    inf, inf1 = results["infer_t1"], results["infer_t1_threads1"]
    lines = [
        "**The wire against redis** (bench/ipc/bench_ipc.py)",
        "",
        "`cmake --build build --target bench-ipc` (bench/ipc/bench_ipc.py), %s, %s, %d cores, "
        "load average %.1f at the end (the machine is shared). qmoed (CPU backend, release "
        "build) and a private `redis-server %s` (`--port 0 --unixsocket`, no persistence) on "
        "Unix sockets in the same run. Round trips are closed-loop: each client sends one "
        "request and waits for its answer. `qmoe-ipc-load` is one epoll thread driving every "
        "connection (it speaks both protocols); `redis-benchmark -t ping_mbulk` is redis's own "
        "client. %d interleaved repetitions of each row; the table gives the run with the "
        "median requests/s (its p50/p99) and the best run."
        % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), platform.machine(),
           os.cpu_count(), os.getloadavg()[0],
           subprocess.run(["redis-server", "--version"], capture_output=True,
                          text=True).stdout.split()[2].split("=")[1], a.reps),
        "",
        "| round trip | clients | requests/s (median) | best | p50 µs | p99 µs |",
        "|---|---|---|---|---|---|",
        row("qmoed `daemon.status` (qmoe-ipc-load)", 1, q1),
        row("redis `PING` (qmoe-ipc-load)", 1, rl1),
        row("redis `ping_mbulk` (redis-benchmark)", 1, rb1),
        row("qmoed `daemon.status` (qmoe-ipc-load)", 50, q50),
        row("redis `PING` (qmoe-ipc-load)", 50, rl50),
        row("redis `ping_mbulk` (redis-benchmark)", 50, rb50),
        "",
        "Ratios of medians (targets ≥ 1.0× with 1 client, ≥ 0.8× with 50): against "
        "redis-benchmark **%.2f×** with 1 client and **%.2f×** with 50; against redis driven "
        "by the same client **%.2f×** and **%.2f×**."
        % (q1["rps"] / rb1["rps"], q50["rps"] / rb50["rps"], q1["rps"] / rl1["rps"],
           q50["rps"] / rl50["rps"]),
        "",
        "`session.infer` at T = 1, GPT-OSS-20B-like layer (H = I = 2880, E = 32, k = 4, swiglu "
        "interleaved, int4 block 32, %d layers generated by `qmoe-bank create`), policy "
        "whole_bank, f32 hidden (request line %d bytes), 1 client, %d requests each:"
        % (a.layers, inf["request_bytes"], inf["requests"]),
        "",
        "| daemon | end to end, mean | p50 | p99 | engine `compute_us`, mean | "
        "everything else (socket, codec, queue, thread wake-ups) / engine | "
        "of which `queue_us` (worker wake-up) | codec alone (`decode_us` + `encode_us`) / "
        "engine |",
        "|---|---|---|---|---|---|---|---|",
        infer_row(inf, "default (`--threads 0`: 2 compute threads, 2 workers)"),
        infer_row(inf1, "`--threads 1 --workers 1` (a core left for the loop and client)"),
        "",
        "Target ≤ 5%%. `decode_us` (JSON + base64 of the request, loop thread) and "
        "`encode_us` (base64 + JSON of the answer, worker) are the daemon's own timings in "
        "each answer's `stats`; the rest of the gap is the two sockets' round trip and the "
        "thread hand-offs (loop -> worker -> loop), which on this shared 2-core machine "
        "wait for a free core. The daemon's own p50 (frame decoded to answer ready, "
        "histogram bucket bound) was %d µs and %d µs."
        % (inf["daemon_p50_us"], inf1["daemon_p50_us"]),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    print(json.dumps(results, indent=1), file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
