#!/usr/bin/env python3
"""Tokens/s of greedy generation on a tiny fixture model: transformers' own
experts (the bank's dequantised weights) against the experts in qmoed
through qmoe_client.transformers, alternating in rounds within one process
(same machine, same run). On a model this small (hidden 64, 8 experts) the
experts cost next to nothing, so the difference is the per-layer cost of
going to qmoed (hook, shared map, socket, queue), not expert compute.

Run with the torch environment's python:
  $QMOE_TORCH_VENV/bin/python bench/hook/bench_generate.py --build build \
      [--fixture mixtral] [--tokens 48] [--rounds 5]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import hook_bench

sys.path.insert(0, os.path.join(hook_bench.ROOT, "tests", "clients"))


def main():
    ap = argparse.ArgumentParser()
    hook_bench.add_common_args(ap, fixture="mixtral", tokens=48)
    ap.add_argument("--policy", default="whole_bank")
    ap.add_argument("--budget")
    a = hook_bench.parse(ap)
    import torch
    import transformers
    import qmoe_client
    from qmoe_client import transformers as qhook
    from hf_generate_check import write_dequantised_experts
    from qmoed_harness import Daemon

    d = tempfile.mkdtemp(prefix="bench-generate-")
    fixture, bank = hook_bench.fixture_bank(a.fixture, d)
    dm = Daemon(models={a.fixture: bank}, workdir=d, args=["--log-level", "warning"])
    try:
        client = qmoe_client.Client(dm.socket)
        model = transformers.AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)
        model.eval()
        write_dequantised_experts(model, bank, torch)
        ids = torch.tensor([[1, 5, 9, 2, 7]])

        def gen():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                                     do_sample=False, pad_token_id=0)
            return a.tokens / (time.perf_counter() - t0), out[0].tolist()

        own, served, per_call = [], [], []
        gen()  # warm-up
        for _ in range(a.rounds):
            tps, ref = gen()
            own.append(tps)
            hook = qhook.attach(model, client, a.fixture, policy=a.policy, budget=a.budget)
            hook._ensure_map(1 << 20)  # the map exists before timing, as in a long run
            tps, got = gen()
            st = hook.stats()
            hook.detach()
            assert got == ref, "tokens differ"
            served.append(tps)
            per_call.append(1e6 * st["wall_s"] / st["calls"])
        client.close()
    finally:
        dm.stop()
    med = statistics.median
    print("fixture %s, %d new tokens, %d rounds (median, min-max):" % (a.fixture, a.tokens,
                                                                     a.rounds))
    print("  transformers' own experts: %.1f tokens/s (%.1f-%.1f)" % (med(own), min(own), max(own)))
    print("  experts in qmoed:          %.1f tokens/s (%.1f-%.1f)" % (med(served), min(served),
                                                                      max(served)))
    print("  per MoE layer call through the hook: %.0f µs median (%.0f-%.0f)"
          % (med(per_call), min(per_call), max(per_call)))


if __name__ == "__main__":
    main()
