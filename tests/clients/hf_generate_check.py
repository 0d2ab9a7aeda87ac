"""Greedy generation of tiny transformers fixtures: transformers with the
bank's dequantised weights in its own experts (the reference), then the
experts in qmoed through qmoe_client.transformers, both roads:
from_pretrained (the checkpoint loaded without its experts, every tensor
read logged) and attach (a full model attached); what came out, as JSON.

Runs under the torch environment (test_transformers_hook.py starts it):
    python hf_generate_check.py --socket S --case FIXTURE_DIR BANK MODEL ... \
        [--run POLICY BUDGET]... [--attach-run POLICY BUDGET]... \
        [--attach-models M,M] --tokens 32
"""
import argparse
import contextlib
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


def reference_model(fixture, torch, transformers, dtype=None):
    """The fixture loaded in full, in f32 (or `dtype`). An MXFP4 checkpoint is loaded
    without its quantization_config (transformers' MXFP4 loader needs
    accelerate): its experts come up uninitialised, which
    write_dequantised_experts overwrites."""
    kw = {}
    cfg = transformers.AutoConfig.from_pretrained(fixture)
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
        kw["config"] = cfg
    return transformers.AutoModelForCausalLM.from_pretrained(fixture, dtype=dtype or torch.float32,
                                                             **kw)


class _LoggedSlice:
    """A safetensors slice whose data reads are logged (key, bytes)."""

    def __init__(self, inner, key, log):
        self._inner, self._key, self._log = inner, key, log

    def __getitem__(self, index):
        t = self._inner[index]
        self._log.append((self._key, t.numel() * t.element_size()))
        return t

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _LoggedFile:
    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def get_slice(self, key):
        return _LoggedSlice(self._inner.get_slice(key), key, self._log)

    def get_tensor(self, key):
        t = self._inner.get_tensor(key)
        self._log.append((key, t.numel() * t.element_size()))
        return t

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@contextlib.contextmanager
def logged_reads(log):
    """transformers' checkpoint files opened through a wrapper that logs
    every tensor whose data is read: (checkpoint key, bytes)."""
    import transformers.modeling_utils as mu

    inner = mu.safe_open

    def opener(*args, **kwargs):
        return _LoggedFile(inner(*args, **kwargs), log)

    mu.safe_open = opener
    try:
        yield log
    finally:
        mu.safe_open = inner


def checkpoint_keys(fixture):
    """Every tensor name of the fixture's safetensors files."""
    from safetensors import safe_open

    keys = []
    for f in sorted(os.listdir(fixture)):
        if f.endswith(".safetensors") and f != "golden.safetensors":
            with safe_open(os.path.join(fixture, f), framework="pt") as g:
                keys += list(g.keys())
    return keys


def generate(model, ids, tokens, torch):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    dt = time.perf_counter() - t0
    seq = out.sequences[0, ids.shape[1]:].tolist()
    logits = torch.stack(out.logits, 0)[:, 0].to(torch.float64).numpy()
    return seq, logits, dt


def rel_err(got, ref):
    scale = np.max(np.abs(ref), axis=-1, keepdims=True)
    return float(np.max(np.abs(got - ref) / scale))


