#!/usr/bin/env python3
"""bench/qmoe_cpu/run.py - the CPU engine against onnxruntime's CPU QMoE, side by side.

    .venv/bin/python bench/qmoe_cpu/run.py --build BUILD_DIR [--quick]
        [--cases gptoss,mixtral,qwen3,deepseek,gptoss_int8] [--tokens 1,16,128,512]
        [--ggml /tmp/qmoe-ggml/ggml_moe_bench]

For each case it writes a random bank to /tmp (deleted at exit), then, in
rounds, alternates: qmoe_cpu_bench (our engine, 2 threads), onnxruntime with
its default settings (its fastest paths: MLAS Q4 / QNBit GEMM) and with the
exact-path settings (ORT_USE_MLAS_Q4_GEMM_MOE=0, ORT_QMOE_CPU_QNBIT_GEMM=0),
each with intra_op_num_threads = 2 and fresh random inputs per call, calls
cycling through the bank's layers. Our engine runs in both precisions
(exact, fast); fast through a whole-bank pager in the r8 layout, as the
daemon runs a fast session on the CPU (qmoe_cpu_bench --r8 1). With --ggml (bench/qmoe_cpu/ggml/build.sh builds it),
llama.cpp's ggml MUL_MAT_ID runs the same shapes with Q4_0 and Q8_0 weights
in the same rounds, with fresh expert ids before each compute, and Q4_0
again from ggml's CPU_REPACK buffer (what llama.cpp runs by default on
x86: rows interleaved eight at a time). A
STREAM-like read of a buffer far larger than the LLC measures the machine's
read bandwidth, and register loops its f32 FMA and int8 dot peaks, in the
same run. Every case's outputs are checked once against each other
(qmoe-bank run, both precisions, vs ORT). Prints the CPU, a Markdown table
of times (medians, min/max, ratios) and one of each engine's share of its
bound: the larger of its weight bytes at the read bandwidth and its
arithmetic at the peak that engine's arithmetic runs at (f32 FMA for
qmoed exact, int8 dot for qmoed fast and ggml).
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tools"))
import qmoebank  # noqa: E402

CASES = {
    # name: (H, I, E, k, bits, block, layers, token counts); every bank is
    # far larger than a 32 MiB L3 (the smallest, qwen3's two layers: 754 MiB)
    "gptoss": dict(H=2880, I=2880, E=32, k=4, bits=4, bs=32, layers=2, tokens=(1, 16, 128, 512)),
    "mixtral": dict(H=4096, I=14336, E=8, k=2, bits=4, bs=32, layers=1, tokens=(1, 16, 128, 512)),
    # Qwen3-30B-A3B-like and DeepSeek-V2-Lite-like: fine-grained experts
    "qwen3": dict(H=2048, I=768, E=128, k=8, bits=4, bs=32, layers=2, tokens=(1, 16, 128, 512)),
    "deepseek": dict(H=2048, I=1408, E=64, k=6, bits=4, bs=32, layers=2, tokens=(1, 16, 128, 512)),
    "gptoss_int8": dict(H=2880, I=2880, E=32, k=4, bits=8, bs=64, layers=1, tokens=(1, 16)),
}


def make_bank(path, c, seed, scale_dtype=np.float32):
    """Random codes (every nibble random), scales ~ 1/(sqrt(K) * 2^(bits-1))
    (f32, or scale_dtype: np.float16 is what a GGUF Q4_0 import holds),
    f32 biases: GPT-OSS-style swiglu (interleaved, alpha 1.702, beta 1, limit 7)."""
    rng = np.random.default_rng(seed)
    cfg = qmoebank.BankConfig(layers=c["layers"], experts=c["E"], hidden_size=c["H"],
                              inter_size=c["I"], k=c["k"], bits=c["bits"], block_size=c["bs"],
                              activation="swiglu", swiglu_fusion=1, activation_alpha=1.702,
                              activation_beta=1.0, swiglu_limit=7.0)
    tensors = {}
    pack = 8 // c["bits"]
    for layer in range(c["layers"]):
        for proj in ("fc1", "fc2"):
            n, k = cfg.dims(proj)
            nblk = -(-k // c["bs"])
            tensors[f"layers.{layer}.{proj}.weight"] = rng.integers(
                0, 256, (c["E"], n, k // pack), dtype=np.uint8)
            base = 1.0 / (math.sqrt(k) * (1 << (c["bits"] - 1)))
            tensors[f"layers.{layer}.{proj}.scales"] = (
                base * rng.uniform(0.5, 1.5, (c["E"], n, nblk))).astype(scale_dtype)
            tensors[f"layers.{layer}.{proj}.bias"] = (
                0.05 * rng.standard_normal((c["E"], n))).astype(np.float32)
    qmoebank.save_bank(path, cfg, tensors)
    return cfg, tensors


def ort_sessions(cfg, tensors, exact, threads):
    import bank2onnx
    import onnxruntime as ort

    if exact:
        os.environ["ORT_USE_MLAS_Q4_GEMM_MOE"] = "0"
        os.environ["ORT_QMOE_CPU_QNBIT_GEMM"] = "0"
    else:
        os.environ.pop("ORT_USE_MLAS_Q4_GEMM_MOE", None)
        os.environ.pop("ORT_QMOE_CPU_QNBIT_GEMM", None)
    sessions = []
    for layer in range(cfg.layers):
        model = bank2onnx.build_model(cfg, tensors, [layer], np.dtype(np.float32))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sessions.append(ort.InferenceSession(model.SerializeToString(), so,
                                             providers=["CPUExecutionProvider"]))
    return sessions


def time_ort(sessions, cfg, t, iters, warmup, rng):
    ms = []
    for it in range(warmup + iters):
        x = rng.uniform(-1, 1, (t, cfg.hidden_size)).astype(np.float32)
        lg = rng.uniform(-3, 3, (t, cfg.experts)).astype(np.float32)
        s = sessions[it % len(sessions)]
        t0 = time.perf_counter()
        s.run(None, {"input": x, "router_probs": lg})
        dt = time.perf_counter() - t0
        if it >= warmup:
            ms.append(dt * 1e3)
    return ms


def time_ours(bench, bank, t, iters, warmup, threads, seed, precision="exact"):
    r = subprocess.run([bench, "--bank", bank, "--tokens", str(t), "--threads", str(threads),
                        "--iters", str(iters), "--warmup", str(warmup), "--seed", str(seed),
                        "--precision", precision] + (["--r8", "1"] if precision == "fast" else []),
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def time_ggml(ggml, c, typ, t, iters, warmup, threads, seed, repack=False):
    r = subprocess.run([ggml, "--repack", "1" if repack else "0", "--type", typ, "--hidden", str(c["H"]), "--inter", str(c["I"]),
                        "--experts", str(c["E"]), "--k", str(c["k"]), "--layers", str(c["layers"]),
                        "--tokens", str(t), "--threads", str(threads), "--iters", str(iters),
                        "--warmup", str(warmup), "--seed", str(seed)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def peaks(bench, flag, key, threads):
    """qmoe_cpu_bench's peak probe `flag`: {isa: its line's `key`}."""
    r = subprocess.run([bench, flag, "--threads", str(threads)], capture_output=True,
                       text=True, check=True)
    return {o["isa"]: o[key] for o in map(json.loads, r.stdout.strip().splitlines())}


def fma_peak(bench, threads):
    return peaks(bench, "--fma-peak", "median_gflops", threads)


def i8_peak(bench, threads):
    return peaks(bench, "--i8-peak", "median_gops", threads)


def cpu_text():
    """The CPU's model name and the flags the kernels care about (/proc/cpuinfo)."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    want = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
            "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"]
    return model, [w for w in want if w in flags]


