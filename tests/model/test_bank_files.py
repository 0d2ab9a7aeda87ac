"""Bank files across tools: Python safetensors <-> qmoe-bank, ONNX round trips, and
onnxruntime as the oracle for `qmoe-bank run`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
TOOLS = os.path.join(SRC, "tools")
sys.path.insert(0, TOOLS)
import qmoebank as qb  # noqa: E402

QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")

pytestmark = pytest.mark.skipif(not os.path.exists(QMOE_BANK),
                                reason=f"qmoe-bank not built at {QMOE_BANK}")


def tool(*args, check=True):
    r = subprocess.run([QMOE_BANK, *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"qmoe-bank {' '.join(map(str, args))}: {r.returncode}\n{r.stderr}")
    return r


def create(path, layers=2, experts=4, hidden=64, inter=32, k=2, bits=4, block_size=16,
           activation="silu", extra=()):
    tool("create", "--quiet", "--out", path, "--layers", layers, "--experts", experts,
         "--hidden", hidden, "--inter", inter, "--k", k, "--bits", bits,
         "--block-size", block_size, "--activation", activation, *extra)
    return path


def py(script, *args):
    """Runs a converter's main() in-process (importing onnx once, not per call)."""
    import importlib

    mod = importlib.import_module(script[:-3])
    assert mod.main([str(a) for a in args]) == 0


def py_cli(script, *args, check=True):
    r = subprocess.run([sys.executable, os.path.join(TOOLS, script), *map(str, args)],
                       capture_output=True, text=True)
    assert r.returncode == 0 or not check, r.stderr
    return r


# ---- the generator of `qmoe-bank create`, re-implemented to check its bytes ----

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    with np.errstate(over="ignore"):
        z = (z + GOLDEN).astype(np.uint64)
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)).astype(np.uint64)
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)).astype(np.uint64)
        return z ^ (z >> np.uint64(31))


def stream(seed, layer, stream_id, expert, count):
    with np.errstate(over="ignore"):
        s = mix64(np.uint64(seed))
        s = mix64(s ^ np.uint64(layer))
        s = mix64(s ^ np.uint64((stream_id << 32) | expert))
        idx = np.arange(1, count + 1, dtype=np.uint64)
        z = mix64((s + idx * GOLDEN).astype(np.uint64))
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0).astype(np.float32)


def expected_layer(cfg, seed, layer, scale_dtype, asymmetric):
    """The tensors `qmoe-bank create` must have written for one layer."""
    out = {}
    projs = ["fc1", "fc2"] + (["fc3"] if cfg.has_fc3 else [])
    for p_idx, proj in enumerate(projs, start=1):
        n, k = cfg.dims(proj)
        wscale = np.float32(1) / np.sqrt(np.float32(k))
        ws = np.stack([stream(seed, layer, p_idx, e, n * k).reshape(n, k) * wscale
                       for e in range(cfg.experts)])
        packed, scales, zp = qb.quantize_rows(ws, cfg.bits, cfg.block_size, asymmetric)
        out[proj + ".weight"] = packed
        out[proj + ".scales"] = scales.astype(scale_dtype)
        if zp is not None:
            out[proj + ".zero_points"] = zp
        out[proj + ".bias"] = np.stack([
            np.float32(0.1) * stream(seed, layer, p_idx + 16, e, n)
            for e in range(cfg.experts)]).astype(scale_dtype)
        out[proj + "._float"] = ws
    return out


