#!/usr/bin/env python3
"""Two engines on one model at the same total budget: shared residency
(policy_params.share_residency, one pool of 2B) against separate resident
sets (two sessions of B each), over the wire, side by side in one run.

Each engine is a thread with its own connection that decodes its own text,
one token at a time through every layer (T = 1 per call), with the routing
supplied by the engine (topk_ids/topk_weights) from a realistic trace
(tools/qmoe_trace.py gen-real, docs/TRACES.md): one trace of 2N tokens of
the model, engine A gets tokens [0, N) and engine B tokens [N, 2N): the same
model's per-layer expert popularity, different texts (topics and drift),
which is how two engines serving different requests overlap. The overlap is
printed (per-layer expert-histogram overlap, 1 - total variation,
averaged). Misses cost a modelled copy (emu backend, --copy-mbps).

Printed per engine and mode: hit rate (telemetry.get), tokens/s (its own
wall time), and the outputs of shared and separate are checked bitwise
equal. Rounds alternate which mode goes first; medians over the rounds.

usage: shared_residency.py --build BUILD_DIR [--tokens N] [--rounds R]
       [--budget-fraction F] [--policy P] [--copy-mbps M]
"""
import argparse
import base64
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "daemon"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))

LAYERS, EXPERTS, K, H, INTER = 8, 32, 4, 256, 256


def t_(a):
    return {"dtype": {np.float32: "f32", np.int32: "i32"}[a.dtype.type], "shape": list(a.shape),
            "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}


def overlap(trace, a0, a1, b0, b1):
    total = 0.0
    for l in range(trace.layers):
        ha = np.zeros(trace.experts)
        hb = np.zeros(trace.experts)
        for t in range(a0, a1):
            for e in trace.row(t, l):
                ha[e] += 1
        for t in range(b0, b1):
            for e in trace.row(t, l):
                hb[e] += 1
        total += np.minimum(ha / ha.sum(), hb / hb.sum()).sum()
    return total / trace.layers


def engine(c, sid, trace, t0, t1, out, key):
    rng = np.random.default_rng(t0)
    w = np.full((1, K), 1.0 / K, dtype=np.float32)
    outs = []
    start = time.perf_counter()
    for t in range(t0, t1):
        x = rng.standard_normal((1, H)).astype(np.float32)
        for l in range(LAYERS):
            ids = np.array([list(trace.row(t, l))], dtype=np.int32)
            r = c.call("session.infer", {"session": sid, "layer": l, "hidden": t_(x),
                                         "topk_ids": t_(ids), "topk_weights": t_(w)})
            outs.append(r["output"]["data"])
    out[key] = (time.perf_counter() - start, outs)


def run_mode(dm, trace, n, budget, policy, share):
    pp = {"share_residency": True} if share else {}
    cs = [dm.client(), dm.client()]
    sids = [c.call("session.create", {"model": "m", "policy": policy, "budget_bytes": budget,
                                      "policy_params": pp})["session"] for c in cs]
    res = {}
    th = [threading.Thread(target=engine, args=(cs[i], sids[i], trace, i * n, (i + 1) * n, res, i))
          for i in range(2)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    figs = []
    for i in range(2):
        tm = cs[i].call("telemetry.get", {"session": sids[i]})
        acc = tm["expert_hits"] + tm["expert_misses"]
        figs.append({"hit_rate": tm["expert_hits"] / acc, "tok_s": n / res[i][0],
                     "outs": res[i][1]})
        cs[i].call("session.close", {"session": sids[i]})
        cs[i].close()
    return figs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-fraction", type=float, default=0.25)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--copy-mbps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.environ["QMOE_BUILD_DIR"] = a.build
    from qmoed_harness import Daemon, make_bank
    import qmoe_trace

    work = tempfile.mkdtemp(prefix="bench-share-")
    bank = make_bank(os.path.join(work, "m.bank"), layers=LAYERS, experts=EXPERTS, hidden=H,
                     inter=INTER, k=K, bits=4, block=32, seed=3)
    trace = qmoe_trace.generate_realistic(2 * a.tokens, LAYERS, EXPERTS, K, a.seed)
    dm = Daemon(models={"m": bank}, workdir=work,
                args=["--backend", "emu", "--set", "emu_copy_mbps=%d" % a.copy_mbps,
                      "--set", "idle_timeout_s=0", "--log-level", "warning"])
    try:
        c = dm.client()
        total = c.call("model.list")["models"][0]["bytes_total"]
        c.close()
        budget = int(total * a.budget_fraction)
        rows = {"separate": [], "shared": []}
        for r in range(a.rounds):
            order = ["separate", "shared"] if r % 2 == 0 else ["shared", "separate"]
            got = {m: run_mode(dm, trace, a.tokens, budget, a.policy, m == "shared")
                   for m in order}
            for i in range(2):
                assert got["separate"][i]["outs"] == got["shared"][i]["outs"], \
                    "engine %d: outputs differ between shared and separate" % i
            for m in order:
                rows[m].append(got[m])
    finally:
        dm.stop()
    print("model: %d layers, %d experts, k=%d, H=%d, I=%d, int4; %s, budget %.0f%% of the "
          "model per engine (%d bytes), emu copies at %d MB/s; %d tokens per engine, %d rounds"
          % (LAYERS, EXPERTS, K, H, INTER, a.policy, 100 * a.budget_fraction, budget,
             a.copy_mbps, a.tokens, a.rounds))
    print("routing overlap of the two engines (1 - TV of per-layer histograms): %.3f"
          % overlap(trace, 0, a.tokens, a.tokens, 2 * a.tokens))
    print("| engine | figure | separate | shared | shared / separate |")
    print("|---|---|---|---|---|")
    for i in range(2):
        for f in ("hit_rate", "tok_s"):
            s = statistics.median(x[i][f] for x in rows["separate"])
            h = statistics.median(x[i][f] for x in rows["shared"])
            print("| %s | %s | %.3f | %.3f | %.2fx |" % ("AB"[i], f, s, h, h / s))
    print("outputs: shared == separate bitwise for both engines, every round")


if __name__ == "__main__":
    main()
