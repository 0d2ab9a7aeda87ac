#!/usr/bin/env python3
"""End to end on real-config-shaped MoE models: one command builds each
shape's checkpoint (checkpoints.py: the published config, 8 layers, vocab
32000, random bf16, a tokenizer), imports its experts into an int4 bank and
measures, side by side on that checkpoint with 2 threads each, prefill
tokens/s (a 128-token prompt), decode tokens/s (32 greedy tokens), the
engine's RSS after load and peak, and qmoed's RSS and peak, for

  (a) transformers alone (the whole checkpoint in the engine),
  (b) transformers + qmoed through qmoe_client.transformers.from_pretrained
      (the experts never in the engine) at whole_bank and at a 50% and a 25%
      budget under next_use,
  (b0) the engine's own share: from_pretrained with every MoE layer answered
      by zeros at no cost (no call is made): what transformers spends on
      everything but the routed experts, so the ceiling of (b) and of any
      MoE backend behind this engine (--no-engine-share: not run),
  (c), (d) llama.cpp alone and llama.cpp + qmoed: bench/e2e/llama_cpp.py's
      rows(checkpoint_dir, shape_name, args) -> [row], when that file
      exists and --llama PREFIX is given (args: this script's parsed
      arguments: work, work_dir, threads, prompt, decode, keep, llama,
      rounds, precision, cgroup, and whatever llama_cpp.add_arguments(parser)
      adds when it defines one).

    $QMOE_TORCH_VENV/bin/python bench/e2e/run.py [--shapes A,B] [--keep]
        [--work DIR] [--build build] [--json OUT.json]

A progress line per stage goes to stderr; the table (markdown) to stdout.
Each engine runs in a process of its own (engine_row.py), each qmoed row on a
fresh daemon, one at a time, each after the checkpoint (and the bank) were
read through once: every row starts with them in the page cache, and the
engine copies its weights out of the checkpoint's mmap after the load
(engine_row.py's resident(): transformers keeps the tensors it needs not
convert, GPT-OSS's fused experts among them, as views of the mmap, whose
pages other processes' page cache evicts): the rows compare compute rather
than disk reads. Before a run that holds a whole checkpoint,
/proc/meminfo's MemAvailable is checked against what the run needs (the
checkpoint's bytes for transformers alone); while an engine runs, a watchdog
kills it if MemAvailable falls under 1 GiB. Either way the row says "does
not fit" with the figures: a finding, not a failure. Checkpoints and banks
(several GB) are deleted after their shape unless --keep.

A row is a dict with these keys (llama_cpp.py's rows too; None where a key
does not apply):
  shape        checkpoints.SHAPES name
  row          "a" | "b" | "b0" | "c" | "d"
  engine       "transformers" | "transformers + qmoed" | "llama.cpp" |
               "llama.cpp + qmoed"
  weights      what the engine and daemon compute with: "bf16",
               "bf16 + int4 bank", "Q4_0", ...
  policy       the session's policy (qmoed rows), else None
  budget       the budget as a fraction of the bank's expert bytes, else None
  threads      threads of the engine (and of qmoed)
  prefill_tokens, prefill_tok_s, decode_tokens, decode_tok_s
  engine_rss_after_load, engine_peak_rss           bytes
  qmoed_rss, qmoed_peak_rss                        bytes, qmoed rows only: the
               largest RSS sampled (every 0.2 s) while the engine ran, and VmHWM
  total_peak_rss  engine_peak_rss + qmoed_peak_rss (bytes)
  hit_rate     the session's expert hit rate (qmoed rows)
  hook_stats   qmoed rows: the hook's stats() (calls, hits, misses, bytes_paged,
               compute_us, queue_us, wall_s, wait_s, hit_rate)
  decode_call  row b: medians over the decode's layer calls (calls, hook_wall_us,
               wait_us, compute_us: engine_row.py's decode_call)
  status       "ok" | "does not fit" | "failed"
  note         one sentence: why a row did not run, or what it measured
"""
import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import checkpoints  # noqa: E402

