#!/usr/bin/env python3
"""The capped sweep (issue 38, item 6): a model larger than the memory it is
given, llama.cpp alone against llama.cpp + qmoed with --qmoed-budget auto,
in memory cgroups capped at 1/2, 1/3 and 1/4 of the GGUF, per model shape;
one command, one table, one figure.

    $QMOE_TORCH_VENV/bin/python bench/e2e/capped_sweep.py --llama PREFIX
        [--shapes qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b] [--caps 1/2,1/3,1/4]
        [--prompt 16] [--decode 32] [--rounds N] [--work DIR] [--keep] [--direct-q8]
        [--variant NAME:KEY=VALUE ...] [--no-alone] [--no-midrun] [--load-mode MODE]
        [--json OUT.json] [--md OUT.md] [--png docs/capped_sweep.png]

Per shape (bench/e2e/checkpoints.py's real-config checkpoint, 8 layers): the
Q4_0 GGUF made with llama.cpp's converter and llama-quantize, its exact int4
bank (`qmoe-bank import gguf`) (--quant mxfp4_moe: the experts in MXFP4, as
GPT-OSS ships, requantised from it, and its e2m1 code-book bank), then:

- the disk, measured in the same run: fio O_DIRECT random reads of the
  bank, one expert unit per read (bytes_per_expert rounded up to 4 KiB), at
  qmoed's queue depth (--iodepth, default 32: qmoed's io_depth, which the
  daemons here are given too), io_uring (libaio, then psync, when refused;
  bench/paging_disk/io_bench.py's fio);
- uncapped: llama.cpp alone (mmap) and llama.cpp + qmoed whole_bank, the
  references (the overlapped bound's compute time is the uncapped qmoed
  decode's);
- for each cap C x the GGUF's bytes, each row in a fresh memory cgroup
  (root, cgroup v1 or v2: tests/daemon/qmoed_memcg.py) with the GGUF's and
  the bank's page cache dropped first (posix_fadvise DONTNEED on the two
  files): llama.cpp alone with mmap (`--repack 0`: its default repacking
  copies the weights into anonymous memory, which a cap below the GGUF
  OOM-kills, measured after 5.5 minutes of thrashing; --alone-repack 1 runs
  it anyway), then a fresh qmoed moved into the group (paging_source
  direct, auto_budget_reserve left at qmoed's default, as a user runs it,
  or --reserve BYTES) and llama.cpp + qmoed with `--qmoed-policy next_use
  --qmoed-budget auto` in the group too (--load-mode MODE: its llama-bench
  loads the weights so, `-lm MODE`; `none` reads them into memory before
  the session is made, where auto counts them, instead of mapping them).

- the target of issue 38 (unless --no-midrun), at the first cap: the
  cgroup's limit lowered while llama-completion decodes, by half of what the
  auto budget took, a third of the reserve every half second (a hard limit
  lowered past unreclaimable memory at once is refused by cgroup v1 and
  OOM-kills on v2, before any watcher can act): the row says whether the
  run finished, with no OOM kill, the budget shrunk (logged) and its tokens
  those of an uncapped whole_bank run.

Each llama.cpp run is `llama-bench -t THREADS -r 1`, twice: `-p PROMPT -n 0`
(prefill) and `-p 0 -n DECODE` (decode); qmoed's daemon-wide counters
(telemetry.get) around the decode run give its expert hit rate, the bytes
read from the bank per decode token, the stall per token, and the reads a
token needed: its misses plus its prefetched experts that were used
(prefetch_useful: a hit, but a read all the same). Their bytes (x
bytes_per_expert) at the disk's rate are the row's I/O bound:
io_bound_tok_s = rate / (reads needed per token x bytes_per_expert) (reads
alone; a wasted prefetch is not needed, and counts against the row; the
rate is fio's, or the one the row's reads ran at when that was faster, in
flight (qmoed's disk_bytes_read / disk_busy_us) or over the decode: fio
then fell short of the disk),
overlapped_bound_tok_s = 1 / max(that time, the uncapped qmoed decode's time
per token): every read overlapped with compute, which needs every miss
foreseen a call ahead. The row also gives the rate its reads ran at while
in flight (qmoed's disk_bytes_read / disk_busy_us) and over the decode
(bytes read per token x tokens/s), beside fio's.
The demand-only bound: what a pager that reads nothing before a call asks
for could reach with the row's own misses, call by call (the decode
session's session.infer spans, telemetry.trace): each call's misses read
from its start at the row's disk rate one after another, overlapped only
with the compute of its resident experts (that share of the uncapped
decode's median compute a call), on top of the uncapped decode's time a
token. A row near it has no waste in its reads' mechanics; what lies
between it and the overlapped bound is foresight (prefetch that is right).
What no policy could beat on the row's own routing: each capped qmoed
row's daemon records its sessions' routing (record_routing), and the
decode run's trace goes through Belady's MIN (tools/qmoe_trace.py
min_loads) at the row's budget and at a budget of the whole cap, in expert
units: MIN's hit rate from a cold cache, and the most tok/s any eviction or
prefetch could reach, MIN's loads a token past the first fill (the best
starting cache) at the row's disk rate, at most the uncapped decode. No
policy, prefetching or not, loads fewer experts into the same places.
With --rounds N the uncapped qmoed row and every capped qmoed row run N
times, the caps' order and the uncapped row's place (first, then last)
reversed every other round, llama.cpp alone once: a row's decode and
prefill are the medians of its rounds, its counters and bounds those of
its median round (bounds against that round's uncapped decode), and "x
uncapped" the median of each round's ratio to the uncapped decode of the
same round (the JSON keeps every round's decode and ratio): a capped row
moves by 10-20% between runs an hour apart on these hosts, a ratio taken
within a round much less.
Every row also records its cgroup's OOM kills. Each --variant NAME:KEY=VALUE
adds, per cap, a "llama.cpp + qmoed, NAME" row whose qmoed runs with --set
KEY=VALUE (e.g. no-trial:prefetch_trial=false; several settings separated
by commas: NAME:K1=V1,K2=V2), the qmoed rows of a cap in
turns (the order reversed every other cap); --no-alone leaves the
llama.cpp alone rows out (an A/B of qmoed rows alone).

Writes the rows as JSON (--json), the markdown table (stdout and --md),
then one line per shape and cap for the default qmoed row (x its uncapped
decode, x llama.cpp alone in the same cap, share of the overlapped bound,
and issue 38's targets at 1/3 and 1/2, met or missed), and the figure
(--png, matplotlib): decode tok/s against the memory given (the
cap as a fraction of the GGUF; uncapped at the right), llama.cpp alone
dashed and llama.cpp + qmoed solid, one colour per shape. Runs as root (the
cgroups). The checkpoints, GGUFs and banks go after their shape unless
--keep (the Mixtral shape needs ~23 GB of checkpoint, its GGUF path another
~25 GB unless --direct-q8).
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "daemon"))
sys.path.insert(0, os.path.join(ROOT, "bench", "paging_disk"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import checkpoints  # noqa: E402
import llama_cpp  # noqa: E402
import qmoe_trace  # noqa: E402
from qmoed_memcg import MemCgroup  # noqa: E402

GB = 1e9
SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")
T0 = time.monotonic()
# The daemon's log line of each session it creates (daemon/qm_sessions.c).
CREATED_RE = re.compile(r"session \S+ created: model \S+, policy \S+, budget (\d+)"
                        r"(?: \((budget auto: .*?)\))?, uid")


def progress(msg):
    print("[sweep %6.0fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


def fraction(text):
    """"1/3" or "0.333" -> float in (0, 1]."""
    if "/" in text:
        n, d = text.split("/", 1)
        v = float(n) / float(d)
    else:
        v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError("a cap is a fraction of the GGUF in (0, 1], not %r" % text)
    return v


# ---- the disk ----

def disk_rate(path, block, iodepth, seconds):
    """fio's O_DIRECT random-read rate of `path` at `block` bytes per read and
    `iodepth` reads in flight (bench/paging_disk/io_bench.py's fio): (bytes/s,
    what ran, the engine), or (None, why, None)."""
    import io_bench
    llama_cpp.drop_cached([path])
    got = io_bench.fio(path, "qmoed-units", "randread", iodepth, seconds, block=block)
    if not got:
        return None, "fio is missing or failed on %s (scripts/setup.sh installs it)" % path, None
    what = "fio --filename=%s --readonly --direct=1 --rw=randread --bs=%d --iodepth=%d --ioengine=%s " \
           "--runtime=%d --time_based" % (path, block, iodepth, got[1], seconds)
    return float(got[0]), what, got[1]


# ---- one llama-bench phase, with qmoed's counters around it ----

def daemon_counters(sock):
    if not sock:
        return None
    from qmoed_harness import Client
    c = Client(sock)
    try:
        return c.call("telemetry.get")["daemon"]
    finally:
        c.close()


def session_calls(sock):
    """The last session's layer calls, oldest first, from the daemon's trace
    (telemetry.trace's session.infer spans; the ring holds trace_capacity,
    4096, of them): (hits, misses, compute_us) each, or None."""
    from qmoed_harness import Client
    c = Client(sock)
    try:
        spans = [s for s in c.call("telemetry.trace")["spans"] if s["name"] == "session.infer"]
    finally:
        c.close()
    if not spans:
        return None
    last = spans[-1]["session"]
    return [(s["args"].get("hits", 0), s["args"].get("misses", 0), s["args"].get("compute_us", 0))
            for s in spans if s["session"] == last]


def phase(a, gguf, extra, prefix, dm, prompt, decode):
    """One llama-bench run: its result (llama_cpp.llama_bench's dict) with the
    daemon's counters' growth over it ("delta") and the session line's
    budget ("budget", "budget_auto")."""
    before = daemon_counters(dm.socket if dm else None)
    r = llama_cpp.llama_bench(a, gguf, extra, cmd_prefix=prefix, daemon_pid=dm.proc.pid if dm else None,
                              prompt=prompt, decode=decode, timeout=a.row_timeout)
    after = daemon_counters(dm.socket if dm else None) if dm and dm.proc.poll() is None else None
    if after and decode:
        r["calls"] = session_calls(dm.socket)
    if before and after:
        r["delta"] = {k: after[k] - before[k] for k in after
                      if isinstance(after[k], (int, float)) and k in before}
    created = CREATED_RE.findall(dm.log_text()) if dm else []
    if created:  # this run's session: the last one made
        r["budget"] = int(created[-1][0])
        r["budget_auto"] = created[-1][1] or None
    return r


def per_token(delta, layers):
    """Per token, from the daemon's counters: tokens counts each layer call's
    rows, so a token is `layers` of them."""
    if not delta or not delta.get("tokens"):
        return None
    n = delta["tokens"] / layers
    hits, misses = delta.get("expert_hits", 0), delta.get("expert_misses", 0)
    row = {"tokens": n, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "misses_per_token": misses / n, "bytes_read_per_token": delta.get("bytes_read_disk", 0) / n,
            "stall_us_per_token": delta.get("stall_us", 0) / n, "auto_shrinks": delta.get("auto_shrinks", 0),
            "auto_grows": delta.get("auto_grows", 0), "auto_relapses": delta.get("auto_relapses", 0),
            "disk_busy_bytes_per_s": (delta.get("bytes_read_disk", 0) * 1e6 / delta["disk_busy_us"]
                                      if delta.get("disk_busy_us") else None),
            "prefetch_per_token": delta.get("prefetch_issued", 0) / n,
            "prefetch_useful_per_token": delta.get("prefetch_useful", 0) / n,
            "router_precision": (delta.get("predict_router_correct", 0) /
                                 delta["predict_router_predicted"]
                                 if delta.get("predict_router_predicted") else None)}
    for src in ("router", "history", "lookahead"):  # which predictor read what
        row["prefetch_%s_per_token" % src] = delta.get("prefetch_%s_issued" % src, 0) / n
        row["prefetch_%s_useful_per_token" % src] = delta.get("prefetch_%s_useful" % src, 0) / n
        pred = delta.get("predict_%s_predicted" % src)
        row["%s_precision" % src] = delta.get("predict_%s_correct" % src, 0) / pred if pred else None
    return row


# ---- rows ----

def cold_or_warm(cap, paths):
    """A capped row starts with the files out of the page cache (what it
    reads, it reads from disk under its cap); an uncapped one with them read
    through once (the reference: compute, not the disk)."""
    if cap:
        llama_cpp.drop_cached(paths)
    else:
        llama_cpp.warm(paths)


def base_row(shape, engine, cap, gguf_bytes):
    return {"shape": shape, "engine": engine, "cap_fraction": cap,
            "cap_bytes": int(cap * gguf_bytes) if cap else None, "gguf_bytes": gguf_bytes,
            "prefill_tok_s": None, "decode_tok_s": None, "budget_bytes": None, "budget_auto": None,
            "hit_rate": None, "bytes_read_per_token": None, "stall_us_per_token": None,
            "misses_per_token": None, "io_bound_tok_s": None, "overlapped_bound_tok_s": None,
            "engine_peak_anon": None, "engine_peak_file": None, "qmoed_peak_rss": None,
            "oom_kills": None, "auto_shrinks": None, "auto_grows": None, "auto_relapses": None,
            "status": "ok", "note": None}


def finish_row(row, pre, dec):
    for r, key in ((pre, "prefill_tok_s"), (dec, "decode_tok_s")):
        if r["rc"] != 0:
            row["status"] = "failed"
            tail = r["log_tail"].strip().splitlines()
            row["note"] = "%s exited %s%s" % (key.split("_")[0], r["rc"], ": " + tail[-1][:160] if tail else "")
        else:
            row[key] = r.get(key)
    row["engine_peak_anon"] = max(pre["engine"]["RssAnon"], dec["engine"]["RssAnon"])
    row["engine_peak_file"] = max(pre["engine"]["RssFile"], dec["engine"]["RssFile"])
    if dec.get("daemon"):
        row["qmoed_peak_rss"] = max(pre["daemon"]["VmRSS"], dec["daemon"]["VmRSS"])
    row["budget_bytes"] = dec.get("budget", pre.get("budget"))
    row["budget_auto"] = dec.get("budget_auto", pre.get("budget_auto"))
    return row


def routing_of(path):
    """A recorded trace as the sequence MIN replays (qmoe_trace.access_sequence)."""
    tr = qmoe_trace.read_trace(path)
    return {"tokens": tr.tokens, "layers": tr.layers, "k": tr.k, "experts": tr.experts,
            "seq": qmoe_trace.access_sequence(tr)}


def belady_bounds(row, unit, rate, uncapped_tok_s):
    """What no eviction or prefetch could beat on this row's own routing
    (the decode run's recorded trace), at the row's budget and at a budget
    of the whole cap: Belady's MIN loads, with the first fill free (the
    best cache the run could have started with), each a read of `unit`
    bytes at the row's disk rate; no policy, prefetching or not, loads
    fewer experts into the same places. The bound in tok/s is that
    reading's rate, at most the uncapped decode (compute)."""
    tr = row.get("routing_trace")
    seq = tr.pop("seq", None) if tr else None
    if not seq or not tr["tokens"] or not rate:
        return
    accesses = len(seq)
    out = {"tokens": tr["tokens"], "accesses": accesses}
    for key, budget in (("budget", row.get("budget_bytes")), ("cap", row.get("cap_bytes"))):
        if not budget:
            continue
        slots = max(1, int(budget // unit))
        loads, fill = qmoe_trace.min_loads(seq, slots)
        warm = loads - fill
        io_s = warm * unit / rate / tr["tokens"]
        bound = 1 / io_s if io_s > 0 else None
        if uncapped_tok_s:
            bound = min(bound, uncapped_tok_s) if bound else uncapped_tok_s
        out[key] = {"slots": slots, "min_loads": loads, "min_hit_rate": 1 - loads / accesses,
                    "min_warm_loads_per_token": warm / tr["tokens"], "bound_tok_s": bound,
                    "bound_x_uncapped": bound / uncapped_tok_s if bound and uncapped_tok_s else None}
    row["belady"] = out


def demand_bound(row, unit, ref, layers):
    """The demand-only bound (module doc): the decode a pager that reads
    nothing before a call asks for it could reach with this row's misses,
    call by call: each call's misses read from its start at the row's disk
    rate, one after another (more in flight gain nothing on a throttled
    disk), overlapped with the compute of its resident experts (the
    uncapped decode's median compute a call, that share of it), on top of
    the uncapped decode's time a token."""
    calls, ref_calls = row.get("calls"), ref.get("calls")
    rate = row.get("bound_disk_bytes_per_s")
    if not calls or not ref_calls or not rate or not ref.get("decode_tok_s"):
        return
    c_ref = statistics.median(c for _, _, c in ref_calls)
    read_us = unit / rate * 1e6
    wait_us = sum(max(0.0, m * read_us - c_ref * h / (h + m)) for h, m, _ in calls if h + m)
    t = 1 / ref["decode_tok_s"] + wait_us / 1e6 / (len(calls) / layers)
    row["demand_bound_tok_s"] = 1 / t


def io_bounds(row, unit, rate, compute_s):
    """The row's I/O bound (module doc) from its counters, the expert unit,
    fio's rate (raised to the row's own when that was faster) and the
    uncapped qmoed decode's time per token."""
    if row["misses_per_token"] is None or not rate:
        return
    row["reads_needed_per_token"] = row["misses_per_token"] + (row.get("prefetch_useful_per_token") or 0)
    # The disk's rate: fio's, or what the row's own reads ran at when that
    # was faster (fio then fell short of the disk): while they were in
    # flight (qmoed's disk_bytes_read / disk_busy_us), or over the decode.
    seen = (row.get("bytes_read_per_token") or 0) * (row.get("decode_tok_s") or 0)
    rate = max(rate, seen, row.get("disk_busy_bytes_per_s") or 0)
    row["bound_disk_bytes_per_s"] = rate
    io_s = row["reads_needed_per_token"] * unit / rate
    row["io_s_per_token"] = io_s
    row["io_bound_tok_s"] = 1 / io_s if io_s > 0 else None
    if compute_s:
        row["overlapped_bound_tok_s"] = 1 / max(io_s, compute_s)


def alone(a, shape, gguf, gguf_bytes, cap):
    row = base_row(shape, "llama.cpp", cap, gguf_bytes)
    extra = [] if cap is None or a.alone_repack else ["--repack", "0"]
    g = MemCgroup(cap * gguf_bytes, prefix="qmoe-sweep") if cap else None
    try:
        cold_or_warm(cap, [gguf])
        prefix = g.prefix() if g else ()
        pre = phase(a, gguf, extra, prefix, None, a.prompt, 0)
        dec = phase(a, gguf, extra, prefix, None, 0, a.decode)
        row["oom_kills"] = g.oom_kills() if g else None
    finally:
        if g:
            g.remove()
    finish_row(row, pre, dec)
    if row["status"] == "ok":
        row["note"] = "mmap%s" % (", --repack 0" if extra else "")
    return row


# qmoed's auto_budget_reserve when none is set (daemon/qm_config.c): the
# midrun row's limit steps are a third of it.
QMOED_DEFAULT_RESERVE = 256 << 20


def reserve_args(reserve):
    """qmoed's arguments for --reserve: none for its default."""
    return [] if reserve is None else ["--set", "auto_budget_reserve=%d" % reserve]


def with_qmoed(a, shape, gguf, bank, name, gguf_bytes, cap, reserve, layers, variant=None):
    from qmoed_harness import Daemon
    row = base_row(shape, "llama.cpp + qmoed" + (", " + variant[0] if variant else ""), cap, gguf_bytes)
    args = ["--threads", str(a.threads), "--log-level", "info", "--set", "paging_source=direct",
            "--set", "io_depth=%d" % a.iodepth] + reserve_args(reserve)
    if variant:
        for kv in variant[1].split(","):
            args += ["--set", kv]
    g = MemCgroup(cap * gguf_bytes, prefix="qmoe-sweep") if cap else None
    dm = None
    work = tempfile.mkdtemp(prefix="qmoed-sweep-", dir=a.work)
    state = os.path.join(work, "state")
    os.mkdir(state)
    if cap:  # the sessions' real routing, for Belady's MIN at the row's budget
        args += ["--state-dir", state, "--set", "record_routing=true"]
    try:
        cold_or_warm(cap, [gguf, bank])
        dm = Daemon(models={name: bank}, args=args, workdir=work)
        if g:
            g.add(dm.proc.pid)
        extra = ["--qmoed", dm.socket] + (["-lm", a.load_mode] if a.load_mode else [])
        extra += ["--qmoed-policy", a.policy, "--qmoed-budget", "auto"] if cap else []
        if a.precision:
            extra += ["--qmoed-precision", a.precision]
        prefix = g.prefix() if g else ()
        pre = phase(a, gguf, extra, prefix, dm, a.prompt, 0)
        dec = phase(a, gguf, extra, prefix, dm, 0, a.decode)
        row["oom_kills"] = g.oom_kills() if g else None
        row["daemon_alive"] = dm.proc.poll() is None
    finally:
        if dm:
            dm.stop()
        if g:
            g.remove()
        # The decode run's session: the trace written last.
        traces = sorted((os.path.getmtime(os.path.join(state, f)), f) for f in os.listdir(state)
                        if f.startswith("routing-") and f.endswith(".qmtr"))
        row["routing_trace"] = routing_of(os.path.join(state, traces[-1][1])) if traces else None
        shutil.rmtree(work, ignore_errors=True)
    finish_row(row, pre, dec)
    row["calls"] = dec.get("calls")
    pt = per_token(dec.get("delta"), layers)
    if pt:
        for k in ("hit_rate", "misses_per_token", "bytes_read_per_token", "stall_us_per_token",
                  "auto_shrinks", "auto_grows", "auto_relapses", "prefetch_per_token", "prefetch_useful_per_token", "disk_busy_bytes_per_s",
                  "router_precision"):
            row[k] = pt[k]
        row["prefetch_sources"] = {k: v for k, v in pt.items()
                                   if k.startswith("prefetch_") and k.split("_")[1] in
                                   ("router", "history", "lookahead") or k.endswith("_precision")}
    if row["status"] == "ok":
        row["note"] = ("%s, --qmoed-budget auto (reserve %s), O_DIRECT" % (
            a.policy, "%.2f GB" % (reserve / GB) if reserve is not None else "qmoed's default")
                       if cap else "whole_bank, uncapped")
        if a.load_mode:
            row["note"] += ", -lm " + a.load_mode
    return row


def completion(a, gguf, extra, prefix=()):
    """Greedy llama-completion of a fixed prompt: (Popen, its stdout file).
    Bytes: a random-weights model prints pieces of UTF-8 characters."""
    out = tempfile.TemporaryFile(mode="w+b")
    cmd = list(prefix) + [os.path.join(a.llama, "bin", "llama-completion"), "-m", gguf,
                          "-p", "Once upon a time", "-n", str(a.midrun_tokens), "--temp", "0",
                          "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup",
                          "-t", str(a.threads), "-c", "256", "--simple-io"] + list(extra)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL), out


def finished_text(proc, out, timeout):
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    out.seek(0)
    return rc, out.read()


def midrun(a, shape, gguf, bank, name, gguf_bytes, cap, reserve):
    """The target of issue 38: a cap lowered mid-run to half of what the auto
    budget took (in steps of a third of the reserve, every half second, as a
    controller would: a hard limit lowered past unreclaimable memory at once
    is refused on v1 and OOM-kills on v2), while llama-completion decodes;
    the run must finish with no OOM kill, the budget shrunk (logged), and
    its tokens those of an uncapped whole_bank run."""
    from qmoed_harness import Daemon
    row = base_row(shape, "llama.cpp + qmoed, cap lowered mid-run", cap, gguf_bytes)
    dm = Daemon(models={name: bank}, args=["--threads", str(a.threads)])
    try:
        ref_rc, ref = finished_text(*completion(a, gguf, ["--qmoed", dm.socket]), a.row_timeout)
    finally:
        dm.stop()
        shutil.rmtree(dm.dir, ignore_errors=True)
    g = MemCgroup(cap * gguf_bytes, prefix="qmoe-sweep")
    limit = cur = g.limit()
    dm = None
    try:
        llama_cpp.drop_cached([gguf, bank])
        dm = Daemon(models={name: bank}, args=["--threads", str(a.threads), "--log-level", "info",
                                               "--set", "paging_source=direct", "--set",
                                               "io_depth=%d" % a.iodepth, "--set",
                                               "auto_budget_check_ms=200", "--set",
                                               "auto_budget_grow_after_s=3600"] + reserve_args(reserve))
        g.add(dm.proc.pid)
        proc, out = completion(a, gguf, ["--qmoed", dm.socket, "--qmoed-policy", a.policy,
                                         "--qmoed-budget", "auto"], g.prefix())
        took, deadline = None, time.time() + a.row_timeout
        while took is None and proc.poll() is None and time.time() < deadline:
            created = CREATED_RE.findall(dm.log_text())
            took = int(created[-1][0]) if created else None
            time.sleep(0.05)
        refused = 0
        if took:
            goal = limit - took // 2
            step = max((reserve if reserve is not None else QMOED_DEFAULT_RESERVE) // 3, 16 << 20)
            while cur > goal and proc.poll() is None:
                try:
                    g.set_limit(max(goal, cur - step))
                    cur = g.limit()
                except OSError:
                    refused += 1
                time.sleep(0.5)
        rc, text = finished_text(proc, out, max(1, deadline - time.time()))
        t = daemon_counters(dm.socket) if dm.proc.poll() is None else {}
        row.update({"budget_bytes": took, "limit_before": limit, "limit_after": cur,
                    "limit_writes_refused": refused, "auto_shrinks": t.get("auto_shrinks"),
                    "oom_kills": g.oom_kills(), "tokens_equal": rc == 0 and ref_rc == 0 and text == ref,
                    "shrink_logged": bool(re.search(r"auto budget shrank", dm.log_text())),
                    "lowered_by_half": took is not None and cur <= limit - took // 2})
        # The run must finish, unkilled, with its tokens; the target also
        # wants the budget shrunk, which a reserve as large as the lowering
        # absorbs instead (said, not failed).
        ok = row["tokens_equal"] and row["oom_kills"] == 0 and row["lowered_by_half"]
        row["status"] = "ok" if ok else "failed"
        row["target_met"] = ok and row["shrink_logged"]
        row["note"] = ("limit %.2f -> %.2f GB while decoding %d tokens: %s shrinks%s, %d OOM kills, "
                       "tokens %s" % (limit / GB, cur / GB, a.midrun_tokens, row["auto_shrinks"],
                                      "" if row["shrink_logged"] else " (the reserve absorbed it)",
                                      row["oom_kills"],
                                      "unchanged" if row["tokens_equal"] else "DIFFERENT (rc %d)" % rc))
    finally:
        if dm:
            dm.stop()
            shutil.rmtree(dm.dir, ignore_errors=True)
        g.remove()
    return row


def median_row(rounds, refs):
    """One row of its rounds (--rounds): the round whose decode is the
    median's (the lower middle of an even count) gives the row's counters
    and bounds; decode and prefill are the medians of every round's, and
    x uncapped the median of each round's decode over the uncapped qmoed
    decode of the same round (refs[i]: a row with that round's
    decode_tok_s); the share of the overlapped bound likewise, each round's
    decode over its own bound. A single round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    ok = sorted(((r, ref) for r, ref in zip(rounds, refs) if r["decode_tok_s"]),
                key=lambda p: p[0]["decode_tok_s"])
    row = dict(ok[(len(ok) - 1) // 2][0] if ok else rounds[0])
    row["rounds"] = len(rounds)
    row["decode_rounds"] = [r["decode_tok_s"] for r in rounds]
    row["prefill_rounds"] = [r["prefill_tok_s"] for r in rounds]
    dec = [r["decode_tok_s"] for r, _ in ok]
    pre = [r["prefill_tok_s"] for r in rounds if r["prefill_tok_s"]]
    row["decode_tok_s"] = statistics.median(dec) if dec else None
    row["prefill_tok_s"] = statistics.median(pre) if pre else None
    pairs = [r["decode_tok_s"] / ref["decode_tok_s"] for r, ref in ok if ref.get("decode_tok_s")]
    row["x_uncapped_rounds"] = pairs
    row["x_uncapped"] = statistics.median(pairs) if pairs else None
    shares = [r["decode_tok_s"] / r["overlapped_bound_tok_s"] for r, _ in ok
              if r.get("overlapped_bound_tok_s")]
    row["bound_share_rounds"] = shares
    row["bound_share"] = statistics.median(shares) if shares else None
    dshares = [r["decode_tok_s"] / r["demand_bound_tok_s"] for r, _ in ok
               if r.get("demand_bound_tok_s")]
    row["demand_share_rounds"] = dshares
    row["demand_share"] = statistics.median(dshares) if dshares else None
    failed = len(rounds) - len(ok)
    if failed and ok:
        row["note"] = "%s; %d of %d rounds failed" % (row["note"] or "", failed, len(rounds))
    return row


def run_shape(a, shape):
    rows = []
    ckpt = os.path.join(a.work, shape)
    made = []
    try:
        have_gguf = os.path.exists(os.path.join(a.work, "%s.%s.gguf" % (shape, a.quant)))
        if not have_gguf and not os.path.exists(os.path.join(ckpt, "config.json")):
            ex, other = checkpoints.sizes(checkpoints.shape_config(shape, a.layers))
            progress("%s: building the checkpoint (%.1f GB of experts, %.2f GB of the rest, bf16)"
                     % (shape, ex / GB, other / GB))
            checkpoints.build(shape, ckpt, a.layers)
            made.append(ckpt)
        progress("%s: the %s GGUF (llama.cpp's converter, llama-quantize)"
                 % (shape, a.quant.upper()))
        gguf = llama_cpp.make_ggufs(a, ckpt, shape)[a.quant]
        made.append(gguf)
        if not a.keep:  # the GGUF is all the rest needs
            shutil.rmtree(ckpt, ignore_errors=True)
        bank = llama_cpp.make_bank(gguf)
        made.append(bank)
        name = os.path.basename(gguf)[:-len(".gguf")]
        exp, rest = llama_cpp.gguf_sizes(a, gguf)
        gguf_bytes = os.path.getsize(gguf)
        from qmoed_harness import Daemon
        dm = Daemon(models={name: bank}, args=["--log-level", "warning"])
        try:
            c = dm.client()
            model = c.call("model.list")["models"][0]
            c.close()
        finally:
            dm.stop()
            shutil.rmtree(dm.dir, ignore_errors=True)
        unit, layers = model["bytes_per_expert"], model["layers"]
        block = (unit + 4095) // 4096 * 4096
        progress("%s: GGUF %.2f GB (experts %.2f GB), bank unit %.2f MB; fio at queue depth %d"
                 % (shape, gguf_bytes / GB, exp / GB, unit / 1e6, a.iodepth))
        rate, fio_cmd, fio_engine = disk_rate(bank, block, a.iodepth, a.fio_seconds)
        progress("%s: disk %s" % (shape, "%.2f GB/s (%s)" % (rate / GB, fio_engine) if rate else fio_cmd))
        common = {"quant": a.quant, "layers": layers, "bytes_per_expert": unit, "expert_bytes": exp,
                  "non_expert_bytes": rest,
                  "disk_bytes_per_s": rate, "disk_cmd": fio_cmd, "disk_engine": fio_engine,
                  "iodepth": a.iodepth, "threads": a.threads, "prompt": a.prompt, "decode": a.decode}
        progress("%s: uncapped, %s+ qmoed whole_bank" % (shape, "llama.cpp alone and " if a.alone else ""))
        ref_alone = alone(a, shape, gguf, gguf_bytes, None) if a.alone else None
        # Rounds (--rounds): the uncapped qmoed row and every capped qmoed
        # row once a round, the caps' order and the uncapped row's place
        # (first, then last) reversed every other round; llama.cpp alone
        # once (the first round).
        refs, alone_rows, runs_of = [], {}, {}
        reserve = a.reserve
        for rnd in range(a.rounds):
            tag = " (round %d of %d)" % (rnd + 1, a.rounds) if a.rounds > 1 else ""
            caps = list(a.caps) if rnd % 2 == 0 else list(reversed(a.caps))
            if rnd % 2 == 0:
                refs.append(with_qmoed(a, shape, gguf, bank, name, gguf_bytes, None, None, layers))
                progress("%s: uncapped + qmoed%s, decode %s tok/s" % (shape, tag, fmt(refs[-1]["decode_tok_s"])))
            this_round = []
            for cap in caps:
                if a.alone and rnd == 0:
                    progress("%s: cap %.2f GB (%.3g of the GGUF): llama.cpp alone" % (shape, cap * gguf_bytes / GB, cap))
                    alone_rows[cap] = alone(a, shape, gguf, gguf_bytes, cap)
                    progress("%s:   %s, decode %s tok/s" % (shape, alone_rows[cap]["status"],
                                                           fmt(alone_rows[cap]["decode_tok_s"])))
                progress("%s: cap %.2f GB: llama.cpp + qmoed, budget auto%s" % (shape, cap * gguf_bytes / GB, tag))
                # With variants, the qmoed rows of a cap alternate their order
                # cap by cap (a shared host's speed drifts).
                runs = [None] + a.variant
                if a.variant and (a.caps.index(cap) + rnd) % 2:
                    runs.reverse()
                for v in runs:
                    row = with_qmoed(a, shape, gguf, bank, name, gguf_bytes, cap, reserve, layers, v)
                    runs_of.setdefault((cap, v[0] if v else None), []).append(row)
                    this_round.append(row)
                    progress("%s:   %s%s, decode %s tok/s, %s" % (
                        shape, row["status"], " (%s)" % v[0] if v else "",
                        fmt(row["decode_tok_s"]), row["budget_auto"]))
            if rnd % 2 == 1:
                refs.append(with_qmoed(a, shape, gguf, bank, name, gguf_bytes, None, None, layers))
                progress("%s: uncapped + qmoed%s, decode %s tok/s" % (shape, tag, fmt(refs[-1]["decode_tok_s"])))
            ref = refs[-1]
            compute_s = 1 / ref["decode_tok_s"] if ref["decode_tok_s"] else None
            for row in this_round:  # bounds against this round's uncapped decode
                row["round_uncapped_decode_tok_s"] = ref["decode_tok_s"]
                io_bounds(row, unit, rate, compute_s)
                belady_bounds(row, unit, row.get("bound_disk_bytes_per_s") or rate, ref["decode_tok_s"])
                demand_bound(row, unit, ref, layers)
        ref_q = median_row(refs, refs)
        rows += [r for r in (ref_alone, ref_q) if r]
        for cap in a.caps:
            if cap in alone_rows:
                rows.append(alone_rows[cap])
            for v in [None] + a.variant:
                got = runs_of[(cap, v[0] if v else None)]
                rows.append(median_row(got, [{"decode_tok_s": r.get("round_uncapped_decode_tok_s")}
                                             for r in got]))
        if a.midrun:
            progress("%s: the cap of %s lowered mid-run by half of what auto took" % (shape, frac_text(a.caps[0])))
            rows.append(midrun(a, shape, gguf, bank, name, gguf_bytes, a.caps[0], reserve))
            progress("%s:   %s: %s" % (shape, rows[-1]["status"], rows[-1]["note"]))
        for r in rows + refs + [x for got in runs_of.values() for x in got]:
            r.pop("calls", None)  # the demand-only bound's input, not the table's
        for r in rows:
            r.update(common)
            r["uncapped_decode_tok_s"] = (ref_alone if r["engine"] == "llama.cpp" else ref_q)["decode_tok_s"]
    finally:
        if not a.keep:
            for p in made:
                if os.path.isdir(p):
                    shutil.rmtree(p, ignore_errors=True)
                elif os.path.exists(p):
                    os.remove(p)
    return rows


# ---- the table and the figure ----

def fmt(x, f="%.2f"):
    return "—" if x is None else f % x


def x_uncapped(r):
    """The row's decode over its engine's uncapped decode: with rounds, the
    median of the ratios of each round (median_row); else of the two rows."""
    if r.get("x_uncapped") is not None:
        return r["x_uncapped"]
    ref = r.get("uncapped_decode_tok_s")
    return r["decode_tok_s"] / ref if r.get("decode_tok_s") and ref else None


def markdown(rows):
    head = ("| shape | memory given | engine | budget | prefill tok/s | decode tok/s | x uncapped | "
            "hit rate | MB read / token | stall ms / token | I/O bound tok/s (reads; overlapped; demand-only) | "
            "Belady: hit rate; tok/s at most (budget; whole cap) | "
            "disk GB/s (fio; qmoed's reads in flight; over the decode) | OOM kills | status |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        mem = "uncapped" if not r["cap_fraction"] else "%.2f GB (%s of the GGUF)" % (
            r["cap_bytes"] / GB, frac_text(r["cap_fraction"]))
        budget = "—" if r["budget_bytes"] is None else "%.2f GB%s" % (
            r["budget_bytes"] / GB, " auto" if r["budget_auto"] else "")
        ratio = x_uncapped(r)
        bound = "—" if r["io_bound_tok_s"] is None else "%.1f; %s; %s" % (
            r["io_bound_tok_s"], fmt(r["overlapped_bound_tok_s"], "%.1f"),
            fmt(r.get("demand_bound_tok_s"), "%.1f"))
        st = r["status"] if r["status"] == "ok" and not r.get("oom_kills") else "%s%s" % (
            r["status"], ": " + r["note"] if r["status"] != "ok" and r["note"] else "")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["shape"], mem, r["engine"], budget, fmt(r["prefill_tok_s"], "%.1f"),
            fmt(r["decode_tok_s"]), fmt(ratio), fmt(r["hit_rate"], "%.3f"),
            fmt(r["bytes_read_per_token"] / 1e6 if r["bytes_read_per_token"] is not None else None, "%.1f"),
            fmt(r["stall_us_per_token"] / 1e3 if r["stall_us_per_token"] is not None else None, "%.1f"),
            bound, belady_text(r), disk_text(r),
            fmt(r["oom_kills"], "%d"), st))
    return "\n".join(lines)


# Issue 38's targets for the default qmoed rows: at 1/3 of the GGUF, >= 0.5x
# the uncapped decode, >= 80% of the overlapped I/O bound, >= 5x llama.cpp
# alone; at 1/2, >= 0.7x uncapped.
TARGETS = {(1, 3): (0.5, 0.8, 5.0), (1, 2): (0.7, None, None)}


def targets(rows):
    """Per shape and cap, the default qmoed row against llama.cpp alone in
    the same cap and its own uncapped decode: x uncapped, x alone, share of
    the overlapped bound, and which of TARGETS it meets."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for r in rows:
            if r["shape"] != shape or r["engine"] != "llama.cpp + qmoed" or not r["cap_fraction"] \
                    or not r["decode_tok_s"]:
                continue
            f = Fraction(r["cap_fraction"]).limit_denominator(16)
            alone = next((x["decode_tok_s"] for x in rows if x["shape"] == shape
                          and x["engine"] == "llama.cpp" and x["cap_fraction"] == r["cap_fraction"]), None)
            bound = r.get("overlapped_bound_tok_s")
            xu = x_uncapped(r)
            xa = r["decode_tok_s"] / alone if alone else None
            share = r.get("bound_share") or (r["decode_tok_s"] / bound if bound else None)
            demand = r.get("demand_bound_tok_s")
            dshare = r.get("demand_share") or (r["decode_tok_s"] / demand if demand else None)
            want = TARGETS.get((f.numerator, f.denominator))
            verdict = []
            if want:
                for got, goal, text in ((xu, want[0], "%gx uncapped"),
                                        (share, want[1], "{}% of the bound"),
                                        (xa, want[2], "%gx alone")):
                    if goal is not None and got is not None:
                        goal_text = text.format(round(100 * goal)) if "{}" in text else text % goal
                        verdict.append("%s %s" % ("met" if got >= goal else "missed", goal_text))
            out.append("%s at %s: %s tok/s, %sx uncapped, %sx alone, %s of the overlapped bound, "
                       "%s of the demand-only bound%s" % (
                shape, frac_text(r["cap_fraction"]), fmt(r["decode_tok_s"]), fmt(xu), fmt(xa, "%.1f"),
                "—" if share is None else "%.0f%%" % (100 * share),
                "—" if dshare is None else "%.0f%%" % (100 * dshare),
                "; targets: " + ", ".join(verdict) if verdict else ""))
    return out


def belady_text(r):
    b = r.get("belady") or {}
    if "budget" not in b:
        return "—"
    cap = b.get("cap")
    return "%.3f; %.1f; %s" % (b["budget"]["min_hit_rate"], b["budget"]["bound_tok_s"],
                               fmt(cap["bound_tok_s"] if cap else None, "%.1f"))


def disk_text(r):
    fio = fmt(r["disk_bytes_per_s"] / GB if r.get("disk_bytes_per_s") else None)
    if not r.get("bytes_read_per_token") or not r.get("decode_tok_s"):
        return fio
    busy = fmt(r["disk_busy_bytes_per_s"] / GB if r.get("disk_busy_bytes_per_s") else None)
    return "%s; %s; %.2f" % (fio, busy, r["bytes_read_per_token"] * r["decode_tok_s"] / GB)


def frac_text(f):
    for d in range(1, 9):
        if abs(f * d - round(f * d)) < 1e-3 and round(f * d) >= 1:
            return "%d/%d" % (round(f * d), d)
    return "%.3g" % f


def figure(rows, path, caption):
    """decode tok/s against the memory given; returns None or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (tools/requirements-torch.txt)"
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, shape in enumerate(shapes):
        for engine, style, marker in (("llama.cpp + qmoed", "-", "o"), ("llama.cpp", "--", "s")):
            # A row that did not run (refused, killed) has no point: the line skips it.
            pts = sorted((r["cap_fraction"] or 1.25, r["decode_tok_s"]) for r in rows
                         if r["shape"] == shape and r["engine"] == engine and r["decode_tok_s"])
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                    color=colours[i % len(colours)], label="%s, %s" % (shape, engine))
    caps = sorted({r["cap_fraction"] for r in rows if r["cap_fraction"]})
    ax.set_xticks(caps + [1.25])
    ax.set_xticklabels([frac_text(c) for c in caps] + ["uncapped"])
    quants = sorted({r.get("quant", "q4_0").upper() for r in rows})
    ax.set_xlabel("memory given (cgroup cap, fraction of the %s GGUF)" % "/".join(quants))
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(caption, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def render_saved(a):
    rows = []
    for path in a.from_json:
        with open(path) as f:
            rows += json.load(f)
    for r in rows:
        if r["engine"] != "llama.cpp" and r.get("cap_fraction"):
            ref = r.get("uncapped_decode_tok_s")
            io_bounds(r, r["bytes_per_expert"], r.get("disk_bytes_per_s"), 1 / ref if ref else None)
    table = markdown(rows)
    print(table)
    print("\n" + "\n".join(targets(rows)))
    if a.md:
        with open(a.md, "w") as f:
            f.write(table + "\n")
    if a.png and rows:
        why = figure(rows, a.png, "decode tok/s, llama.cpp alone (dashed) and + qmoed --qmoed-budget auto "
                     "(solid); rows of %s" % ", ".join(os.path.basename(p) for p in a.from_json))
        print("figure: %s" % (why or a.png), file=sys.stderr)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", help="PREFIX that clients/llama.cpp/build.sh installed (required unless --from-json)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma-separated, of %s" % ", ".join(checkpoints.SHAPES))
    ap.add_argument("--caps", default="1/2,1/3,1/4", help="memory cgroup caps, fractions of the GGUF")
    ap.add_argument("--layers", type=int, default=checkpoints.LAYERS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="qmoed rows (uncapped and capped) run this many times in alternated order: "
                    "medians, and x uncapped the median of each round's ratio")
    ap.add_argument("--policy", default="next_use", help="of the capped qmoed rows")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="per cap, another llama.cpp + qmoed row with qmoed --set KEY=VALUE "
                    "(e.g. no-trial:prefetch_trial=false; K1=V1,K2=V2 for several), named NAME; repeatable")
    ap.add_argument("--precision", choices=("exact", "fast"), help="of the qmoed rows (default: exact)")
    ap.add_argument("--reserve", type=int, help="auto_budget_reserve in bytes (default: qmoed's own, "
                    "as a user runs it)")
    ap.add_argument("--iodepth", type=int, default=32,
                    help="reads in flight: qmoed's io_depth (its default, 32) and fio's")
    ap.add_argument("--fio-seconds", type=int, default=5)
    ap.add_argument("--load-mode", help="llama-bench -lm of the llama.cpp + qmoed rows (default: "
                    "llama.cpp's, which maps the weights)")
    ap.add_argument("--alone-repack", type=int, default=0, choices=(0, 1),
                    help="llama.cpp alone under a cap with its default repacking (1) or --repack 0")
    ap.add_argument("--row-timeout", type=int, default=1800, help="seconds per llama-bench run")
    ap.add_argument("--no-alone", dest="alone", action="store_false",
                    help="no llama.cpp alone rows (an A/B of qmoed rows with --variant)")
    ap.add_argument("--no-midrun", dest="midrun", action="store_false",
                    help="no run with the first cap lowered mid-run by half of what auto took")
    ap.add_argument("--midrun-tokens", type=int, default=256,
                    help="tokens that run decodes (96 was too few for the Qwen3 shape at 35 tok/s: "
                         "it finished before the limit was half-way down)")
    ap.add_argument("--direct-q8", action="store_true",
                    help="convert straight to Q8_0 (no bf16 GGUF on disk); Q4_0 requantised from it")
    ap.add_argument("--quant", choices=["q4_0", "mxfp4_moe"], default="q4_0",
                    help="the GGUF's type (mxfp4_moe: the experts in MXFP4, requantised from the "
                    "Q4_0 or Q8_0 GGUF; its bank the e2m1 code book)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="qmoed's build tree")
    ap.add_argument("--work", help="where checkpoints, GGUFs and banks go (default: a temp dir in /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints, GGUFs and banks")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "capped_sweep.png"),
                    help="the figure (matplotlib); '' for none")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="run nothing: the table and figure of rows an earlier --json wrote "
                    "(bounds recomputed from their counters)")
    a = ap.parse_args(argv)
    if a.from_json:
        return render_saved(a)
    if not a.llama:
        ap.error("--llama PREFIX is required (unless --from-json)")
    why = MemCgroup.unavailable()
    if why:
        ap.error("the sweep caps memory with cgroups: " + why)
    a.caps = [fraction(c) for c in a.caps.split(",")]
    a.shapes = a.shapes.split(",")
    for i, v in enumerate(a.variant):
        vname, _, kv = v.partition(":")
        if not vname or not all("=" in x for x in kv.split(",")):
            ap.error("--variant %r: expected NAME:KEY=VALUE[,KEY=VALUE...]" % v)
        a.variant[i] = (vname, kv)
    for s in a.shapes:
        if s not in checkpoints.SHAPES:
            ap.error("unknown shape %r (%s)" % (s, ", ".join(checkpoints.SHAPES)))
    a.llama = os.path.abspath(a.llama)
    a.quants = ["q4_0"] if a.quant == "q4_0" else ["q4_0", a.quant]
    os.environ["QMOE_BUILD_DIR"] = os.path.abspath(a.build)
    temp = a.work is None
    a.work = a.work or tempfile.mkdtemp(prefix="qmoe-sweep-", dir="/var/tmp")
    os.makedirs(a.work, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    try:
        for shape in a.shapes:
            rows += run_shape(a, shape)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        if temp and not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    table = markdown(rows)
    machine = "%s, %d cores, %.0f GiB; %s" % (cpu_name(), os.cpu_count(),
                                              os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
                                              time.strftime("%Y-%m-%d"))
    print(table)
    print("\n%s; llama-bench -t %d -r 1, prefill %d tokens, decode %d%s; qmoed %s, %s budget auto"
          % (machine, a.threads, a.prompt, a.decode,
             ", -lm %s with qmoed" % a.load_mode if getattr(a, "load_mode", None) else "",
             a.precision or "exact", a.policy))
    print("\n" + "\n".join(targets(rows)))
    if a.md:
        with open(a.md, "w") as f:
            f.write(table + "\n\n" + machine + "\n")
    if a.png and rows:
        why = figure(rows, a.png, "decode tok/s, llama.cpp alone (dashed) and + qmoed --qmoed-budget auto "
                     "(solid); %s" % machine)
        print("figure: %s" % (why or a.png), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
