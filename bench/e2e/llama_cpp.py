#!/usr/bin/env python3
"""llama.cpp alone against llama.cpp with its routed experts in qmoed, side by
side on the same GGUF (issue 22): rows (c) and (d) of bench/e2e/run.py.

    rows(checkpoint_dir, shape_name, args) -> list of row dicts (run.py's KEYS
        and a few more), add_arguments(parser): this file's options
    python bench/e2e/llama_cpp.py CHECKPOINT_DIR SHAPE --llama PREFIX [options]

CHECKPOINT_DIR is a Hugging Face checkpoint with a tokenizer whose
pre-tokenizer is Qwen2's (bench/e2e/checkpoints.py writes them). The GGUFs
are made with llama.cpp's own convert_hf_to_gguf.py (bf16, or Q8_0 directly
with --direct-q8 when a bf16 copy does not fit on disk; then Q4_0 is
requantised from it) and llama-quantize (Q4_0, Q8_0), in --work; each is
imported with `qmoe-bank import gguf` (an exact int4 bank from Q4_0, exact
int8 from Q8_0). PREFIX is what clients/llama.cpp/build.sh installed.

Per GGUF, in --rounds rounds of the same order (drift on a shared machine
lands on every configuration alike), after the GGUF and the bank were read
through once (every row starts with them in the page cache):
llama-bench -p PROMPT -n DECODE -t THREADS -r 1 alone, then against a fresh
qmoed (--threads THREADS) under whole_bank and next_use at 50% and 25% of
the bank. Each row holds the median prefill and decode tok/s over the rounds
and, from the same runs, the engine's peak RSS (VmRSS sampled every 20 ms;
engine_peak_anon and engine_peak_file split it: the file part is the GGUF's
mapped pages it touched, counted in VmRSS), the daemon's peak RSS, the GGUF's
non-expert bytes and llama.cpp's KV cache (what the engine RSS target is made
of), and for qmoed rows the session's hit rate and the per-layer call's cost
beyond the daemon's compute (call_overhead_us: the time in llama.cpp's op
less the daemon's compute_us, per call, from the counters llama.cpp logs
when the context is freed).

--cgroup adds the memory-capped comparison: a memory cgroup (cgroup v1's
memory controller, memory.limit_in_bytes; v2's memory.max where mounted)
capped at half the GGUF's size holds the whole run, with the GGUF's and the
bank's pages dropped from the page cache first (posix_fadvise DONTNEED on
those two files only). llama.cpp alone runs with mmap, again with
--repack 0 when its default repacking is OOM-killed; llama.cpp + qmoed runs
next_use at a budget that fits (the cap less the engine's non-expert bytes,
its buffers and the daemon's own memory), the daemon reading experts with
O_DIRECT (paging_source direct), both processes in the group.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "daemon"))

from qmoed_memcg import MemCgroup  # noqa: E402  (a memory cgroup, v1 or v2)

GB = 1e9
CONFIGS = [("whole_bank", None), ("next_use", 0.5), ("next_use", 0.25)]
SESSION_RE = re.compile(r"qmoed: session \S+: (\d+) layer calls(?: \([^)]*\))?, (\d+) rows: daemon compute ([\d.]+) ms, "
                        r"queue ([\d.]+) ms, ([\d.]+) ms in the op \(([\d.]+) us per call beyond the "
                        r"daemon's compute\); expert hits (\d+), misses (\d+)")
TRANSPORT_RE = re.compile(r"qmoed: session \S+: \d+ layer calls \(([^)]*)\)")
KV_RE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB")


def add_arguments(ap):
    """This file's options (run.py adds them to its own)."""
    ap.add_argument("--quants", default="q4_0,q8_0", help="llama-quantize types of the GGUFs")
    ap.add_argument("--direct-q8", action="store_true",
                    help="convert straight to Q8_0 (no bf16 GGUF on disk); Q4_0 requantised from it")
    ap.add_argument("--cgroup-prompt", type=int, default=16, help="prompt tokens under the cgroup cap")
    ap.add_argument("--cgroup-decode", type=int, default=16, help="decode tokens under the cgroup cap")


def torch_python():
    for d in (os.environ.get("QMOE_TORCH_VENV"), "/var/cache/qmoed/venv-torch",
              os.path.expanduser("~/.cache/qmoed/venv-torch")):
        if d and os.path.exists(os.path.join(d, "bin", "python")):
            return os.path.join(d, "bin", "python")
    raise SystemExit("no torch environment for convert_hf_to_gguf.py: run scripts/setup.sh")


