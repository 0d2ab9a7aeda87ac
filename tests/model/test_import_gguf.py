"""`qmoe-bank import gguf`: GGUF files written here with the `gguf` package
(llama.cpp's gguf-py), imported, and checked against gguf-py's own
dequantiser: bit for bit for the exact types (Q4_0, Q8_0, Q5_0, MXFP4 through
the e2m1 code book and as int8, Q6_K), within the recorded max_rel_err for the
requantised ones; the MoE output of
the imported bank against a numpy reference; every bad input exits 2 with
one line naming the tensor or key, and leaves no file behind.
"""
import json
import os
import subprocess

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")

pytestmark = pytest.mark.skipif(not os.path.exists(QMOE_BANK),
                                reason=f"qmoe-bank not built at {QMOE_BANK}")

E, H, I, K = 4, 256, 512, 2


def run_tool(*args, check=True):
    r = subprocess.run([QMOE_BANK, *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"qmoe-bank {' '.join(map(str, args))}: {r.returncode}\n{r.stderr}")
    return r


# ---- writing GGUF fixtures -----------------------------------------------------------


def random_blocks(rng, qtype, n_blocks):
    """Raw blocks of a K-quant with random codes and a sane f16 d (and dmin)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

    def f16(col, lo, hi):
        raw[:, col:col + 2] = rng.uniform(lo, hi, n_blocks).astype("<f2").view(np.uint8).reshape(-1, 2)

    if qtype == Q.Q6_K:
        f16(208, 1e-3, 4e-3)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        f16(0, 1e-3, 4e-3)
        f16(2, 1e-4, 1e-3)
    elif qtype == Q.Q2_K:
        f16(80, 1e-3, 4e-3)
        f16(82, 1e-4, 1e-3)
    elif qtype == Q.Q3_K:
        f16(108, 1e-3, 4e-3)
    else:
        raise ValueError(qtype)
    return raw


def make_matrix(rng, qtype, rows, cols):
    """(bytes array [E, rows, row_bytes] to write, f32 source [E, rows, cols])."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        w = (rng.standard_normal((E, rows, cols)) * 0.05).astype(np.float32)
        if qtype == Q.F32:
            return w, w
        if qtype == Q.F16:
            return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
        raw = gguf.quants.quantize(w, Q.BF16)
        return raw, gguf.quants.dequantize(raw, Q.BF16).reshape(E, rows, cols)
    if qtype in (Q.Q4_0, Q.Q8_0, Q.MXFP4, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        w = (rng.standard_normal((E, rows, cols)) * 0.05).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = random_blocks(rng, qtype, E * rows * cols // block).reshape(E, rows, -1)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(E, rows, cols)


def write_gguf(path, arch="qwen3moe", types=(Q.Q4_0, Q.Q4_0, Q.Q4_0), blocks=2, dense=0,
               seed=0, keys=None, corr_bias=False, biases=False, omit=(), expert_count=None,
               typed_keys=()):
    """A MoE GGUF: per block gate/up/down stacked experts of the given types,
    the router in f32; returns {block: {"gate"|"up"|"down": f32 source, ...}}.
    keys: {name: value} through GGUFWriter.add_<name>; typed_keys: (writer
    method, key, value) for a key of a type of the test's choosing."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_embedding_length(H)
    w.add_expert_count(expert_count or E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    if dense:
        w.add_leading_dense_block_count(dense)
    for k, v in (keys or {}).items():
        getattr(w, "add_" + k)(v)
    for method, k, v in typed_keys:
        getattr(w, method)(k, v)
    src = {}
    for b in range(dense, blocks):
        s = {}
        for p, (name, rows, cols) in enumerate((("gate", I, H), ("up", I, H), ("down", H, I))):
            raw, deq = make_matrix(rng, types[p], rows, cols)
            s[name] = deq
            tname = f"blk.{b}.ffn_{name}_exps.weight"
            if tname in omit:
                continue
            if types[p] in (Q.F32, Q.F16):
                w.add_tensor(tname, raw)
            else:
                w.add_tensor(tname, raw, raw_dtype=types[p])
            if biases:
                bias = (rng.standard_normal((E, rows)) * 0.1).astype(np.float32)
                s[name + "_bias"] = bias
                w.add_tensor(f"blk.{b}.ffn_{name}_exps.bias", bias)
        s["router"] = (rng.standard_normal((E, H)) * 0.2).astype(np.float32)
        w.add_tensor(f"blk.{b}.ffn_gate_inp.weight", s["router"])
        if biases:
            s["router_bias"] = (rng.standard_normal(E) * 0.3).astype(np.float32)
            w.add_tensor(f"blk.{b}.ffn_gate_inp.bias", s["router_bias"])
        if corr_bias:
            s["corr"] = (rng.standard_normal(E) * 0.05).astype(np.float32)
            w.add_tensor(f"blk.{b}.exp_probs_b.bias", s["corr"])
        src[b] = s
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


# ---- reading the bank back -------------------------------------------------------------


# qmoe.codebook = e2m1 (docs/BANK_FORMAT.md): code q weighs scale * E2M1[q].
E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def bank_codes(t, meta, layer, fc):
    codes = t[f"layers.{layer}.{fc}.weight"]
    if int(meta["qmoe.bits"]) == 4:
        q = np.empty(codes.shape[:-1] + (codes.shape[-1] * 2,), np.uint8)
        q[..., 0::2] = codes & 15
        q[..., 1::2] = codes >> 4
        return q
    return codes


def bank_matrix(t, meta, layer, fc):
    bits = int(meta["qmoe.bits"])
    bs = int(meta["qmoe.block_size"])
    q = bank_codes(t, meta, layer, fc)
    sc = t[f"layers.{layer}.{fc}.scales"].astype(np.float32)
    sc = np.repeat(sc, bs, axis=-1)[..., :q.shape[-1]]
    if "qmoe.codebook" in meta:
        assert meta["qmoe.codebook"] == "e2m1" and bits == 4
        return sc * E2M1[q]
    zp = np.float32(1 << (bits - 1))
    return sc * (q.astype(np.float32) - zp)


def load_bank(path):
    t = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata())
    return t, meta


def import_ok(tmp_path, gpath, *extra):
    out = tmp_path / "out.bank"
    r = run_tool("import", "gguf", gpath, "--out", out, *extra)
    assert out.exists() and not os.path.exists(str(out) + ".partial")
    return out, r.stdout


FC = {"gate": "fc1", "up": "fc3", "down": "fc2"}


@pytest.mark.parametrize("qtype,bits,bs,extra", [
    (Q.Q4_0, 4, 32, ()), (Q.Q8_0, 8, 32, ()), (Q.Q5_0, 8, 32, ()),
    pytest.param(Q.MXFP4, 4, 32, (), id="MXFP4-e2m1"),
    pytest.param(Q.MXFP4, 8, 32, ("--mxfp4", "int8"), id="MXFP4-int8"),
    (Q.Q6_K, 8, 16, ())])
def test_exact_types_repack_bit_for_bit(tmp_path, qtype, bits, bs, extra):
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, types=(qtype,) * 3, seed=int(qtype))
    out, stdout = import_ok(tmp_path, gpath, *extra)
    t, meta = load_bank(out)
    assert (int(meta["qmoe.bits"]), int(meta["qmoe.block_size"])) == (bits, bs)
    # MXFP4 alone keeps its own codes through the e2m1 code book unless asked
    # for int8 (today's bank, onnxruntime's); every other layout has no book.
    codebook = "e2m1" if qtype == Q.MXFP4 and not extra else None
    assert meta.get("qmoe.codebook") == codebook
    source = json.loads(meta["qmoe.source"])
    assert source["format"] == "gguf" and source["exact"] is True and "max_rel_err" not in source
    assert source["family"] == "qwen3_moe" and source["files"] == ["m.gguf"]
    for layer, blk in enumerate(sorted(src)):
        for name, fc in FC.items():
            got = bank_matrix(t, meta, layer, fc)
            want = src[blk][name]
            assert got.shape == want.shape
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), \
                (qtype.name, layer, name)
        assert np.array_equal(t[f"layers.{layer}.router.weight"], src[blk]["router"])
        # The scales keep the source's values: Q4_0/Q8_0/Q5_0's own f16 d,
        # MXFP4's powers of two in f16 (these exponents fit), Q6_K's products in f32.
        want_dt = np.float32 if qtype == Q.Q6_K else np.float16
        for fc in FC.values():
            assert t[f"layers.{layer}.{fc}.scales"].dtype == want_dt, (qtype.name, fc)
    assert f"{qtype.name}" in stdout and "exact repack" in stdout, stdout
    assert ("-> e2m1 code book block 32" in stdout) == (codebook is not None), stdout
    # qwen3moe renormalises the top-k: the legacy rule, no routing keys.
    assert not any(k.startswith("qmoe.routing.") for k in meta)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q2_K, Q.Q3_K, Q.Q4_1, Q.Q5_1,
                                   Q.F16, Q.BF16, Q.F32])
@pytest.mark.parametrize("bits", [8, 4])
def test_requantised_types_stay_within_the_recorded_error(tmp_path, qtype, bits):
    if bits == 4 and qtype not in (Q.Q4_K, Q.F16):
        pytest.skip("int4 checked on two types, to keep the suite short")
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, types=(qtype,) * 3, blocks=1, seed=100 + int(qtype))
    out, stdout = import_ok(tmp_path, gpath, "--requant-bits", bits)
    t, meta = load_bank(out)
    assert int(meta["qmoe.bits"]) == bits
    source = json.loads(meta["qmoe.source"])
    assert source["exact"] is False
    bound = source["max_rel_err"]
    worst = 0.0
    for name, fc in FC.items():
        got = bank_matrix(t, meta, 0, fc).astype(np.float64)
        want = src[0][name].astype(np.float64)
        for e in range(E):
            rel = np.linalg.norm(got[e] - want[e]) / np.linalg.norm(want[e])
            worst = max(worst, rel)
            assert rel <= bound * (1 + 1e-6) + 1e-9, (qtype.name, name, e, rel, bound)
    assert worst > 0 and worst >= bound * 0.999, (worst, bound)  # the bound is the measured one
    assert bound < (0.02 if bits == 8 else 0.3), bound
    line = [l for l in stdout.splitlines() if l.strip().startswith(qtype.name + " ")]
    assert line and "requantised" in line[0] and "max rel err" in line[0], stdout


def mxfp4_source_codes(gpath, tensor):
    """The 4-bit codes of an MXFP4 tensor as the file holds them, element
    order: ggml's block {u8 e; u8 qs[16]}, element j in qs[j]'s low nibble and
    j + 16 in its high one."""
    r = gguf.GGUFReader(str(gpath))
    t = next(x for x in r.tensors if x.name == tensor)
    blocks = np.asarray(t.data, np.uint8).reshape(-1, 17)
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=1)  # [blocks, 32]
    return codes.reshape(*[int(d) for d in reversed(t.shape)])


def test_mxfp4_e2m1_and_int8_banks_hold_the_same_weights(tmp_path):
    """The e2m1 bank is the file's own nibbles (repacked to the bank's order)
    with the int8 bank's scales: half its code bytes, the same weights bit
    for bit."""
    gpath = tmp_path / "m.gguf"
    write_gguf(gpath, types=(Q.MXFP4,) * 3, blocks=2, seed=31)
    e2m1, stdout = import_ok(tmp_path, gpath)
    int8 = tmp_path / "int8.bank"
    run_tool("import", "gguf", gpath, "--out", int8, "--mxfp4", "int8", "--quiet")
    te, me = load_bank(e2m1)
    ti, mi = load_bank(int8)
    assert me["qmoe.codebook"] == "e2m1" and (me["qmoe.bits"], me["qmoe.block_size"]) == ("4", "32")
    # --mxfp4 int8: today's metadata exactly, no code book key.
    assert "qmoe.codebook" not in mi and (mi["qmoe.bits"], mi["qmoe.block_size"]) == ("8", "32")
    assert {k: v for k, v in me.items() if k not in ("qmoe.bits", "qmoe.codebook")} == \
        {k: v for k, v in mi.items() if k != "qmoe.bits"}
    assert json.loads(me["qmoe.source"])["exact"] is True
    for layer in (0, 1):
        for name, fc in FC.items():
            we, wi = bank_matrix(te, me, layer, fc), bank_matrix(ti, mi, layer, fc)
            assert np.array_equal(we.view(np.uint32), wi.view(np.uint32)), (layer, fc)
            assert te[f"layers.{layer}.{fc}.scales"].tobytes() == \
                ti[f"layers.{layer}.{fc}.scales"].tobytes()
            codes = bank_codes(te, me, layer, fc)
            assert np.array_equal(codes, mxfp4_source_codes(gpath, f"blk.{layer}.ffn_{name}_exps.weight"))
            # int8 code = 128 + E2M1[nibble]: the two banks' codes agree
            assert np.array_equal(ti[f"layers.{layer}.{fc}.weight"].astype(np.int32),
                                  128 + E2M1[codes].astype(np.int32))
            assert te[f"layers.{layer}.{fc}.weight"].nbytes * 2 == ti[f"layers.{layer}.{fc}.weight"].nbytes
    assert os.path.getsize(e2m1) < 0.6 * os.path.getsize(int8)
    # --scales is honoured as on the int8 path: f32 holds 2^(e-128) too.
    out = tmp_path / "f32.bank"
    run_tool("import", "gguf", gpath, "--out", out, "--scales", "f32", "--quiet")
    t, m = load_bank(out)
    assert m["qmoe.codebook"] == "e2m1" and t["layers.0.fc2.scales"].dtype == np.float32
    assert np.array_equal(bank_matrix(t, m, 0, "fc2").view(np.uint32),
                          bank_matrix(te, me, 0, "fc2").view(np.uint32))


def test_mxfp4_mixed_with_another_type_stays_int8(tmp_path):
    """A code book holds MXFP4 only: a file whose experts mix MXFP4 with Q8_0
    keeps today's int8 block 32 bank, exact, whatever --mxfp4 says."""
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, types=(Q.MXFP4, Q.MXFP4, Q.Q8_0), blocks=1, seed=32)
    for extra in ((), ("--mxfp4", "e2m1")):
        out, stdout = import_ok(tmp_path, gpath, *extra)
        t, meta = load_bank(out)
        assert "qmoe.codebook" not in meta and (meta["qmoe.bits"], meta["qmoe.block_size"]) == ("8", "32")
        for name, fc in FC.items():
            assert np.array_equal(bank_matrix(t, meta, 0, fc).view(np.uint32),
                                  src[0][name].view(np.uint32)), name


def test_mixed_q4k_q6k_keeps_q6k_exact(tmp_path):
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, types=(Q.Q4_K, Q.Q4_K, Q.Q6_K), blocks=1, seed=7)
    out, stdout = import_ok(tmp_path, gpath)
    t, meta = load_bank(out)
    assert (meta["qmoe.bits"], meta["qmoe.block_size"]) == ("8", "16")
    down = bank_matrix(t, meta, 0, "fc2")
    assert np.array_equal(down.view(np.uint32), src[0]["down"].view(np.uint32))
    lines = {l.split()[0]: l for l in stdout.splitlines() if l.startswith("  ")}
    assert "exact repack" in lines["Q6_K"] and "requantised" in lines["Q4_K"], stdout
    # Blocks of 16 have no fast kernel and take more bytes: the import says
    # so and names the way out (the Q4_K_M case: int8 block 16, 1.8x its GGUF).
    r = run_tool("import", "gguf", gpath, "--out", tmp_path / "q.bank", "--quiet")
    note = [l for l in r.stderr.splitlines() if l.startswith("note: ") and "blocks of 16" in l]
    assert note and "exact precision" in note[0] and "--requant-bits 4" in note[0], r.stderr
    assert "x the GGUF file" in note[0] and not r.stdout, (r.stdout, r.stderr)
    # Scale dtypes per tensor: requantised ones take --scales (default f16),
    # the exact Q6_K repack keeps f32 whatever --scales says.
    assert t["layers.0.fc1.scales"].dtype == np.float16 and t["layers.0.fc3.scales"].dtype == np.float16
    assert t["layers.0.fc2.scales"].dtype == np.float32
    out32, _ = import_ok(tmp_path, gpath, "--scales", "f32")
    t32, _ = load_bank(out32)
    assert all(t32[f"layers.0.{fc}.scales"].dtype == np.float32 for fc in ("fc1", "fc2", "fc3"))
    assert np.array_equal(bank_matrix(t32, meta, 0, "fc2").view(np.uint32), down.view(np.uint32))
    r4 = run_tool("import", "gguf", gpath, "--out", tmp_path / "q4.bank", "--requant-bits", "4")
    _, meta4 = load_bank(tmp_path / "q4.bank")
    assert (meta4["qmoe.bits"], meta4["qmoe.block_size"]) == ("4", "32")
    assert "note:" not in r4.stderr + r4.stdout, r4


