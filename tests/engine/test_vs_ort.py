"""The CPU engine against onnxruntime's CPU QMoE kernel (the oracle of
docs/BANK_FORMAT.md), through `qmoe-bank run` and tools/bank2onnx.py.

Every variant onnxruntime's CPU kernel accepts is covered: bits 4/8, row-wise
and block-wise scales (16, 32, 64), symmetric and asymmetric, with and without
biases, relu/gelu/silu/identity and interleaved swiglu, f32 (1e-5 relative)
and a few f16 cases. Variants the CPU kernel rejects (swiglu_fusion 0 with
fc3, swiglu_fusion 2, bf16) are judged by the float64 reference in
test_engine.c; test_ort_rejects_what_we_say_it_rejects pins that list to the
installed onnxruntime.

Inputs are drawn fresh each run from a seed printed in the log; set
QMOE_TEST_SEED to replay one.
"""

import math
import os
import subprocess
import sys
import time
import zlib

# The exact dequantise-then-SGEMM path; must be set before a session is made.
os.environ["ORT_USE_MLAS_Q4_GEMM_MOE"] = "0"
os.environ["ORT_QMOE_CPU_QNBIT_GEMM"] = "0"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tools"))
import bank2onnx  # noqa: E402
import qmoebank  # noqa: E402

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (scripts/setup.sh)")

SEED = int(os.environ.get("QMOE_TEST_SEED") or int(time.time() * 1000) % 2**31)
print(f"test_vs_ort: seed {SEED} (QMOE_TEST_SEED={SEED} replays)", file=sys.stderr)

QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")

SHAPES = [  # (T, E, k): T in {1, 7, 64, 333}, E in {1, 8, 32}, k in {1, 2, 4, E}
    (1, 8, 2), (7, 1, 1), (64, 8, 4), (333, 32, 4), (7, 32, 32), (1, 32, 1),
    (64, 32, 2), (333, 8, 8), (1, 1, 1), (7, 8, 1), (64, 8, 2), (333, 32, 1),
]


def variants():
    out = []
    i = 0
    for bits in (4, 8):
        for bs in (0, 16, 32, 64):
            for asym in (0, 1):
                for act in ("relu", "gelu", "silu", "identity", "swiglu"):
                    out.append(dict(bits=bits, bs=bs, asym=asym, act=act, bias=i % 3 != 2,
                                    shape=SHAPES[i % len(SHAPES)]))
                    i += 1
    return out


def dims(v, rng):
    """H and I not multiples of 64; with block-wise zero points onnxruntime
    needs them to be multiples of block_size * pack."""
    pack = 8 // v["bits"]
    if v["asym"] and v["bs"]:
        unit = v["bs"] * pack
        h = unit * int(rng.integers(1, 4))
        i = unit * int(rng.integers(1, 4))
        if unit < 64:  # steer away from multiples of 64
            h += unit if h % 64 == 0 else 0
            i += unit if i % 64 == 0 else 0
        return h, i
    return int(rng.choice([72, 96, 136, 200])), int(rng.choice([40, 80, 144, 168]))


