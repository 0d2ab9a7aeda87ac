"""`qmoe-bank import hf` against transformers.

The fixtures are tiny random-initialised checkpoints that transformers wrote
with save_pretrained (tools/make_hf_fixtures.py; GPT-OSS also in the Hub's
MXFP4 layout, DeepSeek-V3 also FP8 block-scaled). Their golden.safetensors
holds what transformers computed: the MoE block's output for an input x with
the bank's dequantised weights written back into the block, and the experts
and weights it chose. Only numpy and safetensors are needed here.

An MXFP4 checkpoint is imported twice: by default (its own codes through the
e2m1 code book) under its own name, and with --mxfp4 int8 (the int8 bank the
golden output was computed from, the one onnxruntime reads) as NAME_int8; the
two hold the same weights bit for bit."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tools"))
sys.path.insert(0, os.path.join(SRC, "tests", "daemon"))
import hf_import_ref as ref  # noqa: E402
import qmoebank as qb  # noqa: E402

QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")
FIXTURES = os.path.join(HERE, "fixtures")
NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))

pytestmark = pytest.mark.skipif(not os.path.exists(QMOE_BANK), reason=f"no {QMOE_BANK}")


@pytest.fixture(scope="module")
def table():
    """The importer's family table: what every check below reads instead of
    a list of its own."""
    return ref.families(QMOE_BANK)


def config(name):
    return json.load(open(os.path.join(FIXTURES, name, "config.json")))


def quant_method(name):
    return (config(name).get("quantization_config") or {}).get("quant_method")


def is_mxfp4(name):
    return quant_method(name) == "mxfp4"


# Every bank the tests read: each fixture imported as by default, and each
# MXFP4 fixture also with --mxfp4 int8 (bank name NAME_int8).
INT8 = "_int8"
BANKS = NAMES + [n + INT8 for n in NAMES if is_mxfp4(n)]


def fixture_of(bank):
    """The fixture a bank name was imported from, and the import's arguments."""
    if bank.endswith(INT8) and bank[:-len(INT8)] in NAMES:
        return bank[:-len(INT8)], ["--mxfp4", "int8"]
    return bank, []


def moe_layers(ckdir):
    """The model layers whose tensors include routed experts, past which
    num_hidden_layers does not reach: what the bank's layer map must list."""
    n = json.load(open(os.path.join(ckdir, "config.json")))["num_hidden_layers"]
    layers = set()
    for k in ref.checkpoint_tensors(ckdir):
        parts = k.split(".")
        if k.startswith("model.layers.") and ".experts." in k and int(parts[2]) < n:
            layers.add(int(parts[2]))
    return sorted(layers)