@pytest.mark.parametrize("bits,block_size,activation,fusion,asym,sdt", [
    (4, 16, "silu", 0, False, "f32"),
    (8, 0, "gelu", 0, True, "f16"),
    (4, 0, "swiglu", 1, True, "bf16"),
    (4, 32, "swiglu", 0, True, "f32"),
    (8, 16, "swiglu", 2, False, "f32"),
])
def test_create_writes_ort_rule_quantisation_readable_by_safetensors(
        tmp_path, bits, block_size, activation, fusion, asym, sdt):
    extra = ["--seed", 11, "--scale-dtype", sdt] + (["--asymmetric"] if asym else [])
    if activation == "swiglu":
        extra += ["--swiglu-fusion", fusion]
    path = create(tmp_path / "b.qmoe", layers=2, experts=3, hidden=64, inter=48,
                  bits=bits, block_size=block_size, activation=activation, extra=extra)
    cfg, tensors = qb.load_bank(str(path))  # the Python safetensors package reads it
    assert (cfg.layers, cfg.experts, cfg.hidden_size, cfg.inter_size) == (2, 3, 64, 48)
    assert (cfg.bits, cfg.block_size, cfg.activation) == (bits, block_size, activation)
    sd = {"f32": np.float32, "f16": np.float16, "bf16": qb.BF16}[sdt]
    for layer in range(2):
        want = expected_layer(cfg, 11, layer, sd, asym)
        lt = qb.layer_tensors(tensors, layer)
        for name, arr in want.items():
            if name.endswith("._float"):
                continue
            assert lt[name].dtype == arr.dtype and lt[name].shape == arr.shape, name
            assert lt[name].tobytes() == arr.tobytes(), f"layers.{layer}.{name} differs"
        # Dequantised weights are within half a quantisation step of the floats.
        for proj in ["fc1", "fc2"] + (["fc3"] if cfg.has_fc3 else []):
            deq = qb.dequantize(cfg, proj, lt)
            w = want[proj + "._float"].astype(np.float64)
            s = lt[proj + ".scales"].astype(np.float64)
            s = s if s.ndim == 3 else s[:, :, None]
            step = np.repeat(s, block_size or w.shape[2], axis=2)[:, :, :w.shape[2]]
            # Half a step (symmetric) or one step (asymmetric: the zero point is rounded),
            # plus the rounding of the stored scale (8 mantissa bits for bf16, 11 for f16).
            rel = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}[sdt]
            tol = step * (0.5 if not asym else 1.0) * (1 + 16 * rel) + 1e-6 + rel * np.abs(w)
            assert np.all(np.abs(deq - w) <= tol), proj