def stream(bench, threads, mib):
    r = subprocess.run([bench, "--stream-mib", str(mib), "--threads", str(threads)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip())


def check_outputs(qmoe_bank, bank, cfg, sessions_by_mode, tmp, rng, precision="exact"):
    """Our output (qmoe-bank run) vs each onnxruntime mode, on one random input."""
    t = 7
    x = rng.uniform(-1, 1, (t, cfg.hidden_size)).astype(np.float32)
    lg = rng.uniform(-3, 3, (t, cfg.experts)).astype(np.float32)
    np.save(os.path.join(tmp, "x.npy"), x)
    np.save(os.path.join(tmp, "lg.npy"), lg)
    subprocess.run([qmoe_bank, "run", bank, "--layer", "0", "--hidden", os.path.join(tmp, "x.npy"),
                    "--logits", os.path.join(tmp, "lg.npy"), "--out", os.path.join(tmp, "y.npy"),
                    "--threads", "2", "--precision", precision], check=True, capture_output=True)
    ours = np.load(os.path.join(tmp, "y.npy")).astype(np.float64)
    out = {}
    for mode, sessions in sessions_by_mode.items():
        theirs = sessions[0].run(None, {"input": x, "router_probs": lg})[0].astype(np.float64)
        out[mode] = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    return out


def ab_parser(case, rounds, iters=None):
    """The options the side-by-side scripts (prefill_ab.py, decode_ab.py,
    scales_ab.py) share; --iters when given its default."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--base-build", help="another build to time in the same rounds")
    ap.add_argument("--case", default=case, choices=sorted(CASES))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    if iters:
        ap.add_argument("--iters", type=int, default=iters)
    return ap


def tally(o, key, wall, cpu, med):
    """One time_ours result into a side-by-side's tallies under `key`: its
    samples onto wall, its median CPU ms onto cpu, its median wall ms into
    med; returns its bytes per call."""
    wall[key] += o["samples_ms"]
    cpu[key].append(o["cpu_ms_median"])
    med[key] = o["median_ms"]
    return o["bytes_per_call"]


def ort_round(sessions, cfg, t, iters, warmup, rng, ours_ms, ratios):
    """One round's onnxruntime calls after ours: appends onnxruntime's median /
    ours_ms[name] to ratios[name]; returns its samples and the load average."""
    d = time_ort(sessions, cfg, t, iters, warmup, rng)
    for name, ms in ours_ms.items():
        ratios[name].append(med(d) / ms)
    with open("/proc/loadavg") as f:
        return d, f.read().split()[0]


@contextlib.contextmanager
def temp_bank(prefix):
    """A bank path in a fresh temporary directory, removed with its files on exit."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield os.path.join(tmp, "bank.safetensors")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def med(v):
    return float(np.median(v))


def expert_bytes(c, fmt):
    """One expert's weight bytes (fc1 [2I, H] + fc2 [H, I]): our bank (codes,
    f32 scales per block, f32 biases) or ggml's Q4_0 / Q8_0 (f16 scale per 32)."""
    n = 3 * c["H"] * c["I"]
    if fmt == "q4_0":
        return n * 18 / 32
    if fmt == "q8_0":
        return n * 34 / 32
    return n * c["bits"] / 8 + n / c["bs"] * 4 + (2 * c["I"] + c["H"]) * 4


def bound_ms(r, c, fmt, peak_gops, bw):
    """An engine's bound for row r: its weight bytes at the read bandwidth or
    its arithmetic at its peak, whichever takes longer; and which it is."""
    mem = r["experts_per_call"] * expert_bytes(c, fmt) / (bw * 1e9) * 1e3
    comp = r["gflop_per_call"] / peak_gops * 1e3
    return (mem, "memory") if mem >= comp else (comp, "compute")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--cases", default="gptoss,mixtral,qwen3,deepseek")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--stream-mib", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--tokens", help="only these token counts, e.g. 1,512")
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--ggml", help="ggml_moe_bench (bench/qmoe_cpu/ggml/build.sh) to compare")
    args = ap.parse_args()
    bench = os.path.join(args.build, "bench", "qmoe_cpu", "qmoe_cpu_bench")
    qmoe_bank = os.path.join(args.build, "tools", "qmoe-bank", "qmoe-bank")
    import onnxruntime as ort

    model, flags = cpu_text()
    print(f"# CPU: {model}; flags: {' '.join(flags)}", flush=True)
    print(f"# seed {args.seed}, onnxruntime {ort.__version__}, threads {args.threads}", flush=True)
    rng = np.random.default_rng(args.seed)
    tmp = tempfile.mkdtemp(prefix="qmoe_cpu_bench_", dir="/tmp")
    rows, raw = [], {"seed": args.seed, "cases": [], "cpu": model, "flags": flags}
    bw_samples = []
    peaks = fma_peak(bench, args.threads)
    peak = max(peaks.values()) if peaks else float("nan")
    ipeaks = i8_peak(bench, args.threads)
    ipeak = max(ipeaks.values()) if ipeaks else float("nan")
    print(f"# FMA peak ({args.threads} threads, GFLOP/s): {peaks}; int8 dot peak (GOP/s): "
          f"{ipeaks}", flush=True)
    try:
        for name in args.cases.split(","):
            c = CASES[name]
            bank = os.path.join(tmp, f"{name}.safetensors")
            cfg, tensors = make_bank(bank, c, args.seed)
            bank_bytes = os.path.getsize(bank)
            sessions = {"default": ort_sessions(cfg, tensors, False, args.threads),
                        "exact": ort_sessions(cfg, tensors, True, args.threads)}
            del tensors
            errs = check_outputs(qmoe_bank, bank, cfg, sessions, tmp, rng)
            ferrs = check_outputs(qmoe_bank, bank, cfg, sessions, tmp, rng, "fast")
            print(f"# {name}: bank {bank_bytes / 2**20:.0f} MiB ({cfg.layers} layers), "
                  f"rel err vs ort default {errs['default']:.2g}, exact {errs['exact']:.2g}; "
                  f"fast vs ort exact {ferrs['exact']:.2g}",
                  flush=True)
            for t in c["tokens"]:
                if args.tokens and str(t) not in args.tokens.split(","):
                    continue
                heavy = t * c["k"] * c["H"] * c["I"] >= 4 * 128 * 4096 * 14336 / 8
                iters = 3 if heavy else (60 if t == 1 else 8)
                warm = 1 if heavy else 3
                if args.quick:
                    iters, warm = max(2, iters // 4), 1
                ours_ms, ours_gbps, dflt_ms, exact_ms, ratios, bytes_call = [], [], [], [], [], 0
                fast_ms, g4_ms, g8_ms, g4r_ms, backend = [], [], [], [], ""
                for rnd in range(args.rounds):
                    bw_samples.append(stream(bench, args.threads, args.stream_mib)["median_gbps"])
                    o = time_ours(bench, bank, t, iters, warm, args.threads, args.seed + rnd)
                    fo = time_ours(bench, bank, t, iters, warm, args.threads, args.seed + rnd,
                                   "fast")
                    fast_ms += fo["samples_ms"]
                    backend = fo["backend"]
                    if args.ggml:
                        g4_ms += time_ggml(args.ggml, c, "q4_0", t, iters, warm, args.threads,
                                           args.seed + rnd)["samples_ms"]
                        g8_ms += time_ggml(args.ggml, c, "q8_0", t, iters, warm, args.threads,
                                           args.seed + rnd)["samples_ms"]
                        g4r_ms += time_ggml(args.ggml, c, "q4_0", t, iters, warm, args.threads,
                                            args.seed + rnd, repack=True)["samples_ms"]
                    d = time_ort(sessions["default"], cfg, t, iters, warm, rng)
                    e = time_ort(sessions["exact"], cfg, t, iters if t == 1 else max(2, iters // 2),
                                 warm, rng)
                    ours_ms += o["samples_ms"]
                    bytes_call = o["bytes_per_call"]
                    dflt_ms += d
                    exact_ms += e
                    ratios.append(med(d) / o["median_ms"])
                row = dict(case=name, tokens=t, ours_ms=med(ours_ms), ours_min=min(ours_ms),
                           ours_max=max(ours_ms), bytes_per_call=bytes_call,
                           gbps=bytes_call / (med(ours_ms) * 1e-3) / 1e9, ort_default_ms=med(dflt_ms),
                           ort_default_min=min(dflt_ms), ort_default_max=max(dflt_ms),
                           ort_exact_ms=med(exact_ms), ratio_default=med(ratios),
                           ratio_exact=med(exact_ms) / med(ours_ms), stream_gbps=med(bw_samples),
                           err_default=errs["default"], err_exact=errs["exact"],
                           err_fast=ferrs["exact"], working_set_mib=bank_bytes / 2**20,
                           fast_ms=med(fast_ms), fast_min=min(fast_ms), fast_max=max(fast_ms),
                           ggml_q4_ms=med(g4_ms) if g4_ms else None,
                           ggml_q8_ms=med(g8_ms) if g8_ms else None,
                           ggml_q4r_ms=med(g4r_ms) if g4r_ms else None,
                           gflop_per_call=2.0 * t * c["k"] * c["H"] * c["I"] * 3 / 1e9,
                           fma_peak_gflops=peak, i8_peak_gops=ipeak, backend=backend,
                           experts_per_call=bytes_call / expert_bytes(c, "ours"))
                rows.append(row)
                raw["cases"].append(row)
                print(json.dumps(row), flush=True)
            del sessions
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bw = med(bw_samples)
    print()
    print(f"Read bandwidth (STREAM-like, {args.threads} threads, {args.stream_mib} MiB buffer): "
          f"median {bw:.2f} GB/s (min {min(bw_samples):.2f}, max {max(bw_samples):.2f})")
    print()
    print(f"FMA peak (f32, {args.threads} threads): {peaks} GFLOP/s; the best is the reference")
    print()
    print("| case | T | qmoed exact ms (min-max) | qmoed fast ms (min-max) | ggml Q4_0 ms | "
          "ggml Q4_0 repacked ms | ggml Q8_0 ms | ORT default ms (min-max) | ORT exact ms | "
          "exact % read BW | fast % read BW | exact % FMA peak | exact vs ORT default | "
          "fast vs ggml Q4_0 | fast vs ggml Q4_0 repacked | fast vs ORT default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    na = "n/a"
    for r in rows:
        fgbps = r["bytes_per_call"] / (r["fast_ms"] * 1e-3) / 1e9
        gf = r["gflop_per_call"] / (r["ours_ms"] * 1e-3)
        g4 = f"{r['ggml_q4_ms']:.2f}" if r["ggml_q4_ms"] else na
        g8 = f"{r['ggml_q8_ms']:.2f}" if r["ggml_q8_ms"] else na
        fg = f"{r['ggml_q4_ms'] / r['fast_ms']:.2f}x" if r["ggml_q4_ms"] else na
        g4r = f"{r['ggml_q4r_ms']:.2f}" if r["ggml_q4r_ms"] else na
        fgr = f"{r['ggml_q4r_ms'] / r['fast_ms']:.2f}x" if r["ggml_q4r_ms"] else na
        print(f"| {r['case']} | {r['tokens']} | {r['ours_ms']:.2f} ({r['ours_min']:.2f}-{r['ours_max']:.2f}) "
              f"| {r['fast_ms']:.2f} ({r['fast_min']:.2f}-{r['fast_max']:.2f}) | {g4} | {g4r} | {g8} "
              f"| {r['ort_default_ms']:.2f} ({r['ort_default_min']:.2f}-{r['ort_default_max']:.2f}) "
              f"| {r['ort_exact_ms']:.2f} | {100 * r['gbps'] / bw:.0f}% | {100 * fgbps / bw:.0f}% "
              f"| {100 * gf / peak:.0f}% | {r['ratio_default']:.2f}x | {fg} | {fgr} "
              f"| {r['ort_default_ms'] / r['fast_ms']:.2f}x |")
    print()
    print(f"Int8 dot peak ({args.threads} threads): {ipeaks} GOP/s; the best is the reference. "
          "Each engine's bound: the larger of its weight bytes (distinct experts x bytes per "
          "expert in its format) at the read bandwidth and its arithmetic at its peak "
          "(f32 FMA: qmoed exact; int8 dot: qmoed fast, ggml); share = bound / median time.")
    print()
    print("| case | T | distinct experts | memory bound ms (ours) | f32 bound ms | int8 bound ms | "
          "exact % of bound | fast % of bound | ggml Q4_0 % of bound | ggml Q8_0 % of bound | "
          "kernels (qmoed) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = CASES[r["case"]]
        be, bwhy = bound_ms(r, c, "ours", peak, bw)
        bf, fwhy = bound_ms(r, c, "ours", ipeak, bw)
        mem = r["experts_per_call"] * expert_bytes(c, "ours") / (bw * 1e9) * 1e3
        cells = [f"{100 * be / r['ours_ms']:.0f}% ({bwhy})", f"{100 * bf / r['fast_ms']:.0f}% ({fwhy})"]
        for key, fmt in (("ggml_q4_ms", "q4_0"), ("ggml_q8_ms", "q8_0")):
            if r[key]:
                bg, gwhy = bound_ms(r, c, fmt, ipeak, bw)
                cells.append(f"{100 * bg / r[key]:.0f}% ({gwhy})")
            else:
                cells.append(na)
        print(f"| {r['case']} | {r['tokens']} | {r['experts_per_call']:.1f} | {mem:.2f} "
              f"| {r['gflop_per_call'] / peak * 1e3:.2f} | {r['gflop_per_call'] / ipeak * 1e3:.2f} "
              f"| {' | '.join(cells)} | {r['backend']} |")
    if args.json:
        raw["stream_gbps"] = bw
        raw["fma_peak_gflops"] = peaks
        raw["i8_peak_gops"] = ipeaks
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
