#!/usr/bin/env python3
"""Regenerates tests/import/fixtures: tiny random Hugging Face MoE checkpoints of
every family `qmoe-bank import hf` supports, and the outputs transformers
computes for them (the golden files the tests compare against).

Needs torch + transformers (a separate venv; CI does not run this):
    /work/venv-torch/bin/python tools/make_hf_fixtures.py --qmoe-bank build/tools/qmoe-bank/qmoe-bank

Per fixture directory: the checkpoint exactly as save_pretrained writes it
(config.json, model.safetensors or shards + index), rewritten into the Hub's
MXFP4 layout (gpt_oss_mxfp4) or FP8 block-scaled layout (deepseek_v3_fp8) where
named, and golden.safetensors:
    x                 [T, H] f32   the MoE block's input
    out.<i>           [T, H] f32   transformers' MoE block output for bank layer i,
                                   computed with the bank's dequantised weights
                                   written back into the block (fake quant) and the
                                   shared expert zeroed (it stays with the engine)
    topk_ids.<i>      [T, k] i32   the experts transformers chose
    topk_weights.<i>  [T, k] f32   their mixing weights, as transformers applies them
metadata: versions, the import arguments, and the sha256 of the bank the golden
was computed from (the tests re-import and compare)."""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_import_ref as ref  # noqa: E402
import qmoebank as qb  # noqa: E402

T = 7
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=32, max_position_embeddings=64, num_experts_per_tok=2)


def configs():
    import transformers as tf

    c = {}
    c["mixtral"] = (tf.MixtralConfig(intermediate_size=32, num_local_experts=8, **COMMON), {"shard": "200KB"})
    c["qwen3_moe"] = (tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                        head_dim=16, norm_topk_prob=True, **COMMON), {})
    q2 = dict(COMMON, num_hidden_layers=3)
    c["qwen2_moe"] = (tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                        shared_expert_intermediate_size=64, norm_topk_prob=False,
                                        mlp_only_layers=[1], **q2), {})
    c["olmoe"] = (tf.OlmoeConfig(intermediate_size=32, num_experts=8, norm_topk_prob=False, **COMMON), {})
    mla = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    ds = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4)
    c["deepseek_v2"] = (tf.DeepseekV2Config(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                            n_shared_experts=1, first_k_dense_replace=1,
                                            topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                            routed_scaling_factor=1.5, **mla, **ds), {})
    v3 = lambda: tf.DeepseekV3Config(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,  # noqa: E731
                                     n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5, norm_topk_prob=True, **mla, **ds)
    c["deepseek_v3"] = (v3(), {})
    c["deepseek_v3_fp8"] = (v3(), {"fp8": [16, 32]})
    gpt = dict(COMMON, head_dim=16)
    c["gpt_oss"] = (tf.GptOssConfig(intermediate_size=32, num_local_experts=8, **gpt), {})
    c["gpt_oss_mxfp4"] = (tf.GptOssConfig(intermediate_size=32, num_local_experts=8, **gpt), {"mxfp4": True})
    return c


# ---- source rewrites ---------------------------------------------------------