def silu(z):
    return z / (1.0 + np.exp(-z))


def moe_reference(x, s, route, alpha=1.0, beta=0.0, limit=np.inf):
    """float64 MoE of one block with the GGUF's own (dequantised) weights."""
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for e, wgt in route(t):
            g = s["gate"][e].astype(np.float64) @ x[t] + s.get("gate_bias", np.zeros((E, I)))[e]
            u = s["up"][e].astype(np.float64) @ x[t] + s.get("up_bias", np.zeros((E, I)))[e]
            g = np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
            a = g / (1.0 + np.exp(-alpha * g)) * (u + beta)
            y = s["down"][e].astype(np.float64) @ a + s.get("down_bias", np.zeros((E, H)))[e]
            out[t] += wgt * y
    return out


def run_bank(tmp_path, bank, layer, x):
    xp, yp = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(xp, x)
    run_tool("run", bank, "--layer", layer, "--hidden", xp, "--out", yp)
    return np.load(yp).astype(np.float64)


def softmax_topk_norm(logits):
    def route(t):
        sel = np.argsort(-logits[t], kind="stable")[:K]
        p = np.exp(logits[t][sel] - logits[t][sel].max())
        return list(zip(sel, p / p.sum()))
    return route


def test_moe_output_matches_numpy_reference(tmp_path):
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=2, seed=11)
    out, _ = import_ok(tmp_path, gpath)
    x = np.random.default_rng(3).standard_normal((5, H)).astype(np.float32)
    for layer in (0, 1):
        s = src[layer]
        logits = x.astype(np.float64) @ s["router"].T.astype(np.float64)
        want = moe_reference(x.astype(np.float64), s, softmax_topk_norm(logits))
        got = run_bank(tmp_path, out, layer, x)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-5, err


