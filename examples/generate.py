#!/usr/bin/env python3
"""Greedy generation with a Hugging Face MoE model whose routed experts run
in qmoed (transformers >= 5, qmoe_client.transformers.from_pretrained).

    python examples/generate.py --model DIR [--bank FILE] --budget 50% \\
        --policy next_use --prompt "Once upon a time" --max-new-tokens 32

Imports the checkpoint's experts into a bank when there is none yet
(`qmoe-bank import hf`, int8 by default), loads it into qmoed (model.load;
an admin or the daemon's own user), loads the checkpoint without its experts
(they are never read: the engine holds attention, embeddings, norms, routers,
dense layers and shared experts), creates a session with the policy and
budget, generates greedily and prints tokens/s, the expert hit rate, the
bytes paged per token and both processes' memory (the engine's RSS and peak,
qmoed's RSS and peak). --record-trace FILE writes the routing the model
chose (docs/TRACES.md, .qmtr) for bench/policy_sim. --compare also runs
transformers with the whole checkpoint and the bank's dequantised weights in
its own experts, and checks the tokens are the same. A model without a
tokenizer (the tiny test fixtures) takes token ids: --prompt-ids 1,2,3.

Without a running qmoed (--socket, $QMOED_SOCKET or the default path) it
starts a private one on a temporary socket (--qmoed PATH, else ./build or
$PATH) and stops it at the end.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import qmoe_client  # noqa: E402
from qmoe_client import transformers as qhook  # noqa: E402


def find_tool(explicit, name, built):
    for cand in (explicit, os.path.join(ROOT, "build", built), shutil.which(name)):
        if cand and os.path.exists(cand):
            return cand
    sys.exit("generate.py: cannot find %s (pass --%s PATH)" % (name, name))


def ensure_bank(a):
    bank = a.bank or os.path.join(os.path.expanduser("~/.cache/qmoed/banks"),
                                  "%s-int%d.bank" % (os.path.basename(os.path.abspath(a.model)),
                                                     a.bits))
    if os.path.exists(bank):
        return bank
    os.makedirs(os.path.dirname(os.path.abspath(bank)), exist_ok=True)
    tool = find_tool(a.qmoe_bank, "qmoe-bank", os.path.join("tools", "qmoe-bank", "qmoe-bank"))
    print("importing %s into %s (int%d)" % (a.model, bank, a.bits), file=sys.stderr)
    r = subprocess.run([tool, "import", "hf", a.model, "--out", bank, "--bits", str(a.bits),
                        "--quiet"])
    if r.returncode != 0:
        sys.exit("generate.py: qmoe-bank import hf failed (exit %d)" % r.returncode)
    return bank


def connect_or_spawn(a, bank, name):
    """A client of a running qmoed, or of a private one started here."""
    try:
        return qmoe_client.Client(a.socket), None
    except qmoe_client.DaemonNotRunning:
        pass
    qmoed = find_tool(a.qmoed, "qmoed", os.path.join("daemon", "qmoed"))
    d = tempfile.mkdtemp(prefix="qmoed-generate-")
    sock = os.path.join(d, "qmoed.sock")
    cmd = [qmoed, "--socket", sock, "--log-level", "warning", "--model", "%s=%s" % (name, bank)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd)
    for _ in range(500):
        try:
            return qmoe_client.Client(sock), (proc, d)
        except qmoe_client.DaemonNotRunning:
            if proc.poll() is not None:
                sys.exit("generate.py: qmoed exited with %d" % proc.returncode)
            time.sleep(0.02)
    sys.exit("generate.py: the private qmoed did not come up")


def proc_memory(pid):
    """(VmRSS, VmHWM) of a process in bytes, or None when /proc does not
    let us read it."""
    try:
        with open("/proc/%s/status" % pid) as f:
            kv = dict(line.split(":", 1) for line in f if ":" in line)
        return tuple(int(kv[k].split()[0]) << 10 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return None


def daemon_pid(client, private):
    """The daemon's pid: ours when we started it, else the socket peer's
    (SO_PEERCRED)."""
    if private:
        return private[0].pid
    import socket
    import struct

    try:
        client.status()  # connected
        raw = client._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                      struct.calcsize("3i"))
        return struct.unpack("3i", raw)[0]
    except (OSError, AttributeError, qmoe_client.QmoeError):
        return None


def ensure_loaded(client, name, bank):
    for m in client.models():
        if m["name"] == name:
            return m
    return client.load_model(name, os.path.abspath(bank))


def prompt_ids(a, model_dir, torch):
    if a.prompt_ids:
        return torch.tensor([[int(x) for x in a.prompt_ids.split(",")]]), None
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        sys.exit("generate.py: %s has no tokenizer (%s); give token ids with --prompt-ids 1,2,3"
                 % (model_dir, str(e).splitlines()[0]))
    return tok(a.prompt, return_tensors="pt").input_ids, tok


def write_trace(path, trace, layers, experts, k, meta):
    """hook.trace (one (bank layer, ids [T, k']) per call, every layer once
    per forward pass) as a .qmtr of [tokens, layers, k] rows."""
    import numpy as np
    import qmoe_trace

    rows = []
    for p in range(0, len(trace), layers):
        step = sorted(trace[p:p + layers], key=lambda e: e[0])
        ids = np.stack([np.pad(e[1], ((0, 0), (0, k - e[1].shape[1])), constant_values=-1)
                        for e in step], axis=1)  # [T, L, k]
        rows.append(ids)
    ids = np.concatenate(rows, 0).astype(np.int16)
    tr = qmoe_trace.Trace(ids.shape[0], layers, k, experts, list(ids.reshape(-1)), meta=meta)
    qmoe_trace.write_trace(path, tr)
    return ids.shape[0]


def generate(model, ids, n, torch):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--bank", help="the bank (imported here when missing)")
    ap.add_argument("--name", help="model name in qmoed (default: the bank's file name)")
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8), help="import bits (8)")
    ap.add_argument("--policy", default="whole_bank")
    ap.add_argument("--budget", help="expert-weight budget: bytes, a fraction, NN%%, or auto (sized "
                    "by qmoed from the memory this machine and its cgroup give)")
    ap.add_argument("--precision", choices=("exact", "fast"))
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--prompt-ids", help="token ids (models without a tokenizer)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--record-trace", metavar="FILE", help="write the routing as a .qmtr trace")
    ap.add_argument("--dtype", default="auto",
                    help="the engine's dtype (float32, bfloat16, ...; auto: the checkpoint's)")
    ap.add_argument("--compare", action="store_true",
                    help="also generate with the whole checkpoint in transformers (the bank's "
                         "dequantised experts) and compare")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--socket")
    ap.add_argument("--qmoed", help="qmoed binary for a private daemon")
    ap.add_argument("--qmoe-bank", help="qmoe-bank binary for the import")
    ap.add_argument("--threads", type=int, help="compute threads of a private daemon")
    a = ap.parse_args(argv)

    import torch
    import transformers

    bank = ensure_bank(a)
    name = a.name or os.path.splitext(os.path.basename(bank))[0].replace("+", "-")[:64]
    client, private = connect_or_spawn(a, bank, name)
    try:
        summary = ensure_loaded(client, name, bank)
        ids, tok = prompt_ids(a, a.model, torch)
        figures = {"model": a.model, "bank": bank, "policy": a.policy, "budget": a.budget,
                   "prompt_tokens": int(ids.shape[1]), "new_tokens": a.max_new_tokens}
        if a.compare:
            sys.path.insert(0, os.path.join(ROOT, "tests", "clients"))
            from hf_generate_check import reference_model, write_dequantised_experts
            full = reference_model(a.model, torch, transformers, dtype=a.dtype)
            write_dequantised_experts(full, bank, torch)
            ref, ref_s = generate(full, ids, a.max_new_tokens, torch)
            figures["transformers_tokens_per_s"] = a.max_new_tokens / ref_s
            del full
        model = qhook.from_pretrained(a.model, client, name, policy=a.policy, budget=a.budget,
                                      precision=a.precision, dtype=a.dtype)
        engine_after_load = proc_memory("self")
        hook = model.qmoe_hook
        if a.record_trace:
            hook.trace = []
        try:
            out, dt = generate(model, ids, a.max_new_tokens, torch)
            st = hook.stats()
            layers = len(set(hook.layers.values()))
            if a.record_trace:
                k = max(e[1].shape[1] for e in hook.trace)
                n = write_trace(a.record_trace, hook.trace, layers, int(summary["experts"]), k,
                                {"generator": "examples/generate.py", "model": a.model,
                                 "policy": a.policy, "budget": a.budget})
                figures["trace_tokens"] = n
            engine = proc_memory("self")
            pid = daemon_pid(client, private)
            daemon = proc_memory(pid) if pid else None
        finally:
            hook.close()
        total_tokens = figures["prompt_tokens"] + a.max_new_tokens
        figures.update({
            "tokens_per_s": a.max_new_tokens / dt,
            "hit_rate": st["hit_rate"],
            "bytes_paged_per_token": st["bytes_paged"] / max(1, total_tokens),
            "qmoed_calls": st["calls"],
            "qmoed_compute_us": st["compute_us"],
            "hook_wall_s": st["wall_s"],
            "token_ids": out,
            "engine_rss_after_load": engine_after_load and engine_after_load[0],
            "engine_rss": engine and engine[0], "engine_peak_rss": engine and engine[1],
            "qmoed_rss": daemon and daemon[0], "qmoed_peak_rss": daemon and daemon[1],
        })
        if a.compare:
            figures["same_tokens_as_transformers"] = out == ref
        if a.json:
            print(json.dumps(figures))
        else:
            text = tok.decode(out) if tok is not None else " ".join(map(str, out))
            print(text)
            print("%d tokens in %.3f s: %.1f tokens/s; hit rate %.3f; %.0f bytes paged per token"
                  % (a.max_new_tokens, dt, figures["tokens_per_s"], st["hit_rate"],
                     figures["bytes_paged_per_token"]))
            mib = lambda b: "%.0f MiB" % (b / 2**20) if b is not None else "n/a"  # noqa: E731
            print("memory: engine RSS %s (peak %s), qmoed RSS %s (peak %s)"
                  % (mib(figures["engine_rss"]), mib(figures["engine_peak_rss"]),
                     mib(figures["qmoed_rss"]), mib(figures["qmoed_peak_rss"])))
            if a.compare:
                print("transformers with the whole checkpoint: %.1f tokens/s; same tokens: %s"
                      % (figures["transformers_tokens_per_s"],
                         figures["same_tokens_as_transformers"]))
            if a.record_trace:
                print("routing trace: %s (%d tokens)" % (a.record_trace, figures["trace_tokens"]))
        if a.compare and out != ref:
            return 1
        return 0
    finally:
        client.close()
        if private:
            proc, d = private
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