def from_pretrained_run(fixture, bank, name, client, ids, tokens, policy, budget, ref, torch):
    """One generation through from_pretrained: what it read, what it left on
    meta, how its weights compare with the full load's, the tokens."""
    ref_model, ref_ids, ref_logits = ref
    log = []
    with logged_reads(log):
        model = qhook.from_pretrained(fixture, client, name, policy=policy,
                                      budget=None if budget == "100%" else budget,
                                      dtype=torch.float32)
    got_ids, got_logits, got_s = generate(model, ids, tokens, torch)
    hook = model.qmoe_hook
    st = hook.stats()
    meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    expert_params = sorted(n for n, p in model.named_parameters()
                           if n.startswith(tuple(m + "." for m in hook.layers)))
    full = dict(ref_model.named_parameters())
    full.update(ref_model.named_buffers())
    mine = dict(model.named_parameters())
    mine.update(model.named_buffers())
    differ = sorted(k for k, v in mine.items()
                    if not v.is_meta and not (v.dtype == full[k].dtype and torch.equal(v, full[k])))
    hook.close()
    try:
        model(ids)
        after_close = None
    except RuntimeError as e:
        after_close = str(e)
    return {"road": "from_pretrained", "policy": policy, "budget": budget, "ids": got_ids,
            "max_rel_logit_err": rel_err(got_logits, ref_logits), "s": got_s, "stats": st,
            "layers": sorted(set(hook.layers.values())), "meta_after_generation": meta,
            "expert_params": expert_params, "not_as_full_load": differ,
            "missing_from_engine": sorted(k for k in full if k not in mine),
            "read": sorted(set(k for k, _ in log)), "bytes_read": sum(b for _, b in log),
            "after_close": after_close}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--case", nargs=3, action="append", required=True,
                    metavar=("FIXTURE", "BANK", "MODEL"))
    ap.add_argument("--run", nargs=2, action="append", default=None, metavar=("POLICY", "BUDGET"),
                    help="a from_pretrained generation")
    ap.add_argument("--attach-run", nargs=2, action="append", default=None,
                    metavar=("POLICY", "BUDGET"), help="an attach generation")
    ap.add_argument("--attach-models", help="the models (comma-separated) of the attach runs "
                                            "(default: every case)")
    ap.add_argument("--anticipate-run", nargs=2, action="append", default=None,
                    metavar=("POLICY", "BUDGET"),
                    help="an attach generation on a client of its own with torch on one "
                         "thread (the hook then asks for an anticipating ring when a CPU is left)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="1,5,9,2,7")
    a = ap.parse_args()
    import torch
    import transformers

    torch.manual_seed(0)
    client = qmoe_client.Client(a.socket)
    ids = torch.tensor([[int(x) for x in a.prompt.split(",")]])
    report = {}
    for fixture, bank, name in a.case:
        model = reference_model(fixture, torch, transformers)
        model.eval()
        write_dequantised_experts(model, bank, torch)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        impl_before = model.get_experts_implementation()
        ref_ids, ref_logits, ref_s = generate(model, ids, a.tokens, torch)
        res = {"ref_ids": ref_ids, "ref_s": ref_s, "runs": [],
               "checkpoint_keys": checkpoint_keys(fixture)}
        for policy, budget in a.run or []:
            res["runs"].append(from_pretrained_run(fixture, bank, name, client, ids, a.tokens,
                                                   policy, budget, (model, ref_ids, ref_logits),
                                                   torch))
        attach_runs = a.attach_run or []
        if a.attach_models is not None and name not in a.attach_models.split(","):
            attach_runs = []
        for policy, budget in attach_runs:
            hook = qhook.attach(model, client, name, policy=policy,
                                budget=None if budget == "100%" else budget)
            got_ids, got_logits, got_s = generate(model, ids, a.tokens, torch)
            st = hook.stats()
            hook.detach()
            res["runs"].append({"road": "attach", "policy": policy, "budget": budget,
                                "ids": got_ids, "max_rel_logit_err": rel_err(got_logits, ref_logits),
                                "s": got_s, "stats": st,
                                "layers": sorted(set(hook.layers.values()))})
        for policy, budget in (a.anticipate_run or []) if attach_runs else []:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            c1 = qmoe_client.Client(a.socket)
            try:
                hook = qhook.attach(model, c1, name, policy=policy,
                                    budget=None if budget == "100%" else budget)
                got_ids, got_logits, got_s = generate(model, ids, a.tokens, torch)
                st = hook.stats()
                hook.detach()
            finally:
                torch.set_num_threads(threads)
            res["runs"].append({"road": "attach, one torch thread", "policy": policy,
                                "budget": budget, "ids": got_ids,
                                "max_rel_logit_err": rel_err(got_logits, ref_logits), "s": got_s,
                                "stats": st, "layers": sorted(set(hook.layers.values())),
                                "ring_anticipate": c1.ring_anticipate,
                                "cpus": len(os.sched_getaffinity(0))})
            c1.close()
        if attach_runs:
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