def run_import(ckdir, out, *args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([QMOE_BANK, "import", "hf", str(ckdir), "--out", str(out), "--quiet",
                           *map(str, args)], capture_output=True, text=True, env=e)


def golden(name):
    from safetensors import safe_open

    with safe_open(os.path.join(FIXTURES, name, "golden.safetensors"), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def banks(tmp_path_factory):
    d = tmp_path_factory.mktemp("banks")
    out = {}
    for name in BANKS:
        path = d / f"{name}.bank"
        fixture, args = fixture_of(name)
        r = run_import(os.path.join(FIXTURES, fixture), path, *args)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        out[name] = str(path)
    return out


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ---- what the bank holds ---------------------------------------------------------

def test_every_family_has_a_fixture_and_every_fixture_a_family(table):
    have = {config(n)["model_type"] for n in NAMES}
    assert have == {f["name"] for f in table}, (have, [f["name"] for f in table])


@pytest.mark.parametrize("name", NAMES)
def test_import_is_the_bank_the_golden_was_computed_from(banks, name):
    """An MXFP4 fixture's golden was computed from its int8 bank (the default
    before the code book; make_hf_fixtures.py now asks for it by name); the
    code book bank's weights are that bank's (test_mxfp4_..._same_weights)."""
    _, meta = golden(name)
    with open(banks[name + INT8 if is_mxfp4(name) else name], "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert sha == meta["bank_sha256"], (
        f"{name}: the import no longer gives the bank the golden output was computed from; "
        "if the change is intended, rerun tools/make_hf_fixtures.py")


@pytest.mark.parametrize("bank", BANKS)
def test_metadata_records_source_layer_map_and_swiglu(banks, table, bank):
    name, args = fixture_of(bank)
    ck = os.path.join(FIXTURES, name)
    fam = ref.family_of(ck, table)
    _, meta, _ = qb.read_header(banks[bank])
    source = json.loads(meta["qmoe.source"])
    assert source["format"] == "hf" and source["family"] == fam["name"]
    files = sorted(f for f in os.listdir(ck)
                   if f.endswith(".safetensors") and f != "golden.safetensors")
    assert source["files"] == files
    exact = is_mxfp4(name)  # MXFP4 maps onto the e2m1 code book, or int8 block 32, bit for bit
    assert source["exact"] is exact, source
    assert (source["max_rel_err"] == 0) == source["exact"]
    assert json.loads(meta["qmoe.layer_map"]) == moe_layers(ck)
    assert meta["qmoe.activation"] == "swiglu" and meta["qmoe.swiglu_fusion"] == "1"
    if fam["hf"]["flags"]["oai_swiglu"]:
        assert (meta["qmoe.activation_alpha"], meta["qmoe.activation_beta"],
                meta["qmoe.swiglu_limit"]) == ("1.70200002", "1", "7")
    codebook = "e2m1" if exact and not args else None
    assert meta.get("qmoe.codebook") == codebook
    assert (meta["qmoe.bits"], meta["qmoe.block_size"]) == ("8" if exact and args else "4", "32")


@pytest.mark.parametrize("bank", BANKS)
def test_the_banks_routing_keys_choose_transformers_experts_and_weights(banks, bank):
    """Each bank's qmoe.routing.* keys (or their absence), evaluated by a
    float64 reference of BANK_FORMAT.md's rule, pick the experts transformers
    picked, with its weights."""
    name, _ = fixture_of(bank)
    g, _ = golden(name)
    cfg, tensors = qb.load_bank(banks[bank])
    _, meta, _ = qb.read_header(banks[bank])
    for i in range(cfg.layers):
        got = ref.route_by_bank(meta, qb.layer_tensors(tensors, i), g["x"], cfg.k)
        for t, (ids, ws) in enumerate(zip(g[f"topk_ids.{i}"], g[f"topk_weights.{i}"])):
            want = {int(e): float(w) for e, w in zip(ids, ws)}
            assert set(got[t]) == set(want), (name, i, t, got[t], want)
            for e in want:
                assert abs(got[t][e] - want[e]) <= 1e-6 * max(1.0, abs(want[e])), (name, i, t)


@pytest.mark.parametrize("bank", BANKS)
def test_every_matrix_dequantises_to_the_source_within_the_recorded_bound(banks, table, bank):
    name, _ = fixture_of(bank)
    cfg, tensors = qb.load_bank(banks[bank])
    _, meta, _ = qb.read_header(banks[bank])
    source = json.loads(meta["qmoe.source"])
    ck = os.path.join(FIXTURES, name)
    fam = ref.family_of(ck, table)
    hf = fam["hf"]
    raw = ref.checkpoint_tensors(ck)
    measured = 0.0
    for i, l in enumerate(json.loads(meta["qmoe.layer_map"])):
        lt = qb.layer_tensors(tensors, i)
        src = ref.source_matrices(ck, l, fam)
        for proj in ("fc1", "fc2"):
            deq = qb.dequantize(cfg, proj, lt)
            if source["exact"]:
                # bitwise: the f32 the bank gives is the f32 the source gives
                assert np.array_equal(deq.astype(np.float32).view(np.uint32),
                                      src[proj].view(np.uint32)), f"{name} layer {l} {proj}"
                continue
            parts = [(deq[:, 0::2], src[proj][:, 0::2]), (deq[:, 1::2], src[proj][:, 1::2])] \
                if proj == "fc1" else [(deq, src[proj])]
            for d, s in parts:
                for e in range(cfg.experts):
                    measured = max(measured, rel(d[e], s[e].astype(np.float64)))
        # routers and biases are copied as f32, bit for bit
        p = f"model.layers.{l}.{hf['moe']}."
        assert np.array_equal(lt["router.weight"], raw[p + hf["router"] + ".weight"])
        if hf["flags"]["router_bias"]:
            assert np.array_equal(lt["router.bias"], raw[p + hf["router"] + ".bias"])
        if hf["flags"]["expert_biases"]:
            assert np.array_equal(lt["fc1.bias"], raw[p + "experts.gate_up_proj_bias"])
            assert np.array_equal(lt["fc2.bias"], raw[p + "experts.down_proj_bias"])
        if hf["flags"]["correction_bias"]:
            assert np.array_equal(lt["router.correction_bias"],
                                  raw[p + hf["router"] + ".e_score_correction_bias"])
    if not source["exact"]:
        assert measured <= source["max_rel_err"] * (1 + 1e-5), (measured, source)
        assert measured >= source["max_rel_err"] * (1 - 1e-5), (measured, source)
        assert 0.05 < measured < 0.2  # int4 block 32 RTN of Gaussian weights: about 0.1


@pytest.mark.parametrize("name", [n for n in NAMES if is_mxfp4(n)])
def test_mxfp4_code_book_bank_is_the_checkpoints_codes_and_the_int8_banks_weights(banks, name):
    """The default import of an MXFP4 checkpoint keeps the Hub's _blocks
    bytes as its codes (already low nibble = even column) and the int8
    bank's scales: the same weights bit for bit, in about half the bytes."""
    ce, te = qb.load_bank(banks[name])
    ci, ti = qb.load_bank(banks[name + INT8])
    assert (ce.codebook, ce.bits, ce.block_size) == ("e2m1", 4, 32)
    assert (ci.codebook, ci.bits, ci.block_size) == (None, 8, 32)
    assert sorted(te) == sorted(ti)
    _, me, _ = qb.read_header(banks[name])
    raw = ref.checkpoint_tensors(os.path.join(FIXTURES, name))
    for i, l in enumerate(json.loads(me["qmoe.layer_map"])):
        le, li = qb.layer_tensors(te, i), qb.layer_tensors(ti, i)
        for proj, src in (("fc1", "gate_up_proj_blocks"), ("fc2", "down_proj_blocks")):
            de, di = qb.dequantize(ce, proj, le), qb.dequantize(ci, proj, li)
            assert np.array_equal(de.view(np.uint64), di.view(np.uint64)), (name, l, proj)
            assert le[proj + ".scales"].tobytes() == li[proj + ".scales"].tobytes()
            blocks = raw[f"model.layers.{l}.mlp.experts.{src}"]
            assert le[proj + ".weight"].tobytes() == np.ascontiguousarray(blocks).tobytes()
            assert le[proj + ".weight"].nbytes * 2 == li[proj + ".weight"].nbytes
        for t in le:
            if not t.endswith((".weight", ".scales")) or t.startswith("router"):
                assert le[t].tobytes() == li[t].tobytes(), t
    assert os.path.getsize(banks[name]) < 0.65 * os.path.getsize(banks[name + INT8])


@pytest.mark.parametrize("args,bits,bs,exact", [(["--bits", "8"], 8, 32, True),
                                                (["--block-size", "32"], 8, 32, True),
                                                (["--bits", "4"], 4, 32, False),
                                                (["--block-size", "64"], 8, 64, False)])
def test_explicit_bits_or_block_size_keep_their_meaning_for_mxfp4(tmp_path, args, bits, bs, exact):
    """--bits/--block-size given: today's layouts (int8 block 32 exact, or a
    requantisation), never the code book, whatever --mxfp4 says."""
    out = tmp_path / "b.bank"
    r = run_import(os.path.join(FIXTURES, "gpt_oss_mxfp4"), out, *args)
    assert r.returncode == 0, r.stderr
    cfg, _ = qb.load_bank(str(out))
    _, meta, _ = qb.read_header(str(out))
    assert (cfg.codebook, cfg.bits, cfg.block_size) == (None, bits, bs)
    assert json.loads(meta["qmoe.source"])["exact"] is exact


def test_code_book_import_with_f16_scales_that_cannot_hold_the_exponents_is_refused(tmp_path):
    """There is no requantising into the code book: an explicit --scales f16
    that cannot hold 2^(e-128) is refused, naming the ways out; without
    --scales the import takes f32 scales (as the int8 path does)."""
    import make_hf_fixtures as mk

    ck = copy_fixture(tmp_path, "gpt_oss_mxfp4")
    t = ref.read_safetensors_raw(ck / "model.safetensors")
    p = "model.layers.0.mlp.experts.down_proj_scales"
    dt, shape, raw = t[p]
    t[p] = (dt, shape, b"\x60" + raw[1:])  # 2^-32: below f16's smallest subnormal
    mk.write_safetensors(ck / "model.safetensors", t, {"format": "pt"})
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out, "--scales", "f16"), out, "--scales f16",
                   "--scales f32 or bf16", "--mxfp4 int8")
    r = run_import(ck, out)
    assert r.returncode == 0, r.stderr
    cfg, tensors = qb.load_bank(str(out))
    assert cfg.codebook == "e2m1" and tensors["layers.0.fc2.scales"].dtype == np.float32
    assert float(tensors["layers.0.fc2.scales"].reshape(-1)[0]) == 2.0 ** -32


