"""A transformers generation with its experts in qmoed, as an engine runs
one: the checkpoint loaded without its experts (qmoe_client.transformers
.from_pretrained), greedy tokens from fixed prompt ids; prints JSON: the
tokens, the client's restores, the hook's stats and the wall time of the
generation. Runs under the torch environment; test_restart.py and
bench/restart/run.py start it, kill the daemon under it and compare its
tokens with an undisturbed run's.

    python restart_generate.py --socket S --fixture DIR --model NAME \
        [--bank FILE] [--policy P --budget B] --tokens N [--reconnect S]
"""
import argparse
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "clients", "python"))

import qmoe_client  # noqa: E402
from qmoe_client import transformers as qt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--bank", help="loaded again by the client when a restarted daemon lacks it")
    ap.add_argument("--policy", default=None)
    ap.add_argument("--budget", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-ids", default="1,2,3,4,5")
    ap.add_argument("--reconnect", type=float, default=None)
    a = ap.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    import torch

    torch.manual_seed(0)
    c = qmoe_client.Client(a.socket, reconnect=a.reconnect)
    if a.bank:  # as llama.cpp's --qmoed-bank: loaded when the daemon lacks it, and again after
        c.set_model_bank(a.model, a.bank)
        if a.model not in [m["name"] for m in c.models()]:
            c.load_model(a.model, a.bank)
    m = qt.from_pretrained(a.fixture, c, a.model, policy=a.policy, budget=a.budget,
                           dtype=torch.float32)
    ids = torch.tensor([[int(t) for t in a.prompt_ids.split(",")]])
    print("generating", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                         do_sample=False)
    wall = time.monotonic() - t0
    stats = m.qmoe_hook.stats()
    m.qmoe_hook.close()
    print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "restores": c.restores,
                      "wall_s": wall, "stats": stats}))


if __name__ == "__main__":
    main()
