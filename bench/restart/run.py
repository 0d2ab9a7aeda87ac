#!/usr/bin/env python3
"""Engines that outlive a daemon restart (issue 40's target): N runs of each
engine, each with qmoed SIGKILLed at a random token-layer of the generation
and restarted at once by a supervisor as systemd would (through the socket
unit's inherited fd: tests/hardening/restart.py); every run must end with
the undisturbed run's tokens, and the time a restart costs must stay within
2 s plus the bank's load time.

    python3 bench/restart/run.py [--runs 20] [--engines llama,transformers]
        [--llama-prefix PREFIX] [--tokens 48] [--restart-delay 0] [--seed 40]

Engines: llama-completion (clients/llama.cpp, tools from --llama-prefix or
$QMOE_LLAMA_PREFIX, as clients/llama.cpp/build.sh installs them; the GGUF is
the tiny gpt-oss fixture converted by tests/llama/make_ggufs.py) and a
transformers generation through qmoe_client.transformers.from_pretrained
(tests/hardening/restart_generate.py on the tiny Mixtral fixture), both on a
paged session (lru, 50%) whose restarted daemon lacks the model: the
engine's client loads the bank again (--qmoed-bank; set_model_bank).
Needs the torch environment ($QMOE_TORCH_VENV, scripts/setup.sh) and a
built tree ($QMOE_BUILD_DIR, default ./build).

Undisturbed and killed runs alternate. Per engine it prints: runs whose
tokens equal the undisturbed run's; the time lost per restart (each killed
run's wall time less the undisturbed run's just before it: min, median,
max); the restoration as the engine's client logged it ("session ... is
back after S s": from the failed call to the session back on the new
daemon, its model loaded, warm, its map passed again); the bank's load time
(model.load on a fresh daemon, median of 3); and whether the target holds
(every run identical and the median time lost <= 2 s + load: on a shared
machine a single run's wall time moves by seconds either way).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests", "hardening"))
sys.path.insert(0, os.path.join(SRC, "tests", "clients"))
os.environ.setdefault("QMOE_BUILD_DIR", os.path.join(SRC, "build"))

from conftest import torch_python  # noqa: E402
from restart import Killer, Supervisor  # noqa: E402
from qmoed_harness import qmoe_bank_path  # noqa: E402

FIXTURES = os.path.join(SRC, "tests", "import", "fixtures")
PROMPT = "the quick brown fox"
BACK = re.compile(r"is back after ([0-9.]+) s")


class Engine:
    """One engine's run: start() a process against a socket, finish() its
    tokens and stderr."""

    def __init__(self, name, bank, model):
        self.name, self.bank, self.model = name, bank, model

    def finish(self, p):
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError("%s exited %s:\n%s" % (self.name, p.returncode, err[-3000:]))
        return self.tokens_of(out), err


class Llama(Engine):
    def __init__(self, prefix, gguf, bank, tokens):
        super().__init__("llama-completion", bank, os.path.basename(gguf)[:-len(".gguf")])
        self.prefix, self.gguf, self.n = prefix, gguf, tokens

    def start(self, sup):
        cmd = [os.path.join(self.prefix, "bin", "llama-completion"), "-m", self.gguf, "-p", PROMPT,
               "-n", str(self.n), "--temp", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt",
               "--no-warmup", "-t", "2", "-c", "512", "--simple-io", "--qmoed", sup.socket,
               "--qmoed-bank", self.bank, "--qmoed-policy", "lru", "--qmoed-budget", "50%"]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    @staticmethod
    def tokens_of(out):
        return out  # one character per token with this vocabulary


class Transformers(Engine):
    def __init__(self, py, fixture, bank, tokens):
        super().__init__("transformers", bank, "mixtral")
        self.py, self.fixture, self.n = py, fixture, tokens

    def start(self, sup):
        cmd = [self.py, os.path.join(SRC, "tests", "hardening", "restart_generate.py"),
               "--socket", sup.socket, "--fixture", self.fixture, "--model", self.model,
               "--bank", self.bank, "--policy", "lru", "--budget", "50%", "--tokens", str(self.n)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def tokens_of(out):
        import json
        return json.loads(out.strip().splitlines()[-1])["tokens"]


def timed_run(engine, sup, killer=None):
    t0 = time.monotonic()
    p = engine.start(sup)
    if killer is not None:
        killer.start()
    try:
        tokens, err = engine.finish(p)
    finally:
        if killer is not None:
            killer.finish()
    return tokens, err, time.monotonic() - t0


def load_time(bank, model, work):
    """model.load of `bank` on a fresh daemon: median of 3, seconds."""
    times = []
    for i in range(3):
        sup = Supervisor(os.path.join(work, "load%d" % i))
        c = sup.client()
        t0 = time.monotonic()
        c.call("model.load", {"name": model, "path": bank})
        times.append(time.monotonic() - t0)
        c.close()
        sup.stop()
    return statistics.median(times)


def calm_run(engine, work, tag):
    """An undisturbed run: its tokens, wall time and the daemon's token-layers."""
    sup = Supervisor(os.path.join(work, "%s-%s" % (engine.name, tag)))
    try:
        tokens, _, wall = timed_run(engine, sup)
        c = sup.client()
        total = c.call("telemetry.get")["daemon"]["tokens"]
        c.close()
    finally:
        sup.stop()
    return tokens, wall, total