def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype string, shape, bytes)}; any dtype (F8_E4M3 too)."""
    header, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, shape, raw = tensors[k]
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def raw_of(arr):
    arr = np.ascontiguousarray(arr)
    dt = {np.dtype("float32"): "F32", np.dtype("uint8"): "U8"}[arr.dtype]
    return (dt, arr.shape, arr.tobytes())


E4M3_VALUES = ref.e4m3_to_f32(np.arange(256, dtype=np.uint8))


def to_e4m3(x):
    """Nearest e4m3fn byte of each value (|x| <= 448)."""
    ok = np.where(~np.isnan(E4M3_VALUES))[0]
    vals = E4M3_VALUES[ok]
    order = np.argsort(vals, kind="stable")
    sv, sb = vals[order], ok[order]
    i = np.clip(np.searchsorted(sv, x), 1, len(sv) - 1)
    pick = np.where(np.abs(x - sv[i - 1]) <= np.abs(sv[i] - x), i - 1, i)
    return sb[pick].astype(np.uint8)


def rewrite_fp8(ckdir, block):
    bn, bk = block
    path = os.path.join(ckdir, "model.safetensors")
    t = ref.read_safetensors_raw(path)
    out = {}
    for k, (dt, shape, raw) in t.items():
        if ".experts." in k and k.endswith(".weight"):
            w = ref.to_f32(dt, shape, raw).astype(np.float64)
            n, kk = w.shape
            s = np.zeros((-(-n // bn), -(-kk // bk)), np.float32)
            q = np.zeros(w.shape, np.uint8)
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                    s[i, j] = np.float32(max(np.abs(blk).max(), 1e-12) / 448.0)
                    q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = to_e4m3(blk / np.float64(s[i, j]))
            out[k] = ("F8_E4M3", shape, q.tobytes())
            out[k + "_scale_inv"] = raw_of(s)
        else:
            out[k] = (dt, shape, raw)
    write_safetensors(path, out, {"format": "pt"})
    cfg = json.load(open(os.path.join(ckdir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": [bn, bk]}
    json.dump(cfg, open(os.path.join(ckdir, "config.json"), "w"), indent=2)


def to_mxfp4(w):
    """w [..., N, K] f32 -> (blocks [..., N, K/32, 16] u8, scales [..., N, K/32] u8), nearest FP4."""
    *lead, n, k = w.shape
    g = w.reshape(*lead, n, k // 32, 32).astype(np.float64)
    amax = np.abs(g).max(axis=-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127)
    e = np.clip(e, -127, 127)
    scales = (e + 127).astype(np.uint8)
    half = g / np.exp2(e - 1)[..., None]  # in half units
    table = ref.FP4_HALF[:8]
    mag = np.abs(half)
    idx = np.abs(mag[..., None] - table).argmin(axis=-1)
    codes = np.where((half < 0) & (idx > 0), idx + 8, idx).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales


def rewrite_mxfp4(ckdir):
    path = os.path.join(ckdir, "model.safetensors")
    t = ref.read_safetensors_raw(path)
    out = {}
    for k, (dt, shape, raw) in t.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            w = np.transpose(ref.to_f32(dt, shape, raw), (0, 2, 1))  # output-row-major
            blocks, scales = to_mxfp4(np.ascontiguousarray(w))
            out[k + "_blocks"] = raw_of(blocks)
            out[k + "_scales"] = raw_of(scales)
        else:
            out[k] = (dt, shape, raw)
    write_safetensors(path, out, {"format": "pt"})
    cfg = json.load(open(os.path.join(ckdir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(ckdir, "config.json"), "w"), indent=2)


# ---- golden ------------------------------------------------------------------

def randomise(model, torch):
    """Default inits are tiny; spread routers (and DeepSeek's correction bias) so
    the top-k is far from ties, and give expert biases a visible size."""
    g = torch.Generator().manual_seed(7)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        with torch.no_grad():
            if name.endswith("gate.weight") or name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("e_score_correction_bias") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "experts" in name and p.dtype == torch.float32:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def write_back(fam, mlp, lt, cfg, torch):
    """The bank's dequantised weights into transformers' MoE block. fam is the
    checkpoint's entry of the importer's family table (hf_import_ref.families)."""
    w1 = qb.dequantize(cfg, "fc1", lt).astype(np.float32)  # [E, 2I, H] interleaved
    w2 = qb.dequantize(cfg, "fc2", lt).astype(np.float32)  # [E, H, I]
    tt = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    router = getattr(mlp, fam["hf"]["router"])
    with torch.no_grad():
        ex = mlp.experts
        if fam["hf"]["flags"]["fused_experts"]:  # input-major, gate/up interleaved
            ex.gate_up_proj.copy_(tt(np.transpose(w1, (0, 2, 1))))
            ex.down_proj.copy_(tt(np.transpose(w2, (0, 2, 1))))
        else:  # transformers packs gate rows then up rows
            ex.gate_up_proj.copy_(tt(np.concatenate([w1[:, 0::2], w1[:, 1::2]], axis=1)))
            ex.down_proj.copy_(tt(w2))
        if "fc1.bias" in lt:
            ex.gate_up_proj_bias.copy_(tt(lt["fc1.bias"]))
            ex.down_proj_bias.copy_(tt(lt["fc2.bias"]))
        router.weight.copy_(tt(lt["router.weight"]))
        if "router.bias" in lt:
            router.bias.copy_(tt(lt["router.bias"]))
        if "router.correction_bias" in lt:
            router.e_score_correction_bias.copy_(tt(lt["router.correction_bias"]))
        for shared in ("shared_expert", "shared_experts"):
            if hasattr(mlp, shared):
                getattr(mlp, shared).down_proj.weight.zero_()


def golden(name, fam, ckdir, bank, model, torch, transformers, args):
    cfg, tensors = qb.load_bank(bank)
    with open(bank, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    _, meta, _ = qb.read_header(bank)
    layer_map = json.loads(meta["qmoe.layer_map"])
    rng = np.random.default_rng(11)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    out = {"x": x}
    worst = 0.0
    for i, l in enumerate(layer_map):
        mlp = model.model.layers[l].mlp
        lt = qb.layer_tensors(tensors, i)
        write_back(fam, mlp, lt, cfg, torch)
        seen = {}

        def hook(mod, a, kw):
            seen["ids"], seen["w"] = a[1], a[2]

        h = mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            y = mlp(torch.from_numpy(x)[None])
        h.remove()
        y = (y[0] if isinstance(y, tuple) else y).reshape(T, -1).numpy()
        ids = seen["ids"].reshape(T, -1).numpy().astype(np.int32)
        w = seen["w"].reshape(T, -1).to(torch.float32).numpy()
        if w.shape[1] != ids.shape[1]:  # full [T, E] scores: gather the chosen
            w = np.take_along_axis(w, ids.astype(np.int64), axis=1)
        mine = ref.forward_given(cfg, lt, x, ids, w)
        rel = np.linalg.norm(mine - y) / np.linalg.norm(y)
        worst = max(worst, rel)
        assert rel < 1e-5, f"{name} layer {l}: numpy reference vs transformers {rel:.3g}"
        out[f"out.{i}"] = y.astype(np.float32)
        out[f"topk_ids.{i}"] = ids
        out[f"topk_weights.{i}"] = w.astype(np.float32)
    from safetensors.numpy import save_file
    save_file(out, os.path.join(ckdir, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "bank_sha256": sha, "import_args": json.dumps(args),
                        "reference_rel_err": f"{worst:.3e}"})
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qmoe-bank", default=os.path.join(HERE, "..", "build", "tools", "qmoe-bank", "qmoe-bank"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "import", "fixtures"))
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args(argv)
    import torch
    import transformers

    table = ref.families(a.qmoe_bank)
    torch.manual_seed(0)
    for name, (cfg, opts) in configs().items():
        if a.only and name not in a.only:
            continue
        ckdir = os.path.join(a.out, name)
        shutil.rmtree(ckdir, ignore_errors=True)
        torch.manual_seed(1)
        cfg.torch_dtype = "float32"
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomise(model, torch)
        model.eval()
        kw = {"max_shard_size": opts["shard"]} if "shard" in opts else {}
        model.save_pretrained(ckdir, **kw)
        for junk in ("generation_config.json",):
            if os.path.exists(os.path.join(ckdir, junk)):
                os.remove(os.path.join(ckdir, junk))
        if "fp8" in opts:
            rewrite_fp8(ckdir, opts["fp8"])
        if opts.get("mxfp4"):
            rewrite_mxfp4(ckdir)
        # MXFP4: the golden is the int8 bank's (the one onnxruntime reads); the
        # default e2m1 code book bank holds the same weights bit for bit.
        args = ["--mxfp4", "int8"] if opts.get("mxfp4") else []
        with tempfile.TemporaryDirectory() as td:
            bank = os.path.join(td, "bank.safetensors")
            r = subprocess.run([a.qmoe_bank, "import", "hf", ckdir, "--out", bank, "--quiet", *args],
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{name}: import failed: {r.stderr}")
            worst = golden(name, ref.family_of(ckdir, table), ckdir, bank, model, torch,
                           transformers, args)
        sizes = {f: os.path.getsize(os.path.join(ckdir, f)) for f in os.listdir(ckdir)}
        print(f"{name}: reference vs transformers {worst:.2e}; files {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