@pytest.mark.parametrize("name,dtype", [("gpt_oss", "BF16"), ("mixtral", "BF16"),
                                        ("olmoe", "F16"), ("deepseek_v2", "BF16")])
def test_bf16_and_f16_checkpoints_import_within_the_recorded_bound(tmp_path, table, name, dtype):
    """The fixtures are f32 (no ties); real checkpoints are bf16. Rewritten
    as bf16/f16, every matrix still dequantises within the recorded bound and
    routers/biases come across exactly."""
    import make_hf_fixtures as mk

    ck = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), ck)
    os.remove(ck / "golden.safetensors")
    for fn in [f for f in os.listdir(ck) if f.endswith(".safetensors")]:
        t = ref.read_safetensors_raw(ck / fn)
        out = {}
        for k, (dt, shape, raw) in t.items():
            if dt == "F32":
                x = np.frombuffer(raw, "<f4")
                if dtype == "F16":
                    raw = x.astype("<f2").tobytes()
                else:  # round to nearest even
                    u = x.view(np.uint32).astype(np.uint64)
                    raw = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
                dt = dtype
            out[k] = (dt, shape, raw)
        mk.write_safetensors(ck / fn, out)
    bank = tmp_path / "b.bank"
    r = run_import(ck, bank)
    assert r.returncode == 0, r.stderr
    cfg, tensors = qb.load_bank(str(bank))
    _, meta, _ = qb.read_header(str(bank))
    recorded = json.loads(meta["qmoe.source"])["max_rel_err"]
    raw = ref.checkpoint_tensors(str(ck))
    fam = ref.family_of(str(ck), table)
    hf = fam["hf"]
    measured = 0.0
    for i, l in enumerate(json.loads(meta["qmoe.layer_map"])):
        lt = qb.layer_tensors(tensors, i)
        src = ref.source_matrices(str(ck), l, fam)
        for proj in ("fc1", "fc2"):
            deq = qb.dequantize(cfg, proj, lt)
            parts = [(deq[:, 0::2], src[proj][:, 0::2]), (deq[:, 1::2], src[proj][:, 1::2])] \
                if proj == "fc1" else [(deq, src[proj])]
            for d, s_ in parts:
                for e in range(cfg.experts):
                    measured = max(measured, rel(d[e], s_[e].astype(np.float64)))
        p = f"model.layers.{l}.{hf['moe']}."
        assert np.array_equal(lt["router.weight"], raw[p + hf["router"] + ".weight"])
        if hf["flags"]["expert_biases"]:
            assert np.array_equal(lt["fc1.bias"], raw[p + "experts.gate_up_proj_bias"])
    assert abs(measured - recorded) <= 1e-5 * recorded and 0.05 < recorded < 0.2