class RssPeak(threading.Thread):
    """Peak VmRSS, RssAnon, RssFile of a process, sampled every 20 ms."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop_flag = pid, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}, False

    def sample(self):
        try:
            with open("/proc/%d/status" % self.pid) as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in self.peak:
                        self.peak[k] = max(self.peak[k], int(v.split()[0]) * 1024)
        except OSError:
            pass

    def run(self):
        while not self.stop_flag:
            self.sample()
            time.sleep(0.02)

    def stop(self):
        self.stop_flag = True
        self.join()
        return dict(self.peak)


def warm(paths):
    buf = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cached(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def llama_bench(a, gguf, extra=(), cmd_prefix=(), daemon_pid=None, prompt=None, decode=None,
                timeout=3600, env=None):
    prompt = a.prompt if prompt is None else prompt
    decode = a.decode if decode is None else decode
    cmd = list(cmd_prefix) + [os.path.join(a.llama, "bin", "llama-bench"), "-m", gguf, "-p", str(prompt),
                              "-n", str(decode), "-t", str(a.threads), "-r", "1", "-o", "jsonl",
                              "-v"] + list(extra)
    err = tempfile.TemporaryFile(mode="w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env=dict(os.environ, **env) if env else None)
    eng = RssPeak(proc.pid)
    eng.start()
    dmn = RssPeak(daemon_pid) if daemon_pid else None
    if dmn:
        dmn.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    res = {"rc": proc.returncode, "wall_s": time.time() - t0, "engine": eng.stop(),
           "daemon": dmn.stop() if dmn else None}
    err.seek(0)
    log = err.read()
    res["log_tail"] = log[-2000:]
    for line in out.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            key = "decode_tok_s" if j.get("n_gen", 0) > 0 else "prefill_tok_s"
            res[key] = j["avg_ts"]
    m = KV_RE.search(log)
    res["kv_bytes"] = float(m.group(1)) * 1048576 if m else None
    sessions = SESSION_RE.findall(log)
    if sessions:
        calls = sum(int(x[0]) for x in sessions)
        op_ms, compute_ms = sum(float(x[4]) for x in sessions), sum(float(x[2]) for x in sessions)
        hits, misses = sum(int(x[6]) for x in sessions), sum(int(x[7]) for x in sessions)
        res["calls"] = calls
        res["call_overhead_us"] = (op_ms - compute_ms) * 1e3 / calls if calls else None
        res["compute_us"] = compute_ms * 1e3 / calls if calls else None
        res["hit_rate"] = hits / (hits + misses) if hits + misses else None
        res["transport"] = ",".join(sorted(set(TRANSPORT_RE.findall(log)))) or None
    return res


def gguf_sizes(a, gguf):
    """(expert bytes, every other tensor's bytes) of a GGUF."""
    sys.path.insert(0, os.path.join(a.llama, "share", "qmoed-llama.cpp", "gguf-py"))
    import gguf as gg
    r = gg.GGUFReader(gguf)
    exp = sum(int(t.n_bytes) for t in r.tensors if "_exps." in t.name)
    return exp, sum(int(t.n_bytes) for t in r.tensors) - exp


def make_ggufs(a, ckpt, shape):
    """{quant: path}, made once into the work directory."""
    share = os.path.join(a.llama, "share", "qmoed-llama.cpp")
    base = os.path.join(a.work, shape)
    src = base + (".q8_0-direct.gguf" if a.direct_q8 else ".bf16.gguf")
    wanted = {q: "%s.%s.gguf" % (base, q) for q in a.quants}
    if not all(os.path.exists(p) for p in wanted.values()):
        if not os.path.exists(src):
            t0 = time.time()
            subprocess.run([torch_python(), os.path.join(ROOT, "tests", "llama", "make_ggufs.py"),
                            "--share", share, "--convert", ckpt, src, "q8_0" if a.direct_q8 else "bf16"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print("llama_cpp.py: converted %s -> %s in %.0f s" % (ckpt, src, time.time() - t0), file=sys.stderr)
        for q in sorted(wanted, key=lambda q: q != "q8_0"):  # Q8_0 first: with --direct-q8 it is the source
            path = wanted[q]
            if os.path.exists(path):
                continue
            if a.direct_q8 and q == "q8_0":
                os.rename(src, path)
                src = path
                continue
            extra = ["--allow-requantize"] if a.direct_q8 else []
            subprocess.run([os.path.join(a.llama, "bin", "llama-quantize")] + extra +
                           [src, path, q.upper(), str(a.threads)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.path.exists(src) and src not in wanted.values():
            os.remove(src)
    return wanted


def make_bank(gguf):
    from qmoed_harness import qmoe_bank_path
    bank = gguf[:-len(".gguf")] + ".bank"
    if not os.path.exists(bank):
        subprocess.run([qmoe_bank_path(), "import", "gguf", gguf, "--out", bank, "--quiet"], check=True)
    return bank


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(a, shape, quant, policy, budget, runs, sizes, bits):
    exp, rest = sizes
    ok = [r for r in runs if r["rc"] == 0]
    qmoed = policy is not None
    eng = med([r["engine"]["VmRSS"] for r in ok])
    dmn = med([r["daemon"]["VmRSS"] for r in ok if r.get("daemon")])
    row = {
        "shape": shape, "row": "d" if qmoed else "c",
        "engine": "llama.cpp + qmoed" if qmoed else "llama.cpp",
        "weights": quant.upper() + (" + int%d bank" % bits if qmoed else ""),
        "policy": policy, "budget": budget, "threads": a.threads,
        "prefill_tokens": a.prompt, "decode_tokens": a.decode,
        "prefill_tok_s": med([r.get("prefill_tok_s") for r in ok]),
        "decode_tok_s": med([r.get("decode_tok_s") for r in ok]),
        "engine_rss_after_load": None, "engine_peak_rss": eng,
        "engine_peak_anon": med([r["engine"]["RssAnon"] for r in ok]),
        "engine_peak_file": med([r["engine"]["RssFile"] for r in ok]),
        "qmoed_rss": dmn, "qmoed_peak_rss": dmn,
        "total_peak_rss": eng + dmn if eng is not None and dmn is not None else eng,
        "hit_rate": med([r.get("hit_rate") for r in ok]),
        "non_expert_bytes": rest, "expert_bytes": exp,
        "kv_bytes": med([r.get("kv_bytes") for r in ok]),
        "call_overhead_us": med([r.get("call_overhead_us") for r in ok]),
        "transport": next((r["transport"] for r in ok if r.get("transport")), None),
        "rounds": len(ok), "status": "ok" if ok else "failed",
        "note": None if ok else runs[-1]["log_tail"].strip().splitlines()[-1] if runs[-1]["log_tail"] else None,
    }
    return row


def rows(checkpoint_dir, shape_name, args):
    a = args
    if getattr(a, "build", None):
        os.environ["QMOE_BUILD_DIR"] = os.path.abspath(a.build)
    from qmoed_harness import Daemon
    a.llama = os.path.abspath(a.llama)
    a.quants = a.quants.split(",") if isinstance(a.quants, str) else a.quants
    out = []
    base = os.path.join(a.work, shape_name)
    had = {p for q in a.quants for p in ("%s.%s.gguf" % (base, q), "%s.%s.bank" % (base, q))
           if os.path.exists(p)}  # GGUFs and banks the caller brought stay
    ggufs = make_ggufs(a, checkpoint_dir, shape_name)
    try:
        for quant, gguf in ggufs.items():
            bank = make_bank(gguf)
            bits = 4 if quant == "q4_0" else 8
            sizes = gguf_sizes(a, gguf)
            name = os.path.basename(gguf)[:-len(".gguf")]
            warm([gguf, bank])
            runs = {cfg: [] for cfg in [None] + CONFIGS}
            for _ in range(a.rounds):
                runs[None].append(llama_bench(a, gguf))
                for policy, budget in CONFIGS:
                    dm = Daemon(models={name: bank}, args=["--threads", str(a.threads), "--log-level", "warning"])
                    try:
                        extra = ["--qmoed", dm.socket, "--qmoed-policy", policy]
                        if budget:
                            extra += ["--qmoed-budget", "%g%%" % (100 * budget)]
                        if a.precision:
                            extra += ["--qmoed-precision", a.precision]
                        runs[(policy, budget)].append(llama_bench(a, gguf, extra, daemon_pid=dm.proc.pid))
                    finally:
                        dm.stop()
                        shutil.rmtree(dm.dir, ignore_errors=True)  # the harness's temp dir
            out.append(summarise(a, shape_name, quant, None, None, runs[None], sizes, bits))
            for policy, budget in CONFIGS:
                out.append(summarise(a, shape_name, quant, policy, budget, runs[(policy, budget)], sizes, bits))
            if a.cgroup:
                out += cgroup_rows(a, shape_name, quant, gguf, bank, name, sizes, bits)
    finally:
        if not a.keep:
            for gguf in ggufs.values():
                for f in (gguf, gguf[:-len(".gguf")] + ".bank"):
                    if os.path.exists(f) and f not in had:
                        os.remove(f)
    return out


def cgroup_rows(a, shape, quant, gguf, bank, name, sizes, bits):
    from qmoed_harness import Daemon
    cap = os.path.getsize(gguf) / 2
    exp, rest = sizes
    out = []
    for extra in ([], ["--repack", "0"]):  # llama.cpp alone, mmap
        g = MemCgroup(cap, prefix="qmoe-bench")
        try:
            drop_cached([gguf])
            r = llama_bench(a, gguf, extra, cmd_prefix=g.prefix(), prompt=a.cgroup_prompt, decode=a.cgroup_decode)
            r["oom_kills"] = g.oom_kills()
        finally:
            g.remove()
        row = summarise(a, shape, quant, None, None, [r], sizes, bits)
        row.update({"prefill_tokens": a.cgroup_prompt, "decode_tokens": a.cgroup_decode, "cgroup_cap": cap,
                    "repack": not extra, "oom_kills": r["oom_kills"],
                    "note": "in a memory cgroup capped at %.2f GB%s" % (cap / GB, ", --repack 0" if extra else "")})
        out.append(row)
        if r["rc"] == 0:
            break
    # llama.cpp + qmoed, both in the group; the engine's share is its
    # non-expert weights and its buffers (measured uncapped: well under 1 GB
    # beyond them on these shapes), the daemon's its own memory
    budget = int(max(cap - rest - 0.9 * GB, exp * 0.02))
    g = MemCgroup(cap, prefix="qmoe-bench")
    try:
        drop_cached([gguf, bank])
        dm = Daemon(models={name: bank}, args=["--threads", str(a.threads), "--log-level", "warning",
                                               "--set", "paging_source=direct"])
        try:
            g.add(dm.proc.pid)
            extra = ["--qmoed", dm.socket, "--qmoed-policy", "next_use", "--qmoed-budget", str(budget)]
            if a.precision:
                extra += ["--qmoed-precision", a.precision]
            r = llama_bench(a, gguf, extra, cmd_prefix=g.prefix(), daemon_pid=dm.proc.pid,
                            prompt=a.cgroup_prompt, decode=a.cgroup_decode)
            r["oom_kills"] = g.oom_kills()
        finally:
            dm.stop()
            shutil.rmtree(dm.dir, ignore_errors=True)
    finally:
        g.remove()
    row = summarise(a, shape, quant, "next_use", budget / exp, [r], sizes, bits)
    row.update({"prefill_tokens": a.cgroup_prompt, "decode_tokens": a.cgroup_decode, "cgroup_cap": cap,
                "oom_kills": r["oom_kills"],
                "note": "in a memory cgroup capped at %.2f GB with qmoed, budget %.2f GB, O_DIRECT paging"
                        % (cap / GB, budget / GB)})
    out.append(row)
    return out


def table(rs):
    cols = [("shape", "%s"), ("weights", "%s"), ("engine", "%s"), ("policy", "%s"), ("budget", "%.2f"),
            ("prefill_tok_s", "%.1f"), ("decode_tok_s", "%.2f"), ("engine_peak_anon", "GB"),
            ("engine_peak_rss", "GB"), ("qmoed_peak_rss", "GB"), ("non_expert_bytes", "GB"), ("kv_bytes", "GB"),
            ("call_overhead_us", "%.0f"), ("transport", "%s"), ("hit_rate", "%.3f"), ("status", "%s"),
            ("note", "%s")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        cells = []
        for c, f in cols:
            v = r.get(c)
            cells.append("—" if v is None else ("%.2f" % (v / GB) if f == "GB" else f % v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("shape")
    ap.add_argument("--llama", required=True, help="PREFIX that clients/llama.cpp/build.sh installed")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="qmoed's build tree")
    ap.add_argument("--work", default=None, help="where the GGUFs and banks go (default: beside the checkpoint)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUFs and banks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", choices=["exact", "fast"])
    ap.add_argument("--cgroup", action="store_true")
    ap.add_argument("--json", help="also write the rows here")
    add_arguments(ap)
    a = ap.parse_args()
    a.work = a.work or os.path.abspath(a.checkpoint.rstrip("/")) + "-gguf"
    os.makedirs(a.work, exist_ok=True)
    os.environ["QMOE_BUILD_DIR"] = os.path.abspath(a.build)
    rs = rows(a.checkpoint, a.shape, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rs, f, indent=1)
    print(table(rs))


if __name__ == "__main__":
    main()
