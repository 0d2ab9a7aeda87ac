#!/usr/bin/env python3
"""What the transformers hook costs per MoE layer call at T = 1 beyond
qmoed's own answer: greedy decoding on a tiny fixture model (experts that
cost next to nothing), each layer call timed in the engine and matched with
the daemon's session.infer trace span of the same call (dur_us: from the
request read to the answer queued). Reports per call, medians over every
call of every round:

  engine CPU  the engine thread's CPU time (user + system) in the layer
              call: what the engine spends, whoever else wants the cores
  hook        the whole layer call in the engine (qmoe_client.transformers)
  daemon      the session.infer span
  beyond      hook - daemon: tensor copies, map writes, request text,
              socket transit and wake-ups, the response's parse, Python
  before call / in client call / after  where the hook's time goes (the
              client call: the request's text, the socket both ways, the
              daemon, the response's parse)
  daemon CPU  every daemon thread's CPU time over the generation, per
              layer call (/proc/PID/task/*/schedstat): what an
              anticipating ring's spinning costs it

--loop calls the hook's layer call directly, back to back, with one
token's hidden state and routing (what a decode step sends, without the
model's own compute between calls: on a loaded machine that compute lets
other processes take the cores, and each of the call's thread wake-ups then
waits for one), instead of generating.

--baseline REV runs the client package of git revision REV side by side
(alternating rounds, same model, same daemon) for a before/after figure.

Run with the torch environment's python:
  $QMOE_TORCH_VENV/bin/python bench/hook/hook_cost.py --build build \\
      [--fixture qwen3_moe] [--tokens 64] [--rounds 5] [--baseline 6918353]
"""
import argparse
import atexit
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import hook_bench
from hook_bench import ROOT


def baseline_package(rev, d):
    """The client package of revision `rev` as the package qmoe_client_base."""
    pkg = os.path.join(d, "qmoe_client_base")
    os.makedirs(pkg)
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", rev,
                            "clients/python/qmoe_client/"], capture_output=True, text=True,
                           check=True).stdout.split()
    for f in (os.path.basename(n) for n in names if n.endswith(".py")):  # the package's modules
        src = subprocess.run(["git", "-C", ROOT, "show", "%s:clients/python/qmoe_client/%s"
                              % (rev, f)], capture_output=True, text=True, check=True).stdout
        with open(os.path.join(pkg, f), "w") as out:
            out.write(src)
    sys.path.insert(0, d)
    return importlib.import_module("qmoe_client_base")


def daemon_cpu_ns(pid):
    """CPU time of every thread of the daemon so far, ns (schedstat)."""
    total = 0
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


class Timed:
    """Wraps a Hook class's _forward and its client's call path: per call,
    (start, sent, answered, end) perf_counter stamps."""

    def __init__(self, hook_cls):
        self.samples = []
        self._stamps = []
        self._cpu = []
        inner = hook_cls._forward
        timed = self

        def forward(self, *args):
            timed._cpu = [time.thread_time()]
            timed._stamps = [time.perf_counter()]
            out = inner(self, *args)
            timed._stamps.append(time.perf_counter())
            timed._cpu.append(time.thread_time())
            if len(timed._stamps) == 4:
                timed.samples.append(tuple(timed._stamps) + tuple(timed._cpu))
            return out

        hook_cls._forward = forward

    def wrap_client(self, client, method):
        """Stamps around client.method, or around the Hook class's _call
        when client is that class (the layer call through the call ring or
        the socket, whichever the session has)."""
        inner = getattr(client, method)
        timed = self
        if isinstance(client, type):
            def call_method(hook_self, *args, **kwargs):
                timed._cpu.append(time.thread_time())
                timed._stamps.append(time.perf_counter())
                r = inner(hook_self, *args, **kwargs)
                timed._stamps.append(time.perf_counter())
                timed._cpu.append(time.thread_time())
                return r

            setattr(client, method, call_method)
            return

        def call(*args, **kwargs):
            timed._cpu.append(time.thread_time())
            timed._stamps.append(time.perf_counter())
            r = inner(*args, **kwargs)
            timed._stamps.append(time.perf_counter())
            timed._cpu.append(time.thread_time())
            return r

        setattr(client, method, call)