# ---- what the bank computes ------------------------------------------------------

@pytest.mark.parametrize("bank", BANKS)
def test_float64_reference_of_the_bank_matches_transformers(banks, bank):
    g, _ = golden(fixture_of(bank)[0])
    cfg, tensors = qb.load_bank(banks[bank])
    for i in range(cfg.layers):
        y = ref.forward_given(cfg, qb.layer_tensors(tensors, i), g["x"], g[f"topk_ids.{i}"],
                              g[f"topk_weights.{i}"])
        assert rel(y, g[f"out.{i}"].astype(np.float64)) < 1e-5


@pytest.fixture(scope="module")
def daemon(banks):
    import qmoed_harness as h

    if not os.path.exists(h.qmoed_path()):
        pytest.skip("qmoed not built")
    d = h.Daemon(models={n: p for n, p in banks.items()})
    yield d, h
    d.stop()


def i32_tensor(a):
    import base64

    a = np.ascontiguousarray(a, dtype="<i4")
    return {"dtype": "i32", "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


@pytest.fixture(scope="module")
def engine_routing(daemon):
    """Whether this qmoed takes topk_ids/topk_weights, and with them routes
    by the bank's qmoe.routing.* keys (they came in together)."""
    d, h = daemon
    g, _ = golden("mixtral")
    c = d.client()
    sid = c.call("session.create", {"model": "mixtral", "policy": "whole_bank"})["session"]
    r = c.request("session.infer", {"session": sid, "layer": 0, "hidden": h.tensor(g["x"]),
                                    "topk_ids": i32_tensor(g["topk_ids.0"]),
                                    "topk_weights": h.tensor(g["topk_weights.0"])})
    c.call("session.close", {"session": sid})
    return "result" in r or "unknown member 'topk_ids'" not in json.dumps(r.get("error"))


@pytest.mark.parametrize("bank", BANKS)
def test_session_with_the_engines_routing_matches_transformers(daemon, engine_routing, bank):
    if not engine_routing:
        pytest.skip("this qmoed predates engine-supplied routing (topk_ids)")
    d, h = daemon
    name, _ = fixture_of(bank)
    g, _ = golden(name)
    c = d.client()
    sid = c.call("session.create", {"model": bank, "policy": "whole_bank"})["session"]
    for i in range(len(moe_layers(os.path.join(FIXTURES, name)))):
        r = c.call("session.infer", {"session": sid, "layer": i, "hidden": h.tensor(g["x"]),
                                     "topk_ids": i32_tensor(g[f"topk_ids.{i}"]),
                                     "topk_weights": h.tensor(g[f"topk_weights.{i}"])})
        y = h.from_tensor(r["output"])
        assert rel(y, g[f"out.{i}"].astype(np.float64)) < 1e-5


@pytest.mark.parametrize("bank", BANKS)
def test_session_routing_by_itself_chooses_transformers_experts(daemon, banks, engine_routing,
                                                                 bank):
    if "qmoe.routing.score" in qb.read_header(banks[bank])[1] and not engine_routing:
        pytest.skip("this qmoed predates routing by the bank's qmoe.routing.* keys")
    d, h = daemon
    name, _ = fixture_of(bank)
    g, _ = golden(name)
    c = d.client()
    sid = c.call("session.create", {"model": bank, "policy": "whole_bank"})["session"]
    for i in range(len(moe_layers(os.path.join(FIXTURES, name)))):
        r = c.call("session.infer", {"session": sid, "layer": i, "hidden": h.tensor(g["x"]),
                                     "return_routing": True})
        chosen = [sorted(e for e, w in tok if w > 0) for tok in r["routing"]]
        want = [sorted(int(e) for e in row) for row in g[f"topk_ids.{i}"]]
        assert chosen == want
        y = h.from_tensor(r["output"])
        assert rel(y, g[f"out.{i}"].astype(np.float64)) < 1e-5


# ---- bad input -------------------------------------------------------------------

def copy_fixture(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    os.remove(dst / "golden.safetensors")
    return dst


def edit_config(ck, **changes):
    p = ck / "config.json"
    c = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    p.write_text(json.dumps(c))


def edit_tensor(ck, file, name, array=None, dtype=None, shape=None):
    """Rewrites one tensor of a shard (new array, or the same bytes relabelled)."""
    import make_hf_fixtures as mk

    path = ck / file
    t = ref.read_safetensors_raw(path)
    dt, sh, raw = t[name]
    if array is not None:
        t[name] = mk.raw_of(array)
    else:
        t[name] = (dtype or dt, shape or sh, raw)
    mk.write_safetensors(path, t)


def assert_refused(r, out, *phrases):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr  # one sentence
    for p in phrases:
        assert p in r.stderr, (p, r.stderr)
    assert not os.path.exists(out) and not os.path.exists(str(out) + ".partial")


def test_unsupported_family_is_refused(tmp_path):
    ck = copy_fixture(tmp_path, "qwen3_moe")
    edit_config(ck, model_type="llama", architectures=["LlamaForCausalLM"])
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, 'config.json: model_type "llama"',
                   "not a supported MoE family")


def test_missing_shard_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "mixtral")
    os.remove(ck / "model-00002-of-00003.safetensors")
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "missing shard",
                   "model-00002-of-00003.safetensors", "model.safetensors.index.json")