def make_bank(path, v, rng, dtype=np.float32):
    t_, e, k = v["shape"]
    h, i = dims(v, rng)
    cfg = qmoebank.BankConfig(layers=1, experts=e, hidden_size=h, inter_size=i, k=k,
                              bits=v["bits"], block_size=v["bs"], activation=v["act"],
                              swiglu_fusion=1 if v["act"] == "swiglu" else 0,
                              activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    tensors = {}
    for proj in ("fc1", "fc2"):
        n, kk = cfg.dims(proj)
        w = rng.standard_normal((e, n, kk)).astype(np.float32) / math.sqrt(kk)
        packed, scales, zp = qmoebank.quantize_rows(w, cfg.bits, cfg.block_size, bool(v["asym"]))
        tensors[f"layers.0.{proj}.weight"] = packed
        tensors[f"layers.0.{proj}.scales"] = scales.astype(dtype)
        if zp is not None:
            tensors[f"layers.0.{proj}.zero_points"] = zp
        if v["bias"]:
            tensors[f"layers.0.{proj}.bias"] = (0.1 * rng.standard_normal((e, n))).astype(dtype)
    qmoebank.save_bank(str(path), cfg, tensors)
    return cfg, tensors


def run_ours(tmp, bank, x, logits, threads=2):
    xp, lp, yp = tmp / "x.npy", tmp / "logits.npy", tmp / "y.npy"
    np.save(xp, x)
    np.save(lp, logits)
    r = subprocess.run([QMOE_BANK, "run", str(bank), "--layer", "0", "--hidden", str(xp),
                        "--logits", str(lp), "--out", str(yp), "--threads", str(threads)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"qmoe-bank run failed: {r.stderr}"
    return np.load(yp)


def run_ort(cfg, tensors, x, logits, dtype=np.float32):
    model = bank2onnx.build_model(cfg, tensors, [0], np.dtype(dtype))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x.astype(dtype), "router_probs": logits.astype(dtype)})[0]


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(rng, t, h, e):
    x = rng.uniform(-1, 1, (t, h)).astype(np.float32)
    x[x == 0] = 0.5
    logits = (2 * rng.standard_normal((t, e))).astype(np.float32)
    return x, logits


def test_qmoe_bank_binary_is_built():
    assert os.access(QMOE_BANK, os.X_OK), f"{QMOE_BANK} missing: build the qmoe-bank target"


@pytest.mark.parametrize("v", variants(),
                         ids=lambda v: f"b{v['bits']}-bs{v['bs']}-{'asym' if v['asym'] else 'sym'}-"
                                       f"{v['act']}-{'bias' if v['bias'] else 'nobias'}-"
                                       f"T{v['shape'][0]}E{v['shape'][1]}k{v['shape'][2]}")
def test_f32_matches_onnxruntime(tmp_path, v):
    rng = np.random.default_rng([SEED, zlib.crc32(repr(sorted(v.items())).encode())])
    bank = tmp_path / "bank.safetensors"
    cfg, tensors = make_bank(bank, v, rng)
    t = v["shape"][0]
    x, logits = inputs(rng, t, cfg.hidden_size, cfg.experts)
    ours = run_ours(tmp_path, bank, x, logits)
    theirs = run_ort(cfg, tensors, x, logits)
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    err = rel(ours, theirs)
    assert err <= 1e-5, f"seed {SEED}: |ours - ort| / |ort| = {err:.3g} (H {cfg.hidden_size}, I {cfg.inter_size})"
    ref = qmoebank.reference_forward(cfg, qmoebank.layer_tensors(tensors, 0), x, logits)
    assert rel(ours, ref) <= 1e-5, f"seed {SEED}: vs float64 reference {rel(ours, ref):.3g}"


@pytest.mark.parametrize("act,bits,bs", [("swiglu", 4, 32), ("silu", 8, 64), ("gelu", 4, 0)])
def test_f16_matches_onnxruntime(tmp_path, act, bits, bs):
    rng = np.random.default_rng([SEED, bits, bs, len(act)])
    v = dict(bits=bits, bs=bs, asym=0, act=act, bias=True, shape=(64, 8, 2))
    bank = tmp_path / "bank.safetensors"
    cfg, tensors = make_bank(bank, v, rng, dtype=np.float16)
    x, logits = inputs(rng, 64, cfg.hidden_size, cfg.experts)
    x16 = x.astype(np.float16)
    # onnxruntime takes f16 logits here: every side routes on the same f16
    # values (f32 logits one rounding apart can pick another expert where
    # two logits are close, and one token routed differently is ~10%).
    logits = logits.astype(np.float16).astype(np.float32)
    ours = run_ours(tmp_path, bank, x16, logits)
    assert ours.dtype == np.float16
    theirs = run_ort(cfg, tensors, x16, logits, np.float16)
    ref = qmoebank.reference_forward(cfg, qmoebank.layer_tensors(tensors, 0), x16.astype(np.float32),
                                     logits)
    # Both round the output to f16 (2^-11 relative); onnxruntime also keeps
    # f16 intermediates, so it sits further from the float64 reference than we do.
    assert rel(ours, ref) <= 1e-3, f"seed {SEED}: ours vs float64 {rel(ours, ref):.3g}"
    assert rel(ours, theirs) <= 3e-3, f"seed {SEED}: ours vs ort {rel(ours, theirs):.3g}"


@pytest.mark.parametrize("bits,bs,act", [(4, 32, "swiglu"), (8, 64, "silu"), (4, 0, "gelu"),
                                         (8, 16, "swiglu")])
def test_f16_scales_with_f32_activations_match_onnxruntime(tmp_path, bits, bs, act):
    """`qmoe-bank import` and `create` write f16 scales by default, next to
    f32 activations and biases. onnxruntime's QMoE takes its scales in the
    activation type, so it runs on the same scales widened to f32 (exactly:
    every f16 is an f32), and must agree with our f16-scale bank within 1e-5."""
    rng = np.random.default_rng([SEED, bits, bs, len(act), 16])
    v = dict(bits=bits, bs=bs, asym=0, act=act, bias=True, shape=(16, 8, 2))
    bank = tmp_path / "bank.safetensors"
    cfg, tensors = make_bank(bank, v, rng)
    f16 = {k: (a.astype(np.float16) if k.endswith(".scales") else a) for k, a in tensors.items()}
    qmoebank.save_bank(str(bank), cfg, f16)
    widened = {k: (a.astype(np.float32) if k.endswith(".scales") else a) for k, a in f16.items()}
    x, logits = inputs(rng, 16, cfg.hidden_size, cfg.experts)
    ours = run_ours(tmp_path, bank, x, logits)
    assert ours.dtype == np.float32
    theirs = run_ort(cfg, widened, x, logits)
    err = rel(ours, theirs)
    assert err <= 1e-5, f"seed {SEED}: |ours - ort| / |ort| = {err:.3g} with f16 scales"
    ref = qmoebank.reference_forward(cfg, qmoebank.layer_tensors(widened, 0), x, logits)
    assert rel(ours, ref) <= 1e-5, f"seed {SEED}: vs float64 reference {rel(ours, ref):.3g}"


@pytest.mark.parametrize("bs,act,shape", [(32, "swiglu", (7, 8, 4)), (16, "silu", (64, 32, 4)),
                                          (0, "gelu", (1, 8, 2)), (32, "relu", (333, 8, 2))])
def test_code_book_bank_matches_onnxruntime_through_its_int8_twin(tmp_path, bs, act, shape):
    """A bank whose 4-bit codes read through the e2m1 code book (MXFP4's own
    layout), run by `qmoe-bank run`, against onnxruntime on the model
    bank2onnx.py writes for it (the int8 twin: codes 128 + e2m1[q], the same
    weights): within 1e-5, and within 1e-5 of the float64 reference, which
    dequantises through the book itself."""
    rng = np.random.default_rng([SEED, bs, len(act), shape[0]])
    t_, e, k = shape
    h, i = int(rng.choice([64, 96, 160])), int(rng.choice([32, 96, 128]))
    cfg = qmoebank.BankConfig(layers=1, experts=e, hidden_size=h, inter_size=i, k=k, bits=4,
                              block_size=bs, activation=act, activation_alpha=1.702,
                              activation_beta=1.0, swiglu_limit=7.0, codebook="e2m1")
    tensors = {}
    for proj in ("fc1", "fc2"):
        n, kk = cfg.dims(proj)
        w = rng.standard_normal((e, n, kk)).astype(np.float32) / math.sqrt(kk)
        packed, scales = qmoebank.quantize_rows_codebook(w, bs, "e2m1", np.float16)
        tensors[f"layers.0.{proj}.weight"] = packed
        tensors[f"layers.0.{proj}.scales"] = scales
        tensors[f"layers.0.{proj}.bias"] = (0.1 * rng.standard_normal((e, n))).astype(np.float32)
    bank = tmp_path / "cb.qmoe"
    qmoebank.save_bank(str(bank), cfg, tensors)
    model = tmp_path / "cb.onnx"
    # f32 activations beside the f16 scales an import writes (widened exactly).
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "bank2onnx.py"), str(bank),
                        "--dtype", "f32", "--out", str(model)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "128 + e2m1[q]" in r.stderr, r.stderr
    x, logits = inputs(rng, t_, h, e)
    ours = run_ours(tmp_path, bank, x, logits)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    theirs = sess.run(None, {"input": x, "router_probs": logits})[0]
    err = rel(ours, theirs)
    assert err <= 1e-5, f"seed {SEED}: |ours - ort| / |ort| = {err:.3g} (H {h}, I {i})"
    ref = qmoebank.reference_forward(cfg, qmoebank.layer_tensors(tensors, 0), x, logits)
    assert rel(ours, ref) <= 1e-5, f"seed {SEED}: vs float64 reference {rel(ours, ref):.3g}"


