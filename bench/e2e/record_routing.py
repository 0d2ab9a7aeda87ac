#!/usr/bin/env python3
"""Records the bench/e2e models' own routing through qmoed and replays it
through every residency policy against Belady's MIN (issue 38, item 3: the
policies judged on routing recorded from the models people run, not only on
generated traces).

    python3 bench/e2e/record_routing.py --llama PREFIX --work DIR
        [--shapes qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b] [--tokens 300]
        [--modes bench,greedy,sampled] [--out DIR] [--md OUT.md]

Per shape it takes DIR/SHAPE.q4_0.gguf and its bank DIR/SHAPE.q4_0.bank (what
bench/e2e/capped_sweep.py --keep leaves there), starts a qmoed with a state
dir and `--set record_routing=true` (every paging session's routing to
state_dir/routing-ID.qmtr), and decodes TOKENS tokens through it with a
next_use session at 95% of the bank (paged, so recorded; the budget changes
no routing bit), in each mode:

  bench    llama-bench -p 0 -n TOKENS: llama-bench's own tokens (random ids);
  greedy   llama-completion of "Once upon a time", --temp 0;
  sampled  the same prompt, --temp 1.0 --seed 7.

The models are random-initialised from the real configs (no weights are
downloaded), so their routing is a model's and an engine's, not a trained
model's: trained routers spread over more experts. Each trace is copied to
--out (default DIR/traces) as SHAPE.MODE.qmtr and replayed with
`policy_sim --trace T --no-prefetch` (the second half from a cold cache, the
first half static_hot's profile; hit rates and % of MIN's hits per budget),
whose tables are printed and written to --md.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "daemon"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import qmoe_trace  # noqa: E402

PROMPT = "Once upon a time"


def decode(a, mode, gguf, socket, budget):
    q = ["--qmoed", socket, "--qmoed-policy", "next_use", "--qmoed-budget", str(budget),
         "--qmoed-precision", "fast"]
    if mode == "bench":
        cmd = [os.path.join(a.llama, "bin", "llama-bench"), "-m", gguf, "-t", str(a.threads),
               "-r", "1", "-p", "0", "-n", str(a.tokens)]
    else:
        cmd = [os.path.join(a.llama, "bin", "llama-completion"), "-m", gguf, "-p", PROMPT,
               "-n", str(a.tokens), "--ignore-eos", "-no-cnv", "--no-warmup", "-t", str(a.threads),
               "-c", str(a.tokens + 64), "--simple-io"]
        cmd += ["--temp", "0"] if mode == "greedy" else ["--temp", "1.0", "--seed", "7"]
    # Bytes: a random-weights model prints pieces of UTF-8 characters.
    p = subprocess.run(cmd + q, stdin=subprocess.DEVNULL, capture_output=True, timeout=a.timeout)
    if p.returncode != 0:
        tail = p.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise RuntimeError("%s exited %d: %s" % (os.path.basename(cmd[0]), p.returncode, tail))


def record(a, shape, mode):
    """One trace of SHAPE decoded in MODE: its path under --out."""
    from qmoed_harness import Daemon
    gguf = os.path.join(a.work, shape + ".q4_0.gguf")
    bank = os.path.join(a.work, shape + ".q4_0.bank")
    for f in (gguf, bank):
        if not os.path.exists(f):
            raise SystemExit("record_routing: %s is missing (bench/e2e/capped_sweep.py --keep "
                             "--work %s makes it)" % (f, a.work))
    name = os.path.basename(gguf)[:-len(".gguf")]
    work = tempfile.mkdtemp(prefix="qmoed-rec-", dir=a.work)
    state = os.path.join(work, "state")
    os.mkdir(state)
    try:
        dm = Daemon(models={name: bank}, workdir=work,
                    args=["--threads", str(a.threads), "--log-level", "info", "--state-dir", state,
                          "--set", "record_routing=true", "--set", "paging_source=mmap"])
        try:
            c = dm.client()
            unit = c.call("model.list")["models"][0]
            c.close()
            budget = int(unit["bytes_per_expert"] * unit["layers"] * unit["experts"] * 0.95)
            decode(a, mode, gguf, dm.socket, budget)
        finally:
            dm.stop()
        traces = sorted((os.path.getmtime(os.path.join(state, f)), f) for f in os.listdir(state)
                        if f.startswith("routing-"))
        if not traces:
            raise RuntimeError("%s %s: the daemon recorded no trace" % (shape, mode))
        out = os.path.join(a.out, "%s.%s.qmtr" % (shape, mode))
        shutil.copyfile(os.path.join(state, traces[-1][1]), out)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama", required=True, help="what clients/llama.cpp/build.sh installed")
    ap.add_argument("--work", required=True, help="where SHAPE.q4_0.gguf and .bank are")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b")
    ap.add_argument("--modes", default="bench,greedy,sampled")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", help="where the traces go (default WORK/traces)")
    ap.add_argument("--md", help="the policy_sim tables, as markdown")
    a = ap.parse_args(argv)
    a.out = a.out or os.path.join(a.work, "traces")
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("QMOE_BUILD_DIR", a.build)
    sim = os.path.join(a.build, "bench", "policy_sim", "policy_sim")
    tables = []
    for shape in a.shapes.split(","):
        for mode in a.modes.split(","):
            t0 = time.monotonic()
            path = record(a, shape, mode)
            tr = qmoe_trace.read_trace(path)
            st = qmoe_trace.stats(tr)
            print("[%s %s] %d tokens in %.0f s: top-1 kept %.2f (chance %.3f), >= 1 shared %.2f"
                  % (shape, mode, tr.tokens, time.monotonic() - t0, st["top1_reuse"],
                     st["chance_top1"], st["share_any"]), flush=True)
            p = subprocess.run([sim, "--trace", path, "--no-prefetch"], capture_output=True,
                               text=True, check=True)
            rows = [x for x in p.stdout.splitlines() if x.startswith("|")]
            tables.append("%s, %s (%d tokens)\n\n%s\n" % (shape, mode, tr.tokens, "\n".join(rows)))
            print("\n".join(rows), flush=True)
    if a.md:
        with open(a.md, "w") as f:
            f.write("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