def test_tensor_with_the_wrong_shape_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "qwen3_moe")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    edit_tensor(ck, "model.safetensors", name, array=np.zeros((30, 64), np.float32))
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "model.safetensors", name, "shape [30, 64]",
                   "implies [32, 64]")


def test_tensor_with_the_wrong_dtype_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "olmoe")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    edit_tensor(ck, "model.safetensors", name, dtype="I32")
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, name, "dtype I32", "expected F32/F16/BF16")


def test_config_contradicting_the_tensors_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "qwen3_moe")
    edit_config(ck, num_local_experts=6, num_experts=6)
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "model.layers.0.mlp.gate.weight", "shape [8, 64]",
                   "6 experts) implies [6, 64]")
    edit_config(ck, num_local_experts=8, num_experts=8, moe_intermediate_size=16)
    assert_refused(run_import(ck, out), out, "model.layers.0.mlp.experts.0.gate_proj.weight",
                   "moe_intermediate_size 16", "implies [16, 64]")
    edit_config(ck, moe_intermediate_size=32, num_hidden_layers=1)
    assert_refused(run_import(ck, out), out, "model.layers.1.mlp.experts.0.gate_proj.weight",
                   "num_hidden_layers 1")


def test_deepseek_multi_token_prediction_layers_stay_out(tmp_path):
    """DeepSeek-V3 checkpoints hold num_nextn_predict_layers MTP layers after
    num_hidden_layers, experts included; they are not the model's layers."""
    ck = copy_fixture(tmp_path, "deepseek_v3")
    edit_config(ck, num_hidden_layers=2, num_nextn_predict_layers=0)
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "model.layers.2.mlp.experts.0.gate_proj.weight",
                   "num_hidden_layers 2, num_nextn_predict_layers 0")
    edit_config(ck, num_nextn_predict_layers=1)
    r = subprocess.run([QMOE_BANK, "import", "hf", str(ck), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "multi-token-prediction layer(s) past num_hidden_layers" in r.stdout
    _, meta, _ = qb.read_header(out)
    assert json.loads(meta["qmoe.layer_map"]) == [1]


def test_missing_config_key_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "gpt_oss")
    edit_config(ck, hidden_size=None)
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, 'config.json: key "hidden_size" is missing')