def bench(engine, runs, work, delay, seed):
    """Alternates an undisturbed run and a killed one (the same minutes of a
    machine others may share): each restart's cost is the killed run's wall
    time less the undisturbed run's just before it."""
    ref, _, total = calm_run(engine, work, "first")
    same, lost, back, calm, failed = 0, [], [], [], []
    for i in range(runs):
        tokens, wall0, _ = calm_run(engine, work, "calm%d" % i)
        if tokens != ref:
            failed.append("run %d: an undisturbed run gave other tokens" % i)
            continue
        calm.append(wall0)
        sup = Supervisor(os.path.join(work, "%s-run%d" % (engine.name, i)))
        killer = Killer(sup, span=(total // 8, total * 7 // 8), delay=delay, seed=seed + i)
        try:
            tokens, err, wall = timed_run(engine, sup, killer)
        except RuntimeError as e:
            failed.append(str(e)[-300:])
            continue
        finally:
            sup.stop()
        if killer.error is not None or len(killer.points) != 1:
            failed.append("run %d: the kill did not happen during the run (%s, %s)"
                          % (i, killer.error, killer.points))
            continue
        same += tokens == ref
        lost.append(wall - wall0)
        back += [float(x) for x in BACK.findall(err)]
        print("  %s run %2d: killed at token-layer %5d, %s, %.2f s (undisturbed %.2f s)" % (
            engine.name, i + 1, killer.points[0], "same tokens" if tokens == ref else "DIFFERENT",
            wall, wall0), flush=True)
    return {"engine": engine.name, "runs": runs, "same": same, "failed": failed, "lost": lost,
            "back": back, "calm": calm}


def fmt(xs):
    if not xs:
        return "-"
    return "%.2f / %.2f / %.2f" % (min(xs), statistics.median(xs), max(xs))


def make_llama_inputs(prefix, py, work):
    share = os.path.join(prefix, "share", "qmoed-llama.cpp")
    r = subprocess.run([py, os.path.join(SRC, "tests", "llama", "make_ggufs.py"), "--share", share,
                        "--quantize", os.path.join(prefix, "bin", "llama-quantize"), "--out", work,
                        "gpt_oss"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("make_ggufs.py failed:\n" + (r.stdout + r.stderr)[-3000:])
    gguf = os.path.join(work, "gpt_oss.q8_0.gguf")
    bank = os.path.join(work, "gpt_oss.q8_0.bank")
    subprocess.run([qmoe_bank_path(), "import", "gguf", gguf, "--out", bank, "--quiet"], check=True)
    return gguf, bank


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--engines", default="llama,transformers")
    ap.add_argument("--llama-prefix", default=os.environ.get("QMOE_LLAMA_PREFIX"))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--restart-delay", type=float, default=0.0,
                    help="seconds between the kill and the next daemon (systemd's RestartSec)")
    ap.add_argument("--seed", type=int, default=40)
    a = ap.parse_args()
    py = torch_python()
    if py is None:
        sys.exit("no torch environment ($QMOE_TORCH_VENV, /var/cache/qmoed/venv-torch): run "
                 "scripts/setup.sh")
    work = tempfile.mkdtemp(prefix="qmoe-restart-bench-")
    engines = []
    for name in a.engines.split(","):
        if name == "llama":
            if not a.llama_prefix:
                sys.exit("--llama-prefix (or $QMOE_LLAMA_PREFIX): where clients/llama.cpp/build.sh "
                         "installed the tools")
            gguf, bank = make_llama_inputs(a.llama_prefix, py, work)
            engines.append(Llama(a.llama_prefix, gguf, bank, a.tokens))
        elif name == "transformers":
            bank = os.path.join(work, "mixtral.bank")
            subprocess.run([qmoe_bank_path(), "import", "hf", os.path.join(FIXTURES, "mixtral"),
                            "--out", bank, "--bits", "8", "--quiet"], check=True)
            engines.append(Transformers(py, os.path.join(FIXTURES, "mixtral"), bank, a.tokens))
        else:
            sys.exit("unknown engine %r (llama, transformers)" % name)
    rows = []
    for e in engines:
        print("%s: %d runs, one SIGKILL + restart each (restart delay %.1f s)"
              % (e.name, a.runs, a.restart_delay), flush=True)
        r = bench(e, a.runs, work, a.restart_delay, a.seed)
        r["load"] = load_time(e.bank, e.model, work)
        rows.append(r)
    print()
    print("| engine | identical tokens | undisturbed run s | lost per restart s (min / median "
          "/ max) | session back after s (min / median / max) | bank load s | target (<= 2 s + "
          "load) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ok = (r["same"] == r["runs"] and r["lost"]
              and statistics.median(r["lost"]) <= 2.0 + r["load"])
        print("| %s | %d/%d | %.2f | %s | %s | %.3f | %s |" % (
            r["engine"], r["same"], r["runs"], statistics.median(r["calm"]), fmt(r["lost"]),
            fmt(r["back"]), r["load"], "met" if ok else "NOT met"))
        for f in r["failed"]:
            print("  failed: " + f)
    print("\n(socket activation emulated, restart delay %.1f s, seed %d)"
          % (a.restart_delay, a.seed))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