KEYS = ("shape", "row", "engine", "weights", "policy", "budget", "threads", "prefill_tokens",
        "prefill_tok_s", "decode_tokens", "decode_tok_s", "engine_rss_after_load",
        "engine_peak_rss", "qmoed_rss", "qmoed_peak_rss", "total_peak_rss", "hit_rate",
        "hook_stats", "decode_call", "status", "note")
T0 = time.monotonic()
GIB = 1 << 30


def progress(msg):
    print("[e2e %6.0fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


def row(**kw):
    r = dict.fromkeys(KEYS)
    r.update(kw)
    return r


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


def proc_status(pid):
    """{VmRSS, VmHWM, RssAnon, RssFile, RssShmem} in bytes, or {}."""
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                k = line.split(":", 1)[0]
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(line.split()[1]) << 10
    except OSError:
        pass
    return out


def run_watched(cmd, floor=GIB, sample_pid=None):
    """Runs cmd (its stdout captured), killing it when MemAvailable falls
    under `floor`; every 0.2 s while it runs, samples sample_pid's
    proc_status. Returns (returncode, stdout, stderr tail, killed_at, the
    sample of the largest VmRSS) with killed_at the child's RSS when it was
    killed, else None."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, sample = [], [{}]

    def watch():
        while p.poll() is None:
            if sample_pid is not None:
                q = proc_status(sample_pid)
                if q.get("VmRSS", 0) > sample[0].get("VmRSS", 0):
                    sample[0] = q
            if mem_available() < floor:
                killed.append(proc_status(p.pid).get("VmRSS", 0))
                p.send_signal(signal.SIGKILL)
                return
            time.sleep(0.2)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        out, err = p.communicate()
    except BaseException:  # interrupted or terminated: the engine goes too
        p.kill()
        p.wait()
        raise
    w.join()
    return p.returncode, out, err[-3000:], (killed[0] if killed else None), sample[0]


def warm(paths):
    """Reads the files through once, so that every row starts with them in
    the page cache (as the bank is, fresh from its import): the rows then
    compare compute, not disk reads. Returns the bytes read."""
    n = 0
    buf = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                n += got
    return n


def checkpoint_files(d):
    return [os.path.join(d, f) for f in sorted(os.listdir(d))]


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


class Qmoed:
    def __init__(self, build, bank, name, threads, work):
        self.dir = tempfile.mkdtemp(prefix="qmoed-", dir=work)
        self.socket = os.path.join(self.dir, "qmoed.sock")
        cmd = [os.path.join(build, "daemon", "qmoed"), "--socket", self.socket, "--backend",
               "cpu", "--threads", str(threads), "--model", "%s=%s" % (name, bank),
               "--state-dir", os.path.join(self.dir, "state"), "--log-level", "warning"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(os.path.join(self.dir, "qmoed.log"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        import qmoe_client

        for _ in range(3000):
            if self.proc.poll() is not None:
                raise RuntimeError("qmoed exited with %d at start" % self.proc.returncode)
            try:
                qmoe_client.Client(self.socket, timeout=5).close()
                return
            except qmoe_client.DaemonNotRunning:
                time.sleep(0.02)
        raise RuntimeError("qmoed did not come up")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_cmd(a, ckpt, road, **kw):
    cmd = [sys.executable, os.path.join(HERE, "engine_row.py"), ckpt, "--road", road,
           "--threads", str(a.threads), "--prompt", str(a.prompt), "--decode", str(a.decode)]
    for k, v in kw.items():
        if v is not None:
            cmd += ["--" + k, str(v)]
    return cmd


def load_split(res):
    """What the engine's RSS after load is made of (engine_row.py's
    RssAnon and RssFile: the copies resident() made, and checkpoint pages
    still mapped), as a sentence, or "" from an engine_row.py without them."""
    if res.get("rss_after_load_anon") is None:
        return ""
    return "engine after load: %.2f GB anonymous, %.2f GB file" % (
        res["rss_after_load_anon"] / 1e9, res["rss_after_load_file"] / 1e9)


def engine_figures(r, res):
    r.update(prefill_tokens=res["prefill_tokens"],
             prefill_tok_s=res["prefill_tokens"] / res["prefill_s"],
             decode_tokens=res["decode_tokens"], decode_tok_s=res["decode_tokens"] / res["decode_s"],
             engine_rss_after_load=res["rss_after_load"], engine_peak_rss=res["peak_rss"])


def transformers_alone(a, shape, ckpt, ckpt_bytes):
    r = row(shape=shape, row="a", engine="transformers", weights="bf16", threads=a.threads)
    avail = mem_available()
    need = ckpt_bytes + GIB
    if avail < need:
        r.update(status="does not fit",
                 note="needs at least the checkpoint's %.1f GB + 1 GiB; %.1f GB available"
                      % (ckpt_bytes / 1e9, avail / 1e9))
        return r
    warm(checkpoint_files(ckpt))
    rc, out, err, killed, _ = run_watched(engine_cmd(a, ckpt, "full"))
    if killed is not None:
        r.update(status="does not fit",
                 note="killed at %.1f GB RSS when available memory fell under 1 GiB (%.1f GB "
                      "were available at the start)" % (killed / 1e9, avail / 1e9))
    elif rc != 0:
        r.update(status="failed", note=err.strip().splitlines()[-1] if err.strip() else str(rc))
    else:
        res = json.loads(out)
        engine_figures(r, res)
        r.update(status="ok", note=load_split(res) or None)
    return r


def with_qmoed(a, shape, ckpt, bank, budget):
    weights = "bf16 + int%d bank%s" % (a.bits, ", " + a.precision if a.precision else "")
    r = row(shape=shape, row="b", engine="transformers + qmoed", weights=weights,
            policy="whole_bank" if budget >= 1 else a.policy, budget=budget, threads=a.threads)
    warm(checkpoint_files(ckpt) + [bank])
    d = Qmoed(a.build, bank, "e2e", a.threads, a.work)
    try:
        kw = {"socket": d.socket, "model": "e2e", "precision": a.precision}
        if budget < 1:
            kw.update(policy=a.policy, budget="%g%%" % (100 * budget))
        rc, out, err, killed, q = run_watched(engine_cmd(a, ckpt, "qmoed", **kw),
                                              sample_pid=d.proc.pid)
        q["VmHWM"] = proc_status(d.proc.pid).get("VmHWM")
    finally:
        d.stop()
    if killed is not None:
        r.update(status="does not fit", note="killed at %.1f GB RSS when available memory fell "
                                             "under 1 GiB" % (killed / 1e9))
    elif rc != 0:
        r.update(status="failed", note=err.strip().splitlines()[-1] if err.strip() else str(rc))
    else:
        res = json.loads(out)
        engine_figures(r, res)
        r.update(qmoed_rss=q.get("VmRSS"), qmoed_peak_rss=q.get("VmHWM"),
                 total_peak_rss=res["peak_rss"] + q.get("VmHWM", 0),
                 hit_rate=res["hook"]["hit_rate"], hook_stats=res["hook"],
                 decode_call=res.get("decode_call"), status="ok",
                 note="qmoed's largest RSS sample while the engine ran: %.2f GB anonymous, "
                      "%.2f GB file (bank pages), %.2f GB shared%s%s"
                      % (q.get("RssAnon", 0) / 1e9, q.get("RssFile", 0) / 1e9,
                         q.get("RssShmem", 0) / 1e9,
                         "; " + load_split(res) if load_split(res) else "",
                         "; a decode layer call, median: %.0f µs in the hook, %.0f µs waiting, "
                         "%.0f µs of daemon compute" % (res["decode_call"]["hook_wall_us"],
                                                         res["decode_call"]["wait_us"],
                                                         res["decode_call"]["compute_us"])
                         if res.get("decode_call") else ""))
    return r


def engine_share(a, shape, ckpt, bank):
    """Row b0: the engine through from_pretrained, its MoE layers answered
    by zeros without a call (engine_row.py --road zero)."""
    r = row(shape=shape, row="b0", engine="transformers, MoE answered by zeros",
            weights="bf16, no experts", threads=a.threads)
    warm(checkpoint_files(ckpt))
    d = Qmoed(a.build, bank, "e2e", a.threads, a.work)
    try:
        rc, out, err, killed, _ = run_watched(engine_cmd(a, ckpt, "zero", socket=d.socket,
                                                         model="e2e"))
    finally:
        d.stop()
    if rc != 0 or killed is not None:
        r.update(status="failed", note=err.strip().splitlines()[-1] if err.strip() else str(rc))
    else:
        res = json.loads(out)
        engine_figures(r, res)
        r.update(status="ok", note="the ceiling of row b: the engine's time without the "
                                   "routed experts")
    return r


def import_bank(a, ckpt, bank):
    tool = os.path.join(a.build, "tools", "qmoe-bank", "qmoe-bank")
    t0 = time.monotonic()
    p = subprocess.Popen([tool, "import", "hf", ckpt, "--out", bank, "--bits", str(a.bits),
                          "--quiet"], stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("qmoe-bank import hf failed: %s" % err.strip()[-500:])
    return time.monotonic() - t0, usage.ru_maxrss << 10


def llama_module():
    path = os.path.join(HERE, "llama_cpp.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("e2e_llama_cpp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def llama_rows(a, ckpt, shape):
    """llama_cpp.rows(), each row given every key of KEYS: a missing one is
    None; the figures it names otherwise (engine_rss_gb, qmoed_rss_gb, quant)
    fill the table's columns."""
    mod = a.llama_module
    if mod is None:
        return []
    if not a.llama:
        progress("%s: llama.cpp rows skipped: no --llama PREFIX (clients/llama.cpp/build.sh)"
                 % shape)
        return []
    progress("%s: llama.cpp rows (bench/e2e/llama_cpp.py)" % shape)
    out = []
    for r in mod.rows(ckpt, shape, a):
        r = dict(r)
        eng = r.get("engine") or ""
        r.setdefault("row", "d" if "qmoed" in eng else "c")
        r.setdefault("weights", r.get("quant"))
        for mine, theirs in (("engine_peak_rss", "engine_rss_gb"), ("qmoed_rss", "qmoed_rss_gb")):
            if r.get(mine) is None and r.get(theirs) is not None:
                r[mine] = r[theirs] * 1e9
        r.setdefault("status", "ok")
        full = row(shape=shape)
        full.update(r)
        out.append(full)
    return out