@pytest.mark.parametrize("mxfp4", ["e2m1", "int8"])
def test_gpt_oss_biases_router_bias_and_swiglu_constants(tmp_path, mxfp4):
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, arch="gpt-oss", types=(Q.MXFP4,) * 3, blocks=1, seed=12, biases=True)
    out, stdout = import_ok(tmp_path, gpath, "--mxfp4", mxfp4)
    t, meta = load_bank(out)
    assert meta.get("qmoe.codebook") == (None if mxfp4 == "int8" else "e2m1")
    assert meta["qmoe.activation_alpha"] == "1.702" and meta["qmoe.swiglu_limit"] == "7"
    assert json.loads(meta["qmoe.source"])["family"] == "gpt_oss"
    for name, fc in FC.items():
        assert np.array_equal(t[f"layers.0.{fc}.bias"], src[0][name + "_bias"])
    assert np.array_equal(t["layers.0.router.bias"], src[0]["router_bias"])
    assert not any(k.startswith("qmoe.routing.") for k in meta)  # top-k logits + bias: legacy
    x = np.random.default_rng(4).standard_normal((3, H)).astype(np.float32)
    logits = x.astype(np.float64) @ src[0]["router"].T.astype(np.float64) + src[0]["router_bias"]
    want = moe_reference(x.astype(np.float64), src[0], softmax_topk_norm(logits), alpha=1.702,
                         beta=1.0, limit=7.0)
    got = run_bank(tmp_path, out, 0, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_deepseek_v3_routing_keys_bias_and_layer_map(tmp_path):
    gpath = tmp_path / "m.gguf"
    keys = {"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID, "expert_weights_norm": True,
            "expert_weights_scale": 2.5, "expert_group_count": 2, "expert_group_used_count": 1}
    src = write_gguf(gpath, arch="deepseek2", types=(Q.Q8_0,) * 3, blocks=3, dense=1, seed=13,
                     keys=keys, corr_bias=True)
    out, stdout = import_ok(tmp_path, gpath)
    t, meta = load_bank(out)
    assert meta["qmoe.layers"] == "2" and json.loads(meta["qmoe.layer_map"]) == [1, 2]
    assert meta["qmoe.routing.score"] == "sigmoid" and meta["qmoe.routing.normalize"] == "1"
    assert float(meta["qmoe.routing.scale"]) == 2.5
    assert (meta["qmoe.routing.groups"], meta["qmoe.routing.topk_groups"],
            meta["qmoe.routing.group_score"]) == ("2", "1", "top2_sum")
    assert json.loads(meta["qmoe.source"])["family"] == "deepseek_v3"
    x = np.random.default_rng(5).standard_normal((6, H)).astype(np.float32)
    for layer, blk in ((0, 1), (1, 2)):
        s = src[blk]
        assert np.array_equal(t[f"layers.{layer}.router.correction_bias"], s["corr"])
        logits = (x.astype(np.float64) @ s["router"].T.astype(np.float64)).astype(np.float32)

        def route(tok):
            sc = 1.0 / (1.0 + np.exp(-logits[tok].astype(np.float64)))
            ch = sc + s["corr"]
            g = np.sort(ch.reshape(2, E // 2), axis=1)[:, -2:].sum(axis=1)
            keep = np.argmax(g)
            # transformers' masked_fill(0.0) of the dropped groups; ties: larger index.
            ch = np.where(np.arange(E) // (E // 2) == keep, ch, 0.0)
            sel = np.lexsort((-np.arange(E), -ch))[:K]
            return list(zip(sel, sc[sel] / sc[sel].sum() * 2.5))
        want = moe_reference(x.astype(np.float64), s, route)
        got = run_bank(tmp_path, out, layer, x)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    info = json.loads(run_tool("inspect", "--json", out).stdout)
    assert info["layer_map"] == [1, 2] and info["routing"]["score"] == "sigmoid"


# ---- bad input ---------------------------------------------------------------------------


def expect_bad(tmp_path, gpath, needle):
    out = tmp_path / "bad.bank"
    r = run_tool("import", "gguf", gpath, "--out", out, check=False)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not os.path.exists(str(out) + ".partial")


def test_unknown_and_unsupported_quant_types(tmp_path):
    gpath = tmp_path / "m.gguf"
    write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=1)
    data = bytearray(gpath.read_bytes())
    # The type id of blk.0.ffn_up_exps.weight (u32 after its 3 dims) -> 99.
    name = b"blk.0.ffn_up_exps.weight"
    at = data.index(name) + len(name) + 4 + 3 * 8
    assert int.from_bytes(data[at:at + 4], "little") == int(Q.Q8_0)
    data[at:at + 4] = (99).to_bytes(4, "little")
    gpath.write_bytes(bytes(data))
    expect_bad(tmp_path, gpath, "blk.0.ffn_up_exps.weight: unknown quant type 99")
    data[at:at + 4] = int(Q.IQ4_NL).to_bytes(4, "little")  # same block size and bytes as Q4_0
    gpath.write_bytes(bytes(data))
    expect_bad(tmp_path, gpath, "blk.0.ffn_up_exps.weight: quant type IQ4_NL is not supported")


def test_truncated_file(tmp_path):
    gpath = tmp_path / "m.gguf"
    write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=1)
    data = gpath.read_bytes()
    gpath.write_bytes(data[:-100])
    expect_bad(tmp_path, gpath, "runs past the end of the file")
    gpath.write_bytes(data[:40])
    expect_bad(tmp_path, gpath, "more than a 40-byte file can hold")
    gpath.write_bytes(data[:300])
    expect_bad(tmp_path, gpath, "GGUF truncated")
    gpath.write_bytes(b"GGUX" + data[4:])
    expect_bad(tmp_path, gpath, "not a GGUF file")


def test_missing_tensor(tmp_path):
    gpath = tmp_path / "m.gguf"
    write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=2, omit=("blk.1.ffn_down_exps.weight",))
    expect_bad(tmp_path, gpath, "missing tensor blk.1.ffn_down_exps.weight")


def test_contradicting_metadata(tmp_path):
    gpath = tmp_path / "m.gguf"
    write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=1, expert_count=6)
    expect_bad(tmp_path, gpath, "qwen3moe.expert_count = 6 contradicts "
                                "blk.0.ffn_gate_exps.weight, which holds 4 experts")
    write_gguf(gpath, types=(Q.Q8_0,) * 3, blocks=1, keys={"expert_group_count": 3})
    expect_bad(tmp_path, gpath, "qwen3moe.expert_group_count = 3")
    w = gguf.GGUFWriter(str(gpath), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_bad(tmp_path, gpath, "general.architecture = \"mamba\" is not a supported MoE")


def test_usage_errors(tmp_path):
    r = run_tool("import", "gguf", "x.gguf", check=False)
    assert r.returncode == 2 and "--out" in r.stderr
    r = run_tool("import", "gguf", "x.gguf", "--out", tmp_path / "o", "--requant-bits", "3",
                 check=False)
    assert r.returncode == 2 and "--requant-bits takes 4 or 8" in r.stderr
    r = run_tool("import", "gguf", "x.gguf", "--out", tmp_path / "o", "--mxfp4", "int4",
                 check=False)
    assert r.returncode == 2 and '--mxfp4 takes e2m1 or int8, not "int4"' in r.stderr
    expect_bad(tmp_path, tmp_path / "missing.gguf", "cannot open")
    helptext = run_tool("import", "gguf", "--help").stdout
    assert "import gguf" in helptext and "--mxfp4 e2m1|int8" in helptext


def families():
    """The importer's family table (`qmoe-bank import --families`), or [] when
    the tool is not built (the module is then skipped)."""
    if not os.path.exists(QMOE_BANK):
        return []
    r = run_tool("import", "--families", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else []


# llama.cpp's default for {arch}.expert_weights_norm when a file omits it
# (llama-model.cpp): the oracle the importer's table is checked against.
LLAMA_CPP_NORM_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False,
                          "deepseek2": False, "gpt-oss": True}


def test_every_gguf_architecture_of_the_table_has_llama_cpps_default():
    table = [f for f in families() if f["gguf"]]
    assert {f["gguf"]["arch"] for f in table} == set(LLAMA_CPP_NORM_DEFAULT)
    for f in table:
        assert f["gguf"]["norm_default"] is LLAMA_CPP_NORM_DEFAULT[f["gguf"]["arch"]], f["name"]


def routing_cases():
    """Every family of the table with a GGUF form, with the file's defaults,
    plus keys that override them."""
    cases = []
    for f in families():
        if not f["gguf"]:
            continue
        arch = f["gguf"]["arch"]
        keys = {"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID} if f["gguf"]["sigmoid"] \
            else {}
        score = "sigmoid" if f["gguf"]["sigmoid"] else "softmax"
        norm = LLAMA_CPP_NORM_DEFAULT[arch]
        want = None if score == "softmax" and norm else (score, "1" if norm else "0")
        cases.append(pytest.param(arch, f["name"], keys, want, id=f["name"]))
    cases.append(pytest.param("qwen3moe", "qwen3_moe", {"expert_weights_norm": False},
                              ("softmax", "0"), id="qwen3_moe-no-norm"))
    cases.append(pytest.param("deepseek2", "deepseek_v2", {"expert_weights_scale": 16.0},
                              ("softmax", "0"), id="deepseek_v2-scale"))
    return cases


@pytest.mark.parametrize("arch,family,keys,want", routing_cases())
def test_routing_keys_per_architecture(tmp_path, arch, family, keys, want):
    gpath = tmp_path / "m.gguf"
    src = write_gguf(gpath, arch=arch, types=(Q.Q8_0,) * 3, blocks=1, seed=21, keys=keys)
    out, stdout = import_ok(tmp_path, gpath)
    t, meta = load_bank(out)
    assert json.loads(meta["qmoe.source"])["family"] == family
    routing = {k: v for k, v in meta.items() if k.startswith("qmoe.routing.")}
    act = dict(alpha=float(meta.get("qmoe.activation_alpha", 1)),
               beta=float(meta.get("qmoe.activation_beta", 0)),
               limit=float(meta.get("qmoe.swiglu_limit", "inf")))
    x = np.random.default_rng(8).standard_normal((4, H)).astype(np.float32)
    logits = x.astype(np.float64) @ src[0]["router"].T.astype(np.float64)
    if want is None:
        assert routing == {} and "routing: legacy" in stdout
        route = softmax_topk_norm(logits)
    else:
        assert (routing["qmoe.routing.score"], routing["qmoe.routing.normalize"]) == want
        if want[0] == "sigmoid":
            return  # the sigmoid rule's output: test_deepseek_v3_routing_keys_bias_and_layer_map
        scale = float(routing["qmoe.routing.scale"])
        assert scale == keys.get("expert_weights_scale", 1.0)

        def route(tok):  # un-normalised softmax top-k, scaled: as the family routes
            p = np.exp(logits[tok] - logits[tok].max())
            p /= p.sum()
            sel = np.argsort(-p, kind="stable")[:K]
            return list(zip(sel, p[sel] * scale))
    want_y = moe_reference(x.astype(np.float64), src[0], route, **act)
    got = run_bank(tmp_path, out, 0, x)
    assert np.linalg.norm(got - want_y) / np.linalg.norm(want_y) < 1e-5


def test_custom_alignment_is_honoured(tmp_path):
    gpath = tmp_path / "m.gguf"
    rng = np.random.default_rng(2)
    w = gguf.GGUFWriter(str(gpath), "qwen3moe")
    w.add_custom_alignment(256)
    w.add_block_count(1)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    src = {}
    for name, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
        raw, src[name] = make_matrix(rng, Q.Q4_0, rows, cols)
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", raw, raw_dtype=Q.Q4_0)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((E, H)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out, _ = import_ok(tmp_path, gpath)
    t, meta = load_bank(out)
    for name, fc in FC.items():
        assert np.array_equal(bank_matrix(t, meta, 0, fc).view(np.uint32),
                              src[name].view(np.uint32))
