#!/usr/bin/env python3
"""Writes a synthetic Hugging Face MoE checkpoint (Qwen3-MoE names and layout,
bf16, one shard per layer + model.safetensors.index.json) for the import
benchmark. Shapes default to Qwen3-30B-A3B's experts (H 2048, I 768, E 128):
4 layers = 4.8 GB of expert weights. The values are Gaussian bf16 from one
--pool-mib pool (256 MiB), reused at shifting offsets (the importer's speed does not
depend on them)."""

import argparse
import json
import os

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--pool-mib", type=int, default=256, help="random bf16 values drawn once")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rng = np.random.default_rng(1)
    pool = (rng.standard_normal(a.pool_mib << 19, dtype=np.float32) * 0.02)
    pool = (pool.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 (truncated)
    H, I, E = a.hidden, a.inter, a.experts
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
           "hidden_size": H, "moe_intermediate_size": I, "intermediate_size": 6144,
           "num_hidden_layers": a.layers, "num_experts": E, "num_experts_per_tok": 8,
           "norm_topk_prob": True, "torch_dtype": "bfloat16"}
    json.dump(cfg, open(os.path.join(a.dir, "config.json"), "w"), indent=1)
    weight_map, at = {}, 0
    for l in range(a.layers):
        fname = f"model-{l + 1:05d}-of-{a.layers:05d}.safetensors"
        names = [(f"model.layers.{l}.mlp.gate.weight", [E, H])]
        for e in range(E):
            for p, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
                names.append((f"model.layers.{l}.mlp.experts.{e}.{p}.weight", shape))
        header, off = {}, 0
        for n, shape in names:
            nbytes = shape[0] * shape[1] * 2
            header[n] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[n] = fname
        h = json.dumps(header).encode()
        h += b" " * (-(8 + len(h)) % 8)
        with open(os.path.join(a.dir, fname), "wb") as f:
            f.write(len(h).to_bytes(8, "little"))
            f.write(h)
            left = off
            while left:
                start = ((at * 4099) % (len(pool) // 4)) * 2  # whole bf16 values
                chunk = min(left, len(pool) - start)
                f.write(pool[start:start + chunk])
                left -= chunk
                at += 1
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(a.dir, "model.safetensors.index.json"), "w"))


if __name__ == "__main__":
    main()