def run_shape(a, shape):
    rows = []
    ckpt = os.path.join(a.work, shape)
    bank = os.path.join(a.work, shape + ".bank")
    cfg = checkpoints.shape_config(shape, a.layers)
    ex, other = checkpoints.sizes(cfg)
    try:
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            progress("%s: building the checkpoint (%.1f GB of experts, %.2f GB of the rest)"
                     % (shape, ex / 1e9, other / 1e9))
            checkpoints.build(shape, ckpt, a.layers)
        ckpt_bytes = dir_bytes(ckpt)
        if not os.path.exists(bank):
            progress("%s: importing its experts into an int%d bank" % (shape, a.bits))
            dt, peak = import_bank(a, ckpt, bank)
            progress("%s: bank of %.2f GB in %.0f s (qmoe-bank peak RSS %.2f GB)"
                     % (shape, os.path.getsize(bank) / 1e9, dt, peak / 1e9))
        if not a.skip_alone:
            progress("%s: (a) transformers alone (%.1f GB available)" % (shape, mem_available() / 1e9))
            rows.append(transformers_alone(a, shape, ckpt, ckpt_bytes))
            progress("%s: (a) %s" % (shape, rows[-1]["status"]))
        for budget in a.budgets:
            progress("%s: (b) transformers + qmoed at %s" % (
                shape, "whole_bank" if budget >= 1 else "%g%% (%s)" % (100 * budget, a.policy)))
            rows.append(with_qmoed(a, shape, ckpt, bank, budget))
            progress("%s: (b) %s" % (shape, rows[-1]["status"]))
        if a.engine_share:
            progress("%s: (b0) the engine's own share (MoE layers answered by zeros)" % shape)
            rows.append(engine_share(a, shape, ckpt, bank))
            progress("%s: (b0) %s" % (shape, rows[-1]["status"]))
        rows += llama_rows(a, ckpt, shape)
    finally:
        if not a.keep:
            progress("%s: removing the checkpoint and the bank" % shape)
            shutil.rmtree(ckpt, ignore_errors=True)
            if os.path.exists(bank):
                os.unlink(bank)
    return rows


