#!/usr/bin/env python3
"""One transformers engine run of bench/e2e (run.py starts it in a process of
its own, so that its RSS is its own): load the checkpoint, in full
(--road full) or without its experts through
qmoe_client.transformers.from_pretrained (--road qmoed; --road zero: the
same, every MoE layer answered by zeros without a call), prefill a prompt
and decode greedily, and print one JSON object:

  load_s, rss_before_load, rss_after_load (and its RssAnon and RssFile
  parts: rss_after_load_anon, rss_after_load_file), peak_rss (VmHWM: the
  process's peak, load included; the weights are copied out of the
  checkpoint's mmap into the process's memory after the load unless --mmap:
  resident()), prefill_tokens, prefill_s, decode_tokens, decode_s,
  and for --road qmoed the hook's stats (calls, hits, misses, bytes_paged,
  compute_us, hit_rate, wall_s, wait_s) and the session's budget, and
  decode_call: the medians over the decode's layer calls (one token each)
  of the hook's wall time, its wait for the answer and the daemon's
  compute_us, in µs (what a layer call costs in this engine's regime).

The prompt is --prompt token ids of the checkpoint's tokenizer over a fixed
text; the prefill is the first forward pass of generate(), the decode the
--decode forward passes after it (generate asks for decode + 1 tokens).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, HERE)


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return None


def prompt_ids(ckpt, n, torch):
    from transformers import AutoTokenizer

    import checkpoints

    tok = AutoTokenizer.from_pretrained(ckpt)
    text, ids = "", []
    for line in checkpoints._corpus(1, lines=400):
        text += line
        ids = tok(text).input_ids
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise SystemExit("the tokenizer gave %d tokens for the prompt text, %d asked" % (len(ids), n))
    return torch.tensor([ids[:n]])


def resident(model, torch):
    """Copies every loaded parameter and buffer into the process's own
    memory, one at a time. transformers leaves the tensors it needs not
    convert as views of the checkpoint's mmap (GPT-OSS's fused experts
    among them): on a machine whose page cache other processes take, their
    pages are evicted and read from disk again, and the run measures the
    disk. Meta tensors (the experts of from_pretrained) stay as they are."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type != "meta":
                t.data = t.data.clone()


def timed_calls(hook):
    """Wraps the hook's call: a list that gets (tokens, wall s, wait s,
    compute µs) per layer call."""
    forward, st, calls = hook._forward, hook._stats, []

    def timed(layer, hidden, ids, weights):
        w0, c0, t0 = st["wait_s"], st["compute_us"], time.perf_counter()
        out = forward(layer, hidden, ids, weights)
        calls.append((hidden.numel() // hidden.shape[-1], time.perf_counter() - t0,
                      st["wait_s"] - w0, st["compute_us"] - c0))
        return out

    hook._forward = timed
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--road", choices=("full", "qmoed", "zero"), required=True,
                    help="full: transformers alone; qmoed: from_pretrained; zero: "
                    "from_pretrained with every MoE layer answered by zeros without a call "
                    "(the engine's own share of a token: the ceiling of any MoE backend)")
    ap.add_argument("--socket")
    ap.add_argument("--model", help="the bank's name in qmoed")
    ap.add_argument("--policy")
    ap.add_argument("--budget")
    ap.add_argument("--precision", choices=("exact", "fast"),
                    help="the session's precision (default: the daemon's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--mmap", action="store_true",
                    help="leave the weights transformers maps from the checkpoint mapped")
    a = ap.parse_args()
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    ids = prompt_ids(a.checkpoint, a.prompt, torch)
    out = {"rss_before_load": status_bytes("VmRSS")}
    t0 = time.perf_counter()
    if a.road == "full":
        model = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint)
        hook = None
    else:
        import qmoe_client
        from qmoe_client import transformers as qt

        client = qmoe_client.Client(a.socket, timeout=600)
        model = qt.from_pretrained(a.checkpoint, client, a.model, policy=a.policy,
                                   budget=a.budget, precision=a.precision)
        hook = model.qmoe_hook
        if a.road == "zero":
            hook._forward = lambda layer, hidden, ids, weights: torch.zeros_like(hidden)
        else:
            calls = timed_calls(hook)
    if not a.mmap:
        resident(model, torch)
    out["load_s"] = time.perf_counter() - t0
    out["rss_after_load"] = status_bytes("VmRSS")
    out["rss_after_load_anon"] = status_bytes("RssAnon")
    out["rss_after_load_file"] = status_bytes("RssFile")
    out["dtype"] = str(model.dtype).replace("torch.", "")
    stamps = []
    model.register_forward_hook(lambda *args: stamps.append(time.perf_counter()))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.decode + 1,
                       min_new_tokens=a.decode + 1, do_sample=False, pad_token_id=0)
    if len(stamps) != a.decode + 1:
        raise SystemExit("generate ran %d forward passes, %d expected" % (len(stamps), a.decode + 1))
    out.update({"prefill_tokens": a.prompt, "prefill_s": stamps[0] - t0,
                "decode_tokens": a.decode, "decode_s": stamps[-1] - stamps[0],
                "peak_rss": status_bytes("VmHWM"), "rss_end": status_bytes("VmRSS")})
    if hook is not None and a.road == "zero":
        hook.close()
    elif hook is not None:
        one = [c for c in calls if c[0] == 1]
        if one:
            out["decode_call"] = {"calls": len(one),
                                  "hook_wall_us": statistics.median(c[1] for c in one) * 1e6,
                                  "wait_us": statistics.median(c[2] for c in one) * 1e6,
                                  "compute_us": statistics.median(c[3] for c in one)}
        out["hook"] = hook.stats()
        out["hook"]["layers"] = len(set(hook.layers.values()))
        hook.close()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
