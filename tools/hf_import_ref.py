"""Float64 references for imported banks (numpy only): the MoE block of a bank
layer with routing given as (ids, weights), the bank's own routing rule, and
the source matrices of a Hugging Face fixture as the importer reads them (FP8
and MXFP4 decoded; tensor names from the importer's family table).

Used by tools/make_hf_fixtures.py (with transformers) and by
tests/import/test_import_hf.py (without)."""

import json
import os
import struct

import numpy as np

import qmoebank as qb

FP4_HALF = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)


def read_safetensors_raw(path):
    """{name: (dtype string, shape, raw bytes)} of any safetensors file (F8 too)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def e4m3_to_f32(b):
    b = np.asarray(b, dtype=np.uint8)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = (b & 7).astype(np.float64)
    val = np.where(exp == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    return (sign * val).astype(np.float32)


def to_f32(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, "<f4").reshape(shape)
    if dtype == "F16":
        return np.frombuffer(raw, "<f2").astype(np.float32).reshape(shape)
    if dtype == "BF16":
        u = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if dtype == "F8_E4M3":
        return e4m3_to_f32(np.frombuffer(raw, np.uint8)).reshape(shape)
    if dtype == "U8":
        return np.frombuffer(raw, np.uint8).reshape(shape)
    raise ValueError(dtype)


def checkpoint_tensors(ckdir):
    out = {}
    for fn in sorted(os.listdir(ckdir)):
        if fn.endswith(".safetensors") and fn != "golden.safetensors":
            for k, (dt, shape, raw) in read_safetensors_raw(os.path.join(ckdir, fn)).items():
                out[k] = to_f32(dt, shape, raw)
    return out


def mxfp4_dequant(blocks, scales):
    """[..., G, 16] u8 blocks + [..., G] E8M0 -> f32 [..., G*32], low nibble = even column."""
    lo = FP4_HALF[blocks & 15]
    hi = FP4_HALF[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float64) - 128)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32).astype(np.float32)


def families(qmoe_bank):
    """The importer's family table (`qmoe-bank import --families`): a list of
    dicts, one per family, with its Hugging Face tensor names and flags."""
    import subprocess
    out = subprocess.run([qmoe_bank, "import", "--families"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def family_of(ckdir, table):
    """The table entry of the checkpoint at ckdir (config.json's model_type)."""
    mt = json.load(open(os.path.join(ckdir, "config.json")))["model_type"]
    return next(f for f in table if f["name"] == mt)


def source_matrices(ckdir, layer, family):
    """{"fc1": [E, 2I, H] interleaved gate/up, "fc2": [E, H, I]} of one model layer,
    f32 exactly as the checkpoint holds them (FP8 and MXFP4 decoded). family is
    the checkpoint's entry of families()."""
    cfg = json.load(open(os.path.join(ckdir, "config.json")))
    t = checkpoint_tensors(ckdir)
    hf = family["hf"]
    p = f"model.layers.{layer}.{hf['moe']}."
    if hf["flags"]["fused_experts"]:
        if p + "experts.gate_up_proj_blocks" in t:
            fc1 = mxfp4_dequant(t[p + "experts.gate_up_proj_blocks"], t[p + "experts.gate_up_proj_scales"])
            fc2 = mxfp4_dequant(t[p + "experts.down_proj_blocks"], t[p + "experts.down_proj_scales"])
        else:
            fc1 = np.transpose(t[p + "experts.gate_up_proj"], (0, 2, 1))
            fc2 = np.transpose(t[p + "experts.down_proj"], (0, 2, 1))
        return {"fc1": np.ascontiguousarray(fc1), "fc2": np.ascontiguousarray(fc2)}
    names = (hf["gate"], hf["up"], hf["down"])
    e_count = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    bn, bk = (cfg.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    mats = []
    for e in range(e_count):
        m = []
        for n in names:
            key = f"{p}experts.{e}.{n}.weight"
            w = t[key].astype(np.float32)
            if key + "_scale_inv" in t:
                s = t[key + "_scale_inv"]
                rows = np.arange(w.shape[0]) // bn
                cols = np.arange(w.shape[1]) // bk
                w = (w * s[rows][:, cols]).astype(np.float32)
            m.append(w)
        mats.append(m)
    gate = np.stack([m[0] for m in mats])
    up = np.stack([m[1] for m in mats])
    fc1 = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
    fc1[:, 0::2], fc1[:, 1::2] = gate, up
    return {"fc1": fc1, "fc2": np.stack([m[2] for m in mats])}


def route_by_bank(meta, lt, x, k):
    """Experts and weights of each token of x [T, H] by the bank's own routing
    (docs/BANK_FORMAT.md: its qmoe.routing.* keys, or the legacy rule without
    them), in float64: a list of {expert: weight} per token."""
    x = np.asarray(x, np.float64)
    logits = x @ lt["router.weight"].astype(np.float64).T
    if "router.bias" in lt:
        logits = logits + lt["router.bias"].astype(np.float64)
    score = meta.get("qmoe.routing.score")
    out = []
    for row in logits:
        e_count = row.shape[0]
        if score is None:  # legacy: top-k of the logits, softmax over the k, drop <= 1e-8
            order = sorted(range(e_count), key=lambda j: (row[j], j), reverse=True)[:k]
            p = np.exp(row[order] - row[order].max())
            p /= p.sum()
            out.append({int(e): float(w) for e, w in zip(order, p) if w > 1e-8})
            continue
        if score == "softmax":
            s = np.exp(row - row.max())
            s /= s.sum()
        else:
            s = 1.0 / (1.0 + np.exp(-row))
        c = s + lt["router.correction_bias"].astype(np.float64) if "router.correction_bias" in lt else s.copy()
        groups = int(meta.get("qmoe.routing.groups", 1))
        if groups > 1:
            kept = int(meta.get("qmoe.routing.topk_groups", groups))
            per = e_count // groups
            g = c.reshape(groups, per)
            gs = g.max(axis=1) if meta.get("qmoe.routing.group_score", "max") == "max" else \
                np.sort(g, axis=1)[:, -2:].sum(axis=1)
            keep = sorted(range(groups), key=lambda j: (gs[j], j), reverse=True)[:kept]
            c = np.where(np.isin(np.arange(e_count) // per, keep), c, 0.0)
        sel = sorted(range(e_count), key=lambda j: (c[j], j), reverse=True)[:k]
        w = s[sel]
        if meta.get("qmoe.routing.normalize", "1") == "1":
            w = w / (w.sum() + 1e-20)
        w = w * float(meta.get("qmoe.routing.scale", "1"))
        out.append({int(e): float(v) for e, v in zip(sel, w)})
    return out


def forward_given(cfg, lt, x, ids, weights):
    """Float64 [T, H] output of bank layer dict lt for x [T, H] with the routes
    given (ids [T, k], weights [T, k]), mixed as given."""
    x = np.asarray(x, np.float64)
    w1 = qb.dequantize(cfg, "fc1", lt)
    w2 = qb.dequantize(cfg, "fc2", lt)
    b1, b2 = lt.get("fc1.bias"), lt.get("fc2.bias")
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            h = w1[e] @ x[t]
            if b1 is not None:
                h = h + b1[e].astype(np.float64)
            a = qb.swiglu(cfg, h[0::2], h[1::2])
            y = w2[e] @ a
            if b2 is not None:
                y = y + b2[e].astype(np.float64)
            out[t] += float(w) * y
    return out