def test_thread_count_does_not_change_bits(tmp_path):
    rng = np.random.default_rng([SEED, 7])
    v = dict(bits=4, bs=32, asym=1, act="swiglu", bias=True, shape=(64, 8, 2))
    bank = tmp_path / "bank.safetensors"
    cfg, _ = make_bank(bank, v, rng)
    x, logits = inputs(rng, 64, cfg.hidden_size, cfg.experts)
    outs = [run_ours(tmp_path, bank, x, logits, threads=n) for n in (1, 2, 3)]
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()


@pytest.mark.parametrize("act,fusion", [("swiglu", 2), ("swiglu", 0)])
def test_ort_rejects_what_we_say_it_rejects(tmp_path, act, fusion):
    """If a newer onnxruntime starts accepting these, this test says so and
    the variant should move into the oracle matrix."""
    rng = np.random.default_rng(1)
    cfg = qmoebank.BankConfig(layers=1, experts=2, hidden_size=32, inter_size=16, k=1, bits=4,
                              block_size=0, activation=act, swiglu_fusion=fusion,
                              activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    tensors = {}
    for proj in ("fc1", "fc2", "fc3") if cfg.has_fc3 else ("fc1", "fc2"):
        n, kk = cfg.dims(proj)
        packed, scales, _ = qmoebank.quantize_rows(rng.standard_normal((2, n, kk)), 4, 0, False)
        tensors[f"layers.0.{proj}.weight"] = packed
        tensors[f"layers.0.{proj}.scales"] = scales
    x, logits = inputs(rng, 3, 32, 2)
    with pytest.raises(Exception):
        run_ort(cfg, tensors, x, logits)