def test_non_finite_weight_is_named_and_leaves_no_file(tmp_path):
    ck = copy_fixture(tmp_path, "mixtral")
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    w = np.full((64, 32), 0.1, np.float32)
    w[3, 4] = np.nan
    index = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    edit_tensor(ck, index[name], name, array=w)
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, name, "NaN or infinity")


@pytest.mark.parametrize("shard", ["../../../etc/passwd", "/etc/passwd", "..", ".", "",
                                   "sub/model.safetensors"])
def test_index_shard_outside_the_checkpoint_is_refused(tmp_path, shard):
    # A hostile weight_map: the importer once freed the list it then quoted
    # in this error (a use-after-free; SIGSEGV in the release build).
    ck = copy_fixture(tmp_path, "mixtral")
    p = ck / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    p.write_text(json.dumps(index))
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "model.safetensors.index.json",
                   f'shard "{shard}" is not a file name in the checkpoint directory')


def test_truncated_shard_is_named(tmp_path):
    ck = copy_fixture(tmp_path, "olmoe")
    p = ck / "model.safetensors"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 1000)
    out = tmp_path / "b.bank"
    assert_refused(run_import(ck, out), out, "model.safetensors", "truncated?")


def test_usage_errors_exit_2(tmp_path):
    for args in (["import"], ["import", "nosuchformat", "x", "--out", "y"],
                 ["import", "hf", str(tmp_path), "--bits", "3", "--out", "y"],
                 ["import", "hf", str(tmp_path), "--mxfp4", "fp4", "--out", "y"],
                 ["import", "hf", str(tmp_path)]):
        r = subprocess.run([QMOE_BANK, *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)


# ---- resume ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss_mxfp4", "deepseek_v3_fp8"])
def test_killed_import_resumes_to_a_byte_identical_bank(banks, tmp_path, name):
    ck = os.path.join(FIXTURES, name)
    out = tmp_path / "b.bank"
    r = run_import(ck, out, env={"QMOE_IMPORT_KILL_AFTER_LAYERS": "1"})
    assert r.returncode == -signal.SIGKILL, r
    assert not out.exists() and os.path.exists(str(out) + ".partial")
    r = subprocess.run([QMOE_BANK, "import", "hf", ck, "--out", str(out), "--resume"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "at layer 1 of 2" in r.stdout
    assert not os.path.exists(str(out) + ".partial")
    assert out.read_bytes() == open(banks[name], "rb").read()


def test_resume_refuses_a_partial_file_of_other_arguments(tmp_path):
    ck = os.path.join(FIXTURES, "olmoe")
    out = tmp_path / "b.bank"
    r = run_import(ck, out, env={"QMOE_IMPORT_KILL_AFTER_LAYERS": "1"})
    assert r.returncode == -signal.SIGKILL
    partial = str(out) + ".partial"
    before = open(partial, "rb").read()
    r = run_import(ck, out, "--resume", "--bits", "8")
    assert r.returncode == 2 and "b.bank.partial" in r.stderr and "remove it" in r.stderr
    assert open(partial, "rb").read() == before  # left for the user
    r = run_import(ck, out, "--resume")
    assert r.returncode == 0, r.stderr


def test_resume_without_a_partial_file_imports_from_the_start(banks, tmp_path):
    out = tmp_path / "b.bank"
    r = run_import(os.path.join(FIXTURES, "mixtral"), out, "--resume")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == open(banks["mixtral"], "rb").read()


# ---- memory ----------------------------------------------------------------------

def test_peak_rss_stays_near_one_layer_of_source(tmp_path):
    """The bound of docs/IMPORT.md: about one layer's source pages plus one
    expert's buffers, whatever the model's size (here 3 layers of 100 MB)."""
    ck = tmp_path / "ck"
    subprocess.run([sys.executable, os.path.join(SRC, "bench", "import", "make_synthetic_hf.py"),
                    str(ck), "--layers", "3", "--experts", "32", "--hidden", "1024",
                    "--inter", "512", "--pool-mib", "16"], check=True)
    layer = os.path.getsize(ck / "model-00001-of-00003.safetensors")
    # A fresh interpreter whose only child is the import: its RUSAGE_CHILDREN
    # peak is the import's.
    probe = ("import resource, subprocess, sys\n"
             "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
             "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", probe, QMOE_BANK, "import", "hf", str(ck), "--out",
                        str(tmp_path / "b.bank"), "--quiet"], capture_output=True, text=True)
    rc, peak_kib = map(int, r.stdout.split())
    assert rc == 0, r.stderr
    peak = peak_kib * 1024
    assert peak <= 1.5 * layer, f"peak RSS {peak / 1e6:.0f} MB for {layer / 1e6:.0f} MB layers"
    assert os.path.getsize(tmp_path / "b.bank") > 0
