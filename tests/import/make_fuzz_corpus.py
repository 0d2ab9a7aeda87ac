#!/usr/bin/env python3
"""Writes the seed corpora of the importer's fuzz targets (tests/import/corpus/)
from the test fixtures: run it again after a fixture changes.

    .venv/bin/python tests/import/make_fuzz_corpus.py

corpus/hf_config   every fixture's config.json, as it is
corpus/hf_index    the Mixtral fixture's index, and one naming fuzz_hf.c's two shards
corpus/hf_import   per fixture, a small checkpoint of its family: its config.json with
                   hidden 16, 2 experts, top-1 and the intermediate size 8 (32 and 32
                   for MXFP4), and every tensor the import reads (its own names), in one
                   shard: small, so that a whole import costs little to run
corpus/gguf        one-block GGUF files (hidden and width 32, 1 expert; 4 for deepseek2)
                   of every family with a GGUF form, in the block-32 ggml types
corpus/ggml_blocks one file per ggml type and layout byte: the selector, then raw blocks
                   (MXFP4 also through the e2m1 code book)"""

import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tools"))
import make_hf_fixtures as mk  # noqa: E402

FIX = os.path.join(HERE, "fixtures")
OUT = os.path.join(HERE, "corpus")
rng = np.random.default_rng(25)


def put(kind, name, data):
    os.makedirs(os.path.join(OUT, kind), exist_ok=True)
    with open(os.path.join(OUT, kind, name), "wb") as f:
        f.write(data)


def safetensors_bytes(tensors):
    path = os.path.join(OUT, ".tmp.safetensors")
    mk.write_safetensors(path, tensors)
    data = open(path, "rb").read()
    os.remove(path)
    return data


def f32(*shape, scale=0.1):
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return ("F32", list(shape), a.tobytes())


