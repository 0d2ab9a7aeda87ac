"""Greedy generation of a tiny transformers fixture twice - transformers with
the bank's dequantised weights in its own experts, then with its experts in
qmoed through qmoe_client.transformers - and what came out of each, as JSON.

Runs under the torch environment (test_transformers_hook.py starts it):
    python hf_generate_check.py --socket S --case FIXTURE_DIR BANK MODEL ... \
        [--policy P --budget B]... --tokens 32
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tools"))
sys.path.insert(0, os.path.join(SRC, "clients", "python"))

import qmoebank as qb  # noqa: E402
import qmoe_client  # noqa: E402
from qmoe_client import transformers as qhook  # noqa: E402


def write_dequantised_experts(model, bank, torch):
    """The bank's dequantised expert weights (and GPT-OSS's expert biases)
    into the model's own experts: what transformers computes with them is
    the reference qmoed must reproduce."""
    cfg, tensors = qb.load_bank(bank)
    _, meta, _ = qb.read_header(bank)
    layer_map = json.loads(meta["qmoe.layer_map"])
    tt = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    for i, l in enumerate(layer_map):
        lt = qb.layer_tensors(tensors, i)
        w1 = qb.dequantize(cfg, "fc1", lt)  # [E, 2I, H], gate/up interleaved
        w2 = qb.dequantize(cfg, "fc2", lt)  # [E, H, I]
        mlp = model.model.layers[l].mlp
        ex = mlp.experts
        with torch.no_grad():
            if getattr(ex, "is_transposed", False):  # GPT-OSS: interleaved, transposed, biases
                ex.gate_up_proj.copy_(tt(np.transpose(w1, (0, 2, 1))))
                ex.down_proj.copy_(tt(np.transpose(w2, (0, 2, 1))))
                ex.gate_up_proj_bias.copy_(tt(lt["fc1.bias"]))
                ex.down_proj_bias.copy_(tt(lt["fc2.bias"]))
            else:
                ex.gate_up_proj.copy_(tt(np.concatenate([w1[:, 0::2], w1[:, 1::2]], axis=1)))
                ex.down_proj.copy_(tt(w2))


def generate(model, ids, tokens, torch):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    dt = time.perf_counter() - t0
    seq = out.sequences[0, ids.shape[1]:].tolist()
    logits = torch.stack(out.logits, 0)[:, 0].to(torch.float64).numpy()
    return seq, logits, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--case", nargs=3, action="append", required=True,
                    metavar=("FIXTURE", "BANK", "MODEL"))
    ap.add_argument("--run", nargs=2, action="append", default=None, metavar=("POLICY", "BUDGET"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="1,5,9,2,7")
    a = ap.parse_args()
    import torch
    import transformers

    torch.manual_seed(0)
    runs = a.run or [["whole_bank", "100%"]]
    client = qmoe_client.Client(a.socket)
    ids = torch.tensor([[int(x) for x in a.prompt.split(",")]])
    report = {}
    for fixture, bank, name in a.case:
        model = transformers.AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32)
        model.eval()
        write_dequantised_experts(model, bank, torch)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        impl_before = model.get_experts_implementation()
        ref_ids, ref_logits, ref_s = generate(model, ids, a.tokens, torch)
        res = {"ref_ids": ref_ids, "ref_s": ref_s, "runs": []}
        for policy, budget in runs:
            hook = qhook.attach(model, client, name, policy=policy,
                                budget=None if budget == "100%" else budget)
            got_ids, got_logits, got_s = generate(model, ids, a.tokens, torch)
            st = hook.stats()
            hook.detach()
            scale = np.max(np.abs(ref_logits), axis=-1, keepdims=True)
            rel = float(np.max(np.abs(got_logits - ref_logits) / scale))
            res["runs"].append({"policy": policy, "budget": budget, "ids": got_ids,
                                "max_rel_logit_err": rel, "s": got_s, "stats": st,
                                "layers": sorted(set(hook.layers.values()))})
        # Detached: the model is itself again (same implementation, same
        # weights, the same tokens).
        again_ids, _, _ = generate(model, ids, a.tokens, torch)
        res["detached_same"] = (again_ids == ref_ids and
                                model.get_experts_implementation() == impl_before and
                                all(torch.equal(before[k], v)
                                    for k, v in model.state_dict().items()))
        report[name] = res
    client.close()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