def gb(b):
    return "%.2f GB" % (b / 1e9) if b is not None else "—"


def num(x, fmt="%.1f"):
    return fmt % x if x is not None else "—"


def table(rows):
    lines = ["| shape | row | engine | policy, budget | prefill tok/s | decode tok/s | engine RSS "
             "after load | engine peak | qmoed RSS (peak) | engine + qmoed peak | hit rate | "
             "status |", "|" + "---|" * 12]
    for r in rows:
        pb = "—" if r["policy"] is None else (
            r["policy"] if r["budget"] is None or r["budget"] >= 1
            else "%s %g%%" % (r["policy"], 100 * r["budget"]))
        q = "—" if r["qmoed_rss"] is None else "%s (%s)" % (gb(r["qmoed_rss"]),
                                                            gb(r["qmoed_peak_rss"]))
        st = r["status"] if r["status"] == "ok" else "%s: %s" % (r["status"], r["note"])
        lines.append("| %s | %s | %s (%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["shape"], r["row"], r["engine"], r["weights"], pb, num(r["prefill_tok_s"]),
            num(r["decode_tok_s"], "%.2f"), gb(r["engine_rss_after_load"]),
            gb(r["engine_peak_rss"]), q, gb(r["total_peak_rss"]),
            num(r["hit_rate"], "%.3f"), st))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(checkpoints.SHAPES),
                    help="comma-separated, of %s" % ", ".join(checkpoints.SHAPES))
    ap.add_argument("--work", default=None, help="where checkpoints and banks go (a temp dir); "
                    "what it held before the run is left there")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and banks")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--layers", type=int, default=checkpoints.LAYERS)
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--policy", default="next_use", help="the policy of the budgeted rows")
    ap.add_argument("--budgets", default="1,0.5,0.25",
                    help="fractions of the bank's expert bytes (1 = whole_bank)")
    ap.add_argument("--skip-alone", action="store_true", help="no transformers-alone row")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--llama", help="llama.cpp PREFIX (clients/llama.cpp/build.sh) for rows c, d")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the llama.cpp rows")
    ap.add_argument("--precision", choices=("exact", "fast"),
                    help="of the qmoed rows, b and d (default: the daemon's, exact)")
    ap.add_argument("--no-engine-share", dest="engine_share", action="store_false",
                    help="no b0 row (the engine with its MoE layers answered by zeros)")
    ap.add_argument("--cgroup", action="store_true", help="llama.cpp's memory-capped comparison")
    mod = llama_module()
    if mod is not None and hasattr(mod, "add_arguments"):
        mod.add_arguments(ap)
    a = ap.parse_args(argv)
    a.llama_module = mod
    a.budgets = [float(b) for b in a.budgets.split(",")]
    shapes = a.shapes.split(",")
    for s in shapes:
        if s not in checkpoints.SHAPES:
            ap.error("unknown shape %r (%s)" % (s, ", ".join(checkpoints.SHAPES)))
    # What was in --work before the run stays: only what the run made goes.
    before = None
    if a.work is None:
        a.work = tempfile.mkdtemp(prefix="qmoe-e2e-", dir="/var/tmp")
    elif os.path.isdir(a.work):
        before = set(os.listdir(a.work))
    os.makedirs(a.work, exist_ok=True)
    a.work_dir = a.work
    # SIGTERM (and SIGINT, which a background job ignores) end the run
    # through its finally blocks: the engine and qmoed stopped, files removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rows = []
    try:
        for s in shapes:
            rows += run_shape(a, s)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        if not a.keep and before is None:
            shutil.rmtree(a.work, ignore_errors=True)
        elif not a.keep:
            keep = os.path.abspath(a.json) if a.json else None
            for name in set(os.listdir(a.work)) - before:
                path = os.path.join(a.work, name)
                if os.path.abspath(path) == keep:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
