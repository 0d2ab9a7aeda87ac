#!/usr/bin/env python3
"""session.infer's cost outside the engine, mapped (session.map) vs base64
tensors, one client, on the GPT-OSS-20B-like layer (H = I = 2880, E = 32,
k = 4, int4 block 32), at T = 1 and T = 512; a redis PING round trip over a
Unix socket measured in the same run (qmoe-ipc-load, one client).

Routing is supplied by the engine (topk_ids/topk_weights, 4 distinct experts
per token), as the transformers hook sends it. Overhead = end-to-end time of
the library call (libqmoe-client, C) minus the
engine's compute_us from the answer: sockets, JSON, base64 or the map, the
queue and thread hand-offs.

usage: bench_shm.py --build BUILD_DIR [--requests-t1 N] [--requests-t512 N] [--threads N]
"""
import json
import os
import subprocess
import tempfile

import bench_common


def main():
    ap = bench_common.parser("qmoe-bench-ipc")
    ap.add_argument("--requests-t1", type=int, default=100)
    ap.add_argument("--requests-t512", type=int, default=5)
    a = ap.parse_args()
    h = bench_common.harness(a.build)
    bank = bench_common.gptoss_bank(h, a.workdir)
    # The tiny layer too: its overhead is the protocol path's floor without
    # a 20-40 ms compute next to it on the same cores.
    tiny = bench_common.tiny_bank(h, a.workdir)
    run_dir = tempfile.mkdtemp(prefix="bench-shm-")
    dm = h.Daemon(models={"gptoss": bank, "tiny": tiny}, workdir=run_dir,
                  args=["--set", "idle_timeout_s=0", "--log-level", "notice",
                        "--threads", str(a.threads), "--set", "max_request_bytes=134217728"])
    redis, redis_sock = bench_common.start_redis(run_dir)
    out = {}
    try:
        def ping():
            r = subprocess.run([os.path.join(a.build, "bench", "ipc", "qmoe-ipc-load"), "--socket",
                                redis_sock, "--clients", "1", "--requests", "20000", "--warmup",
                                "1000", "--redis-ping"], check=True, capture_output=True, text=True)
            return json.loads(r.stdout)

        def infer(tokens, n, model="gptoss"):
            r = subprocess.run([os.path.join(a.build, "bench", "ipc", "qmoe-shm-bench"), "--socket",
                                dm.socket, "--model", model, "--tokens", str(tokens),
                                "--requests", str(n)], check=True, capture_output=True, text=True)
            return json.loads(r.stdout)

        out["redis_before"] = ping()
        out["tiny_t1"] = infer(1, 2000, "tiny")
        out["t1"] = infer(1, a.requests_t1)
        out["t512"] = infer(512, a.requests_t512)
        out["redis_after"] = ping()
    finally:
        redis.terminate()
        redis.wait()
        dm.stop()
    rtt = [r["mean_us"] for r in (out["redis_before"], out["redis_after"])]
    out["redis_rtt_us_mean"] = sum(rtt) / 2
    out["redis_p50_us"] = [r.get("p50_us") for r in (out["redis_before"], out["redis_after"])]
    print(json.dumps(out, indent=1))
    print()
    print("| T | tensors | end to end, mean | engine compute_us, mean | outside the engine, mean "
          "(p50) | / engine | / redis PING RTT |")
    print("|---|---|---|---|---|---|---|")
    for t in ("tiny_t1", "t1", "t512"):
        for mode in ("base64", "mapped"):
            r = out[t][mode]
            print("| %s%d | %s | %.0f µs | %.0f µs | %.0f µs (%.0f µs) | %.3f%% | %.1f× |" % (
                "tiny layer, " if t == "tiny_t1" else "", out[t]["tokens"], mode,
                r["e2e_us_mean"], r["compute_us_mean"],
                r["overhead_us_mean"], r["overhead_us_p50"], 100 * r["overhead_of_engine"],
                r["overhead_us_mean"] / out["redis_rtt_us_mean"]))
    for t in ("tiny_t1", "t1", "t512"):
        b = out[t]["mapped_breakdown"]
        print("T = %d mapped, daemon's view (%d calls): end to end %.0f µs = compute %.0f µs + "
              "rest of the worker's time %.0f µs + queue (worker wake-up) %.0f µs + decode %.0f µs "
              "+ sockets, loop thread and client %.0f µs" % (
                  out[t]["tokens"], b["calls"], b["e2e_us_mean"], b["compute_us_mean"],
                  b["worker_wall_us_mean"] - b["compute_us_mean"], b["queue_us_mean"],
                  b["decode_us_mean"], b["e2e_us_mean"] - b["worker_wall_us_mean"]
                  - b["queue_us_mean"] - b["decode_us_mean"]))
    print()
    print("redis PING round trip (qmoe-ipc-load, 1 client, before/after): %.1f / %.1f µs mean, "
          "p50 %s µs" % (rtt[0], rtt[1], out["redis_p50_us"]))


if __name__ == "__main__":
    main()