@pytest.mark.parametrize("block_size,sdt", [(32, "f16"), (16, "f32"), (0, "bf16")])
def test_create_codebook_writes_the_nearest_e2m1_values(tmp_path, block_size, sdt):
    """--codebook e2m1: per block absmax / 12, each code the nearest book value
    (qmoebank.quantize_rows_codebook, the same rule), no zero points; the
    bank opens, inspect names the book, bank2onnx writes its int8 twin."""
    extra = ["--seed", 4, "--scale-dtype", sdt, "--codebook", "e2m1", "--swiglu-fusion", 0]
    path = create(tmp_path / "cb.qmoe", layers=2, experts=3, hidden=64, inter=32,
                  bits=4, block_size=block_size, activation="swiglu", extra=extra)
    _, meta, _ = qb.read_header(str(path))
    assert meta["qmoe.codebook"] == "e2m1" and meta["qmoe.bits"] == "4"
    cfg, tensors = qb.load_bank(str(path))
    assert cfg.codebook == "e2m1" and cfg.to_metadata()["qmoe.codebook"] == "e2m1"
    assert not any(name.endswith("zero_points") for name in tensors)
    sd = {"f32": np.float32, "f16": np.float16, "bf16": qb.BF16}[sdt]
    for layer in range(2):
        want = expected_layer(cfg, 4, layer, sd, False)
        lt = qb.layer_tensors(tensors, layer)
        for proj in ("fc1", "fc2", "fc3"):
            w = want[proj + "._float"]
            packed, scales = qb.quantize_rows_codebook(w, block_size, "e2m1", sd)
            assert lt[proj + ".weight"].tobytes() == packed.tobytes(), (layer, proj)
            assert lt[proj + ".scales"].tobytes() == scales.tobytes(), (layer, proj)
            # Within half the widest gap of the book (2, between 8 and 12) of a
            # step, plus the scale's own rounding.
            deq = qb.dequantize(cfg, proj, lt)
            s = lt[proj + ".scales"].astype(np.float64)
            s = s if s.ndim == 3 else s[:, :, None]
            step = np.repeat(s, block_size or w.shape[2], axis=2)[:, :, :w.shape[2]]
            assert np.all(np.abs(deq - w) <= 2.0 * step * (1 + 2.0 ** -7) + 1e-7), proj
    out = tool("inspect", path).stdout
    assert "codebook: e2m1 (codes 0-15: 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12)" in out
    info = json.loads(tool("inspect", "--json", path).stdout)
    assert info["codebook"] == {"name": "e2m1",
                                "values": [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]}
    # bank2onnx writes the int8 twin (onnxruntime's QMoE has no code book):
    # codes 128 + e2m1[q], the scales as they are; test_vs_ort.py runs one.
    r = py_cli("bank2onnx.py", path, "--layer", "1", "--out", tmp_path / "cb.onnx")
    assert "128 + e2m1[q]" in r.stderr, r.stderr
    import onnx
    from onnx import numpy_helper
    graph = onnx.load(str(tmp_path / "cb.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    lt = qb.layer_tensors(tensors, 1)
    book = np.array(qb.CODEBOOKS["e2m1"], np.int16)
    for proj in ("fc1", "fc2", "fc3"):
        codes = qb.unpack_codes(lt[proj + ".weight"], 4, cfg.dims(proj)[1])
        w8 = inits["layers.1.%s.weight" % proj]
        assert w8.dtype == np.uint8 and np.array_equal(w8, 128 + book[codes]), proj


def test_create_codebook_needs_4_bit_symmetric_codes(tmp_path):
    for bits, extra in ((8, []), (4, ["--asymmetric"])):
        r = tool("create", "--out", tmp_path / "x.qmoe", "--layers", 1, "--experts", 2, "--hidden",
                 32, "--inter", 32, "--k", 1, "--bits", bits, "--block-size", 32, "--activation",
                 "silu", "--codebook", "e2m1", *extra, check=False)
        assert r.returncode == 2 and "--codebook e2m1 needs --bits 4" in r.stderr, r.stderr
    r = tool("create", "--out", tmp_path / "x.qmoe", "--layers", 1, "--experts", 2, "--hidden",
             32, "--inter", 32, "--k", 1, "--bits", 4, "--block-size", 32, "--activation", "silu",
             "--codebook", "nf4", check=False)
    assert r.returncode == 2 and "--codebook must be e2m1" in r.stderr
    assert not os.path.exists(tmp_path / "x.qmoe")
    assert "--codebook e2m1" in tool("create", "--help").stdout


def test_inspect_plain_bank_has_no_codebook(tmp_path):
    path = create(tmp_path / "p.qmoe")
    assert "codebook: none" in tool("inspect", path).stdout
    assert json.loads(tool("inspect", "--json", path).stdout)["codebook"] is None


def test_create_is_deterministic_and_seeded(tmp_path):
    a = create(tmp_path / "a.qmoe", extra=["--seed", 5, "--router"])
    b = create(tmp_path / "b.qmoe", extra=["--seed", 5, "--router"])
    c = create(tmp_path / "c.qmoe", extra=["--seed", 6, "--router"])
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_bank_written_by_python_safetensors_inspects(tmp_path):
    cfg = qb.BankConfig(layers=2, experts=4, hidden_size=32, inter_size=16, k=2, bits=4,
                        block_size=16, activation="swiglu", swiglu_fusion=1,
                        activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(2):
        for proj in ("fc1", "fc2"):
            n, k = cfg.dims(proj)
            w, s, zp = qb.quantize_rows(rng.standard_normal((4, n, k)), 4, 16, True)
            tensors[f"layers.{layer}.{proj}.weight"] = w
            tensors[f"layers.{layer}.{proj}.scales"] = s.astype(np.float16)
            tensors[f"layers.{layer}.{proj}.zero_points"] = zp
            tensors[f"layers.{layer}.{proj}.bias"] = rng.standard_normal((4, n)).astype(np.float16)
        tensors[f"layers.{layer}.router.weight"] = rng.standard_normal((4, 32)).astype(np.float32)
    tensors["lm_head.extra"] = np.zeros(3, dtype=np.float32)
    path = tmp_path / "py.safetensors"
    qb.save_bank(str(path), cfg, tensors)
    info = json.loads(tool("inspect", "--json", path).stdout)
    assert info["experts"] == 4 and info["hidden_size"] == 32 and info["inter_size"] == 16
    assert info["activation"] == "swiglu" and info["swiglu_fusion"] == 1
    assert abs(info["activation_alpha"] - 1.702) < 1e-6 and info["swiglu_limit"] == 7
    per_expert = sum(tensors[f"layers.0.{p}.{t}"].nbytes // 4 for p in ("fc1", "fc2")
                     for t in ("weight", "scales", "zero_points", "bias"))
    assert info["bytes_per_expert"] == per_expert
    assert info["bytes_total"] == 2 * 4 * per_expert
    assert info["warnings"] == ["lm_head.extra"]
    layer0 = info["layer_details"][0]
    assert layer0["catalog"]["pageable"] is True
    assert [t["name"] for t in layer0["tensors"]] == [
        "fc1.weight", "fc1.scales", "fc1.zero_points", "fc1.bias", "fc2.weight", "fc2.scales",
        "fc2.zero_points", "fc2.bias", "router.weight"]
    # Catalog regions really are the expert slices of the file.
    header, _, data_start = qb.read_header(str(path))
    raw = path.read_bytes()
    for e, regions in enumerate(layer0["catalog"]["regions"]):
        assert len(regions) == 8
        for tensor_idx, offset, length in regions:
            name = "layers.0." + qb.SUFFIXES[tensor_idx]
            expect = tensors[name][e].tobytes()
            assert raw[data_start + offset:data_start + offset + length] == expect


def test_inspect_text_lists_summary_keys(tmp_path):
    path = create(tmp_path / "t.qmoe")
    out = tool("inspect", path).stdout
    for key in ("name: t", "layers: 2", "experts: 4", "hidden_size: 64", "inter_size: 32",
                "k: 2", "activation: silu", "bits: 4", "block_size: 16", "bytes_total:",
                "bytes_per_expert:", "layer 1: bytes_per_expert", "catalog pageable"):
        assert key in out, key


def test_inspect_corrupt_file_exits_2_with_one_line(tmp_path):
    good = create(tmp_path / "g.qmoe").read_bytes()
    cases = {"trunc": good[: len(good) // 2], "tiny": good[:5],
             "hdr": (10 ** 12).to_bytes(8, "little") + good[8:],
             "json": good[:8] + b"[" + good[9:],
             "offsets": good.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)}
    for name, data in cases.items():
        p = tmp_path / f"{name}.qmoe"
        p.write_bytes(data)
        r = tool("inspect", p, check=False)
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(p) in lines[0], (name, r.stderr)
    r = tool("inspect", tmp_path / "missing.qmoe", check=False)
    assert r.returncode == 2 and "cannot open" in r.stderr


def test_help_for_every_subcommand():
    for sub in ("create", "inspect", "run"):
        r = tool(sub, "--help")
        assert r.stdout.startswith(f"usage: qmoe-bank {sub}")
    assert "create" in tool("--help").stdout
    assert tool("bogus", check=False).returncode == 2
    assert tool("create", "--out", "x", check=False).returncode == 2


# One float dtype per bank (create's default mixes f16 scales with f32 biases,
# which onnxruntime's single type T cannot hold: bank2onnx.py casts them).
@pytest.mark.parametrize("extra", [
    ["--router", "--asymmetric", "--cli", "--scale-dtype", "f32"],
    ["--scale-dtype", "bf16", "--router"],
    ["--activation", "swiglu", "--swiglu-fusion", "0", "--scale-dtype", "f16"],
    ["--activation", "swiglu", "--swiglu-fusion", "2", "--bits", "8", "--block-size", "0",
     "--scale-dtype", "f32"],
])
def test_bank_onnx_bank_round_trip_is_byte_identical(tmp_path, extra):
    args = dict(layers=3, experts=4, hidden=32, inter=64)
    opts = {}
    rest = []
    it = iter(extra)
    cli = "--cli" in extra
    for a in it:
        if a == "--cli":
            continue
        if a in ("--activation", "--bits", "--block-size"):
            opts[a[2:].replace("-", "_")] = next(it)
        else:
            rest.append(a)
    path = create(tmp_path / "a.qmoe", **args, **opts, extra=rest)
    py("bank2onnx.py", path, "--layer", "all", "--out", tmp_path / "a.onnx")
    py("onnx2bank.py", tmp_path / "a.onnx", "--out", tmp_path / "b.qmoe")
    tool("inspect", tmp_path / "b.qmoe")
    c1, t1 = qb.load_bank(str(path))
    c2, t2 = qb.load_bank(str(tmp_path / "b.qmoe"))
    assert vars(c1) == vars(c2)
    assert sorted(t1) == sorted(t2)
    for name in t1:
        assert t1[name].dtype == t2[name].dtype and t1[name].shape == t2[name].shape, name
        assert t1[name].tobytes() == t2[name].tobytes(), name
    if not cli:
        return
    # One layer, through the command lines: the oracle model carries that
    # layer's bytes as layer 0.
    py_cli("bank2onnx.py", path, "--layer", "2", "--out", tmp_path / "l2.onnx")
    py_cli("onnx2bank.py", tmp_path / "l2.onnx", "--out", tmp_path / "l2.qmoe")
    _, t3 = qb.load_bank(str(tmp_path / "l2.qmoe"))
    for name, arr in qb.layer_tensors(t1, 2).items():
        assert t3["layers.0." + name].tobytes() == arr.tobytes(), name


def run_ort(model, x, r):
    os.environ["ORT_USE_MLAS_Q4_GEMM_MOE"] = "0"
    os.environ["ORT_QMOE_CPU_QNBIT_GEMM"] = "0"
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"input": x, "router_probs": r})[0]


@pytest.mark.parametrize("opts", [
    dict(bits=4, block_size=32, activation="swiglu", extra=["--asymmetric", "--alpha", "1.702",
                                                            "--beta", "1", "--limit", "7"]),
    dict(bits=8, block_size=0, activation="gelu", extra=["--asymmetric"]),
    dict(bits=4, block_size=0, activation="relu", extra=[]),
    dict(bits=8, block_size=16, activation="identity", extra=[]),
])
def test_ort_oracle_agrees_with_reference_and_qmoe_bank_run(tmp_path, opts):
    extra = opts.pop("extra")
    path = create(tmp_path / "o.qmoe", layers=2, experts=8, hidden=64, inter=64, k=2,
                  extra=extra + ["--seed", 3], **opts)
    py("bank2onnx.py", path, "--layer", "1", "--dtype", "f32", "--out", tmp_path / "o.onnx")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    r = rng.standard_normal((9, 8)).astype(np.float32)
    y_ort = run_ort(tmp_path / "o.onnx", x, r).astype(np.float64)
    cfg, tensors = qb.load_bank(str(path))
    ref = qb.reference_forward(cfg, qb.layer_tensors(tensors, 1), x, r)
    assert np.linalg.norm(y_ort - ref) / np.linalg.norm(ref) < 1e-5
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "r.npy", r)
    res = tool("run", path, "--layer", 1, "--hidden", tmp_path / "x.npy", "--logits",
               tmp_path / "r.npy", "--out", tmp_path / "y.npy", "--threads", 2, check=False)
    if "engine not built" in res.stderr:
        pytest.skip("qmoe-bank was built without the CPU engine")
    assert res.returncode == 0, res.stderr
    y = np.load(tmp_path / "y.npy")
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.linalg.norm(y - y_ort) / np.linalg.norm(y_ort) < 1e-5