def main():
    ap = argparse.ArgumentParser()
    hook_bench.add_common_args(ap, fixture="qwen3_moe", tokens=64)
    ap.add_argument("--baseline", metavar="REV", help="also run this revision's client package")
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--loop", action="store_true", help="back-to-back layer calls, no model")
    ap.add_argument("--calls", type=int, default=2000, help="layer calls per round (--loop)")
    a = hook_bench.parse(ap)
    import torch
    import transformers
    import qmoe_client
    from qmoe_client import transformers as qhook
    from qmoed_harness import Daemon

    torch.set_num_threads(a.engine_threads)
    d = tempfile.mkdtemp(prefix="bench-hook-cost-")
    atexit.register(shutil.rmtree, d, True)  # the bank, the daemon's files, the baseline package
    roads = {"this tree": (qmoe_client, qhook)}
    if a.baseline:
        base = baseline_package(a.baseline, d)
        roads["baseline %s" % a.baseline] = (base, importlib.import_module(
            "qmoe_client_base.transformers"))
    fixture, bank = hook_bench.fixture_bank(a.fixture, d)
    dm = Daemon(models={a.fixture: bank}, workdir=d,
                args=["--log-level", "warning", "--set", "trace_capacity=1000000"])
    results = {name: [] for name in roads}
    daemon_cpu = {name: [0, 0] for name in roads}  # ns, layer calls (every round but the first)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)
        model.eval()
        ids = torch.tensor([[1, 5, 9, 2, 7]])
        timers = {}
        clients = {}
        for name, (pkg, hk) in roads.items():
            timers[name] = Timed(hk.Hook)
            clients[name] = pkg.Client(dm.socket)
            if hasattr(hk.Hook, "_call"):  # the ring or the socket: the hook's own call
                timers[name].wrap_client(hk.Hook, "_call")
            else:
                timers[name].wrap_client(clients[name], next(
                    m for m in ("infer_counts", "call_json", "call") if hasattr(clients[name], m)))
        admin = qmoe_client.Client(dm.socket)
        for r in range(a.rounds + 1):  # round 0 warms up
            for name, (pkg, hk) in roads.items():
                timer = timers[name]
                hook = hk.attach(model, clients[name], a.fixture)
                hook._ensure_map(1 << 20)
                timer.samples = []
                cpu0 = daemon_cpu_ns(dm.proc.pid)
                with torch.no_grad():
                    if a.loop:
                        H = model.config.hidden_size
                        k = model.config.num_experts_per_tok
                        x = torch.randn(1, H)
                        top = torch.arange(k).reshape(1, k)
                        w = torch.full((1, k), 1.0 / k)
                        nl = len(set(hook.layers.values()))
                        for i in range(a.calls):
                            hook._forward(i % nl, x, top, w)
                    else:
                        model.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                                       do_sample=False, pad_token_id=0)
                cpu1 = daemon_cpu_ns(dm.proc.pid)
                spans = [s for s in admin.trace(session=hook.session)
                         if s["name"] == "session.infer"]
                hook.detach()
                calls = timer.samples
                if len(spans) != len(calls):
                    raise SystemExit("%d layer calls but %d trace spans" % (len(calls), len(spans)))
                per_call = [(c, s["dur_us"]) for c, s in zip(calls, spans)
                            if s["args"]["tokens"] == 1]  # decode steps (T = 1)
                if r:
                    results[name] += per_call
                    daemon_cpu[name][0] += cpu1 - cpu0
                    daemon_cpu[name][1] += len(calls)
    finally:
        dm.stop()
    med = statistics.median
    what = ("%d back-to-back layer calls" % a.calls) if a.loop else ("%d decode tokens" % a.tokens)
    print("fixture %s, %s x %d rounds, engine threads %d; per layer call at "
          "T = 1, median (p10-p90) in us:" % (a.fixture, what, a.rounds, a.engine_threads))
    for name, rows in results.items():
        hook = [1e6 * (c[3] - c[0]) for c, _ in rows]
        daemon = [float(s) for _, s in rows]
        beyond = [h - s for h, s in zip(hook, daemon)]
        before = [1e6 * (c[1] - c[0]) for c, _ in rows]
        wait = [1e6 * (c[2] - c[1]) for c, _ in rows]
        after = [1e6 * (c[3] - c[2]) for c, _ in rows]
        cpu = [1e6 * (c[7] - c[4]) for c, _ in rows]
        cpu_parts = [[1e6 * (c[5] - c[4]) for c, _ in rows], [1e6 * (c[6] - c[5]) for c, _ in rows],
                     [1e6 * (c[7] - c[6]) for c, _ in rows]]

        def q(v):
            v = sorted(v)
            return "%6.1f (%.1f-%.1f)" % (med(v), v[len(v) // 10], v[len(v) * 9 // 10])
        print("  %s, %d calls:" % (name, len(rows)))
        print("    engine CPU    %s   (the engine thread's CPU time in the call)" % q(cpu))
        print("    hook          %s" % q(hook))
        print("    daemon span   %s" % q(daemon))
        print("    beyond daemon %s" % q(beyond))
        print("    before call   %s   CPU %s" % (q(before), q(cpu_parts[0])))
        print("    client call   %s   CPU %s" % (q(wait), q(cpu_parts[1])))
        print("    after call    %s   CPU %s" % (q(after), q(cpu_parts[2])))
        ns, n = daemon_cpu[name]
        print("    daemon CPU    %6.1f a layer call (every thread's, over the rounds)"
              % (ns / 1e3 / n if n else float("nan")))


if __name__ == "__main__":
    main()