def tiny_checkpoint(name):
    cfg = json.load(open(os.path.join(FIX, name, "config.json")))
    mt = cfg["model_type"]
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    H, E, I = 16, 2, (32 if mxfp4 else 8)
    cfg["hidden_size"] = 32 if mxfp4 else H
    H = cfg["hidden_size"]
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        if k in cfg:
            cfg[k] = E
    cfg["num_experts_per_tok"] = 1
    inter_key = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    cfg[inter_key] = I
    if "n_group" in cfg:
        cfg["n_group"], cfg["topk_group"] = 1, 1
    if fp8:
        cfg["quantization_config"]["weight_block_size"] = [4, 8]
    layers = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0)
    only = set(cfg.get("mlp_only_layers", []) or [])
    t = {}
    for l in range(layers):
        if l < first_dense or l in only:
            continue
        moe = "block_sparse_moe" if mt == "mixtral" else "mlp"
        router = "router" if mt == "gpt_oss" else "gate"
        p = f"model.layers.{l}.{moe}."
        t[p + router + ".weight"] = f32(E, H, scale=0.5)
        if mt == "gpt_oss":
            t[p + router + ".bias"] = f32(E)
            t[p + "experts.gate_up_proj_bias"] = f32(E, 2 * I)
            t[p + "experts.down_proj_bias"] = f32(E, H)
            if mxfp4:
                t[p + "experts.gate_up_proj_blocks"] = ("U8", [E, 2 * I, H // 32, 16], rng.integers(0, 256, E * 2 * I * H // 2, dtype=np.uint8).tobytes())
                t[p + "experts.gate_up_proj_scales"] = ("U8", [E, 2 * I, H // 32], rng.integers(118, 126, E * 2 * I * H // 32, dtype=np.uint8).tobytes())
                t[p + "experts.down_proj_blocks"] = ("U8", [E, H, I // 32, 16], rng.integers(0, 256, E * H * I // 2, dtype=np.uint8).tobytes())
                t[p + "experts.down_proj_scales"] = ("U8", [E, H, I // 32], rng.integers(118, 126, E * H * I // 32, dtype=np.uint8).tobytes())
            else:
                t[p + "experts.gate_up_proj"] = f32(E, H, 2 * I)
                t[p + "experts.down_proj"] = f32(E, I, H)
            continue
        if mt == "deepseek_v3":
            t[p + "gate.e_score_correction_bias"] = f32(E)
        names = ("w1", "w3", "w2") if mt == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            for n, shape in zip(names, ((I, H), (I, H), (H, I))):
                key = f"{p}experts.{e}.{n}.weight"
                if fp8:
                    t[key] = ("F8_E4M3", list(shape), rng.integers(0, 0x7e, shape[0] * shape[1], dtype=np.uint8).tobytes())
                    t[key + "_scale_inv"] = f32(-(-shape[0] // 4), -(-shape[1] // 8), scale=0.01)
                else:
                    t[key] = f32(*shape)
    config = json.dumps(cfg).encode()
    return struct.pack("<I", len(config)) + config + safetensors_bytes(t)


def main():
    names = sorted(d for d in os.listdir(FIX) if os.path.isdir(os.path.join(FIX, d)))
    for name in names:
        put("hf_config", name + ".json", open(os.path.join(FIX, name, "config.json"), "rb").read())
        put("hf_import", name, tiny_checkpoint(name))
    put("hf_index", "mixtral.json", open(os.path.join(FIX, "mixtral", "model.safetensors.index.json"), "rb").read())
    wm = {"model.layers.0.block_sparse_moe.gate.weight": "model-00001-of-00002.safetensors"}
    for e in range(2):
        for k in ("w1", "w3", "w2"):
            wm[f"model.layers.0.block_sparse_moe.experts.{e}.{k}.weight"] = f"model-0000{e + 1}-of-00002.safetensors"
    put("hf_index", "fuzz_hf_shards.json", json.dumps({"metadata": {}, "weight_map": wm}).encode())

    import gguf
    from gguf import GGMLQuantizationType as Q
    archs = {"llama": {}, "qwen2moe": {}, "qwen3moe": {}, "olmoe": {}, "gpt-oss": {},
             "deepseek2": {"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID,
                           "expert_weights_scale": 2.5, "expert_group_count": 2,
                           "expert_group_used_count": 1}}
    types = [Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.MXFP4, Q.F16, Q.F32, Q.BF16, Q.Q4_1, Q.Q5_1]
    H = I = 32
    for i, (arch, keys) in enumerate(archs.items()):
        E = 4 if arch == "deepseek2" else 1  # two groups of two: top2_sum needs two
        mine = types if arch == "qwen3moe" else [Q.Q8_0] if arch == "deepseek2" else [types[i]]
        for qt in mine:
            path = os.path.join(OUT, ".tmp.gguf")
            w = gguf.GGUFWriter(path, arch)
            w.add_block_count(1)
            w.add_embedding_length(H)
            w.add_expert_count(E)
            w.add_expert_used_count(1)
            w.add_expert_feed_forward_length(I)
            for k, v in keys.items():
                getattr(w, "add_" + k)(v)
            for b in range(1):
                for nm, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
                    x = (rng.standard_normal((E, rows, cols)) * 0.05).astype(np.float32)
                    if qt == Q.F32:
                        w.add_tensor(f"blk.{b}.ffn_{nm}_exps.weight", x)
                    elif qt == Q.F16:
                        w.add_tensor(f"blk.{b}.ffn_{nm}_exps.weight", x.astype(np.float16))
                    else:
                        w.add_tensor(f"blk.{b}.ffn_{nm}_exps.weight", gguf.quants.quantize(x, qt), raw_dtype=qt)
                    if arch == "gpt-oss":
                        w.add_tensor(f"blk.{b}.ffn_{nm}_exps.bias", (rng.standard_normal((E, rows)) * 0.1).astype(np.float32))
                w.add_tensor(f"blk.{b}.ffn_gate_inp.weight", (rng.standard_normal((E, H)) * 0.2).astype(np.float32))
                if arch == "gpt-oss":
                    w.add_tensor(f"blk.{b}.ffn_gate_inp.bias", (rng.standard_normal(E) * 0.2).astype(np.float32))
                if arch == "deepseek2":
                    w.add_tensor(f"blk.{b}.exp_probs_b.bias", (rng.standard_normal(E) * 0.05).astype(np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            put("gguf", f"{arch}-{qt.name}.gguf", open(path, "rb").read())
            os.remove(path)

    order = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.Q2_K,
             Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # fuzz_ggml_blocks.c's TYPES
    for i, qt in enumerate(order):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n = max(2, 256 // block)
        x = (rng.standard_normal(n * block) * 0.05).astype(np.float32)
        if qt in (Q.F32,):
            raw = x.tobytes()
        elif qt == Q.F16:
            raw = x.astype(np.float16).tobytes()
        elif qt in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            raw = rng.integers(0, 256, n * size, dtype=np.uint8)
            d = np.array([0.002] * n, np.float16).view(np.uint8).reshape(n, 2)
            raw = raw.reshape(n, size)
            at = {Q.Q2_K: 80, Q.Q3_K: 108, Q.Q4_K: 0, Q.Q5_K: 0, Q.Q6_K: 208}[qt]
            raw[:, at:at + 2] = d
            raw = raw.tobytes()
        else:
            raw = gguf.quants.quantize(x.reshape(1, -1), qt).tobytes()
        for layout in (0x00, 0x20, 0x40, 0x80):
            put("ggml_blocks", f"{qt.name}-{layout:02x}", bytes([i | layout]) + raw)
        if qt == Q.MXFP4:  # int4 with 0x10: the e2m1 code book; the low 5 bits still pick MXFP4
            for layout in (0x50, 0xd0):
                put("ggml_blocks", f"{qt.name}-{layout:02x}",
                    bytes([(i - 16) % len(order) | layout]) + raw)


if __name__ == "__main__":
    main()