def test_run_with_bank_router_and_f16_io(tmp_path):
    path = create(tmp_path / "r.qmoe", extra=["--router", "--scale-dtype", "f16"])
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float16)
    np.save(tmp_path / "x.npy", x)
    res = tool("run", path, "--layer", 0, "--hidden", tmp_path / "x.npy", "--out",
               tmp_path / "y.npy", check=False)
    if "engine not built" in res.stderr:
        pytest.skip("qmoe-bank was built without the CPU engine")
    assert res.returncode == 0, res.stderr
    y = np.load(tmp_path / "y.npy")
    assert y.dtype == np.float16 and y.shape == (3, 64)
    cfg, tensors = qb.load_bank(str(path))
    lt = qb.layer_tensors(tensors, 0)
    logits = x.astype(np.float64) @ lt["router.weight"].astype(np.float64).T + lt["router.bias"]
    ref = qb.reference_forward(cfg, lt, x, logits)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-3
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8'}")
    res = tool("run", path, "--layer", 0, "--hidden", bad, "--out", tmp_path / "z.npy",
               check=False)
    assert res.returncode == 2 and "npy" in res.stderr


def test_run_bf16_io_through_u16_npy(tmp_path):
    path = create(tmp_path / "b.qmoe", extra=["--scale-dtype", "bf16"])
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32).astype(qb.BF16)
    r = np.random.default_rng(6).standard_normal((4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x.view(np.uint16))
    np.save(tmp_path / "r.npy", r)
    res = tool("run", path, "--layer", 1, "--hidden", tmp_path / "x.npy", "--logits",
               tmp_path / "r.npy", "--out", tmp_path / "y.npy", "--bf16", check=False)
    if "engine not built" in res.stderr:
        pytest.skip("qmoe-bank was built without the CPU engine")
    assert res.returncode == 0, res.stderr
    y = np.load(tmp_path / "y.npy")
    assert y.dtype == np.uint16 and y.shape == (4, 64)
    cfg, tensors = qb.load_bank(str(path))
    ref = qb.reference_forward(cfg, qb.layer_tensors(tensors, 1), x.astype(np.float32), r)
    got = y.view(qb.BF16).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 8e-3
    # Without --bf16 a uint16 array is refused rather than misread.
    res = tool("run", path, "--layer", 1, "--hidden", tmp_path / "x.npy", "--logits",
               tmp_path / "r.npy", "--out", tmp_path / "z.npy", check=False)
    assert res.returncode == 2 and "--bf16" in res.stderr


def test_inspect_shows_source_exactness_error_layer_map_and_routing(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    plain = create(tmp_path / "a.qmoe", experts=8)
    t = load_file(str(plain))
    with safe_open(str(plain), "np") as f:
        meta = dict(f.metadata())
    meta.update({"qmoe.routing.score": "sigmoid", "qmoe.routing.groups": "4",
                 "qmoe.routing.topk_groups": "2", "qmoe.routing.group_score": "top2_sum",
                 "qmoe.routing.scale": "2.5", "qmoe.layer_map": "[3, 4]",
                 "qmoe.source": '{"format":"gguf","family":"deepseek2","files":["m.gguf"],'
                                '"exact":false,"max_rel_err":0.0123}'})
    t["layers.1.router.correction_bias"] = np.zeros(8, np.float32)
    path = tmp_path / "b.qmoe"
    save_file(t, str(path), metadata=meta)
    out = tool("inspect", path).stdout
    for line in ("source_format: gguf", "source_family: deepseek2", "exact: no",
                 "max_rel_err: 0.0123", "layer_map: 0->3 1->4",
                 "routing: sigmoid scores, top-2, normalize 1, scale 2.5, groups 4 keep 2 by "
                 "top2_sum, correction bias in 1 of 2 layers"):
        assert line in out, out
    assert "router.correction_bias" in out
    info = json.loads(tool("inspect", "--json", path).stdout)
    assert info["source"] == {"format": "gguf", "family": "deepseek2", "files": ["m.gguf"],
                              "exact": False, "max_rel_err": 0.0123}
    assert info["layer_map"] == [3, 4]
    assert info["routing"] == {"score": "sigmoid", "normalize": 1, "scale": 2.5, "groups": 4,
                               "topk_groups": 2, "group_score": "top2_sum",
                               "correction_bias_layers": [1]}
    plain_info = json.loads(tool("inspect", "--json", plain).stdout)
    assert plain_info["source"] is None and plain_info["layer_map"] is None
    assert plain_info["routing"] == {"score": "legacy"}
    out = tool("inspect", plain).stdout
    assert "exact:" not in out and "layer_map: identity" in out and "routing: legacy" in out
