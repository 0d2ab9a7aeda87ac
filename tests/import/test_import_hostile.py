"""`qmoe-bank import` against hostile model files (issue 25).

The rule for every input: exit 2 with one line naming the file and the key
or tensor and what was expected (bytes from the file escaped); nothing
written outside --out; no partial file unless --resume can use it; memory
and time bounded by the input's real bytes, not by what it claims; only
regular files opened; non-finite source values refused on every path. And
the output: OUT.partial exclusive, never through a link, locked against a
second import, never loadable as a bank until it is finished."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
sys.path.insert(0, os.path.join(SRC, "tools"))
sys.path.insert(0, os.path.join(SRC, "tests", "daemon"))
sys.path.insert(0, os.path.join(SRC, "tests", "model"))
import hf_import_ref as ref  # noqa: E402
import make_hf_fixtures as mk  # noqa: E402

QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")
FIXTURES = os.path.join(HERE, "fixtures")

pytestmark = pytest.mark.skipif(not os.path.exists(QMOE_BANK), reason=f"no {QMOE_BANK}")


def tool(*args, env=None, timeout=60):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([QMOE_BANK, *map(str, args)], capture_output=True, text=True, env=e,
                          timeout=timeout)


def hf(ck, out, *args, **kw):
    return tool("import", "hf", ck, "--out", out, "--quiet", *args, **kw)


def gg(path, out, *args, **kw):
    return tool("import", "gguf", path, "--out", out, "--quiet", *args, **kw)


def refused(r, out, *phrases):
    """Exit 2, one printable line naming what was wrong, nothing left behind."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n"), r.stderr
    assert all(0x20 <= ord(c) < 0x7f for c in r.stderr[:-1]), repr(r.stderr)
    for p in phrases:
        assert p in r.stderr, (p, r.stderr)
    assert not os.path.exists(out) and not os.path.lexists(str(out) + ".partial")


def copy_fixture(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    os.remove(dst / "golden.safetensors")
    return dst


def edit_config(ck, **changes):
    p = ck / "config.json"
    c = json.loads(p.read_text())
    c.update(changes)
    p.write_text(json.dumps(c))


def gguf_file(tmp_path, name="m.gguf", **kw):
    import test_import_gguf as tg

    path = tmp_path / name
    tg.write_gguf(path, **kw)
    return path


def tensor_data_offset(path, name):
    """Absolute file offset of a GGUF tensor's data (gguf-py's reader)."""
    from gguf import GGUFReader

    for t in GGUFReader(str(path)).tensors:
        if t.name == name:
            return int(t.data_offset)
    raise KeyError(name)


def patch(path, at, data):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


# ---- row 2: non-finite values on every GGUF path ----------------------------------

@pytest.mark.parametrize("qtype,tensor,at,value", [
    ("F32", "blk.0.ffn_gate_exps.weight", 0, struct.pack("<f", float("nan"))),
    ("F16", "blk.0.ffn_up_exps.weight", 2, b"\x00\x7c"),           # +inf
    ("Q6_K", "blk.0.ffn_down_exps.weight", 208, b"\x00\x7e"),      # d = NaN, an exact repack
    ("Q5_K", "blk.0.ffn_gate_exps.weight", 0, b"\x00\x7c"),        # d = inf, requantised
    ("Q8_0", "blk.0.ffn_up_exps.weight", 34, b"\x00\x7e"),         # block 1's d = NaN, exact
    ("Q8_0", "blk.0.ffn_gate_inp.weight", 4, struct.pack("<f", float("nan"))),  # the router
])
def test_non_finite_gguf_values_are_refused_naming_the_tensor(tmp_path, qtype, tensor, at, value):
    from gguf import GGMLQuantizationType as Q

    path = gguf_file(tmp_path, types=(getattr(Q, qtype),) * 3, blocks=1, seed=3)
    patch(path, tensor_data_offset(path, tensor) + at, value)
    out = tmp_path / "b.bank"
    refused(gg(path, out), out, tensor, "NaN or infinity")


@pytest.mark.parametrize("mxfp4", ["e2m1", "int8"])
def test_mxfp4_gguf_exponent_255_is_refused_on_both_paths(tmp_path, mxfp4):
    """E8M0 255 is NaN: neither the code book bank nor the int8 one takes it."""
    from gguf import GGMLQuantizationType as Q

    path = gguf_file(tmp_path, types=(Q.MXFP4,) * 3, blocks=1, seed=3)
    tensor = "blk.0.ffn_down_exps.weight"
    patch(path, tensor_data_offset(path, tensor) + 17, b"\xff")  # block 1's exponent
    out = tmp_path / "b.bank"
    refused(gg(path, out, "--mxfp4", mxfp4), out, tensor, "NaN or infinity")


@pytest.mark.parametrize("mxfp4", ["e2m1", "int8"])
def test_mxfp4_exponents_that_overflow_f32_are_refused(tmp_path, mxfp4):
    """E8M0 254 times the largest E2M1 value (6) is beyond f32: the HF
    importer refused 255 only and wrote an 'exact' bank of infinities (the
    code book bank would hold scale 2^126 and code 12: the same infinity)."""
    ck = copy_fixture(tmp_path, "gpt_oss_mxfp4")
    t = ref.read_safetensors_raw(ck / "model.safetensors")
    p = "model.layers.0.mlp.experts."
    dt, shape, raw = t[p + "down_proj_scales"]  # [E, H, I/32]: element 5 = expert 0, row 5
    t[p + "down_proj_scales"] = (dt, shape, raw[:5] + b"\xfe" + raw[6:])
    dt, shape, raw = t[p + "down_proj_blocks"]  # [E, H, I/32, 16]: row 5's block
    t[p + "down_proj_blocks"] = (dt, shape, raw[:80] + b"\x77" + raw[81:])  # two codes of 6
    mk.write_safetensors(ck / "model.safetensors", t, {"format": "pt"})
    out = tmp_path / "b.bank"
    refused(hf(ck, out, "--mxfp4", mxfp4), out, p + "down_proj_scales", "NaN or infinity")


# ---- rows 3 and 4: claims are not costs -------------------------------------------

def test_a_config_claiming_65536_layers_of_65536_experts_costs_nothing(tmp_path):
    ck = copy_fixture(tmp_path, "qwen3_moe")
    edit_config(ck, num_hidden_layers=65536, num_experts=65536, num_local_experts=65536)
    out = tmp_path / "b.bank"
    t0 = time.monotonic()
    r = hf(ck, out)  # the old importer asked calloc for 192 GiB first, and got ENOMEM
    refused(r, out, "checkpoint has no tensor model.layers.0.mlp.experts.8.gate_proj.weight",
            "65536 layers x 65536 experts")
    assert time.monotonic() - t0 < 10


def test_a_long_mlp_only_layers_is_read_once(tmp_path):
    """60,000 entries: each was looked up by index for every layer (17 s for
    40,000 in issue 25); the limit leaves an order of magnitude for a slow,
    shared machine."""
    ck = copy_fixture(tmp_path, "qwen3_moe")
    edit_config(ck, mlp_only_layers=[99999] * 59999 + [1])
    out = tmp_path / "b.bank"
    t0 = time.monotonic()
    r = hf(ck, out)
    took = time.monotonic() - t0
    refused(r, out, "model.layers.1.mlp.experts.0.gate_proj.weight", "contradicts config.json")
    assert took < 5, took
    edit_config(ck, mlp_only_layers=[0.5])
    refused(hf(ck, out), out, "mlp_only_layers[0] is 0.5, expected a layer index")


# ---- row 5: FIFOs and devices --------------------------------------------------------

def fifo_in_place_of(path):
    os.remove(path)
    os.mkfifo(path)


@pytest.mark.parametrize("which", ["config.json", "model.safetensors.index.json",
                                   "model-00002-of-00003.safetensors", "link"])
def test_a_fifo_in_a_checkpoint_is_refused_without_blocking(tmp_path, which):
    ck = copy_fixture(tmp_path, "mixtral")
    if which == "link":  # a shard that is a symbolic link to a FIFO
        os.mkfifo(tmp_path / "pipe")
        os.remove(ck / "model-00001-of-00003.safetensors")
        os.symlink(tmp_path / "pipe", ck / "model-00001-of-00003.safetensors")
    else:
        fifo_in_place_of(ck / which)
    out = tmp_path / "b.bank"
    refused(hf(ck, out, timeout=20), out, "a FIFO, not a regular file")


def test_a_fifo_or_a_device_as_the_gguf_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "m.gguf")
    out = tmp_path / "b.bank"
    refused(gg(tmp_path / "m.gguf", out, timeout=20), out, "m.gguf is a FIFO, not a regular file")
    refused(gg("/dev/zero", out, timeout=20), out, "/dev/zero is a device, not a regular file")


# ---- rows 6 and 7: the output file ---------------------------------------------------

def stopped(proc, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_second_import_to_the_same_out_refuses_while_the_first_runs(tmp_path, fmt):
    src = os.path.join(FIXTURES, "qwen2_moe") if fmt == "hf" else gguf_file(tmp_path, blocks=2)
    clean = tmp_path / "clean.bank"
    assert tool("import", fmt, src, "--out", clean, "--quiet").returncode == 0
    out = tmp_path / "b.bank"
    env = dict(os.environ, QMOE_IMPORT_KILL_AFTER_LAYERS="1", QMOE_IMPORT_KILL_SIGNAL="STOP")
    first = subprocess.Popen([QMOE_BANK, "import", fmt, str(src), "--out", str(out), "--quiet"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert stopped(first), "the first import did not stop after its first layer"
        for resume in ([], ["--resume"]):
            r = tool("import", fmt, src, "--out", out, "--quiet", *resume)
            assert r.returncode == 2 and "being written by another process" in r.stderr, r.stderr
        assert not out.exists() and os.path.exists(str(out) + ".partial")
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert out.read_bytes() == clean.read_bytes()
    assert not os.path.exists(str(out) + ".partial")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_link_at_the_partial_path_is_never_followed(tmp_path, fmt):
    src = os.path.join(FIXTURES, "olmoe") if fmt == "hf" else gguf_file(tmp_path, blocks=1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    out = tmp_path / "b.bank"
    os.symlink(victim, str(out) + ".partial")
    r = tool("import", fmt, src, "--out", out, "--quiet")
    assert r.returncode == 2 and "symbolic link" in r.stderr and r.stderr.count("\n") == 1, r
    assert victim.read_bytes() == b"someone else's file"
    assert not out.exists() and os.path.islink(str(out) + ".partial")


# ---- row 8: ranges as the loader's, shards that are not files, --out a directory ----

@pytest.mark.parametrize("scale", [1e308, 5e-324, -1.0])
def test_gguf_expert_weights_scale_outside_the_loaders_range_writes_nothing(tmp_path, scale):
    import gguf

    path = gguf_file(tmp_path, arch="deepseek2", blocks=1,
                     types=(gguf.GGMLQuantizationType.Q8_0,) * 3,
                     typed_keys=[("add_float64", "deepseek2.expert_weights_scale", scale)])
    out = tmp_path / "b.bank"
    refused(gg(path, out), out, "deepseek2.expert_weights_scale")


def test_hf_routed_scaling_factor_outside_the_loaders_range_writes_nothing(tmp_path):
    ck = copy_fixture(tmp_path, "deepseek_v2")
    out = tmp_path / "b.bank"
    for v in (1e308, 5e-324):
        edit_config(ck, routed_scaling_factor=v)
        refused(hf(ck, out), out, "routed_scaling_factor")


def index_points_at(ck, shard):
    p = ck / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    p.write_text(json.dumps(index))


def test_a_directory_or_a_link_loop_as_a_shard_is_refused(tmp_path):
    ck = copy_fixture(tmp_path, "mixtral")
    (ck / "sub").mkdir()
    index_points_at(ck, "sub")
    out = tmp_path / "b.bank"
    refused(hf(ck, out), out, "sub is a directory, not a regular file")
    os.symlink("loop", ck / "loop")
    index_points_at(ck, "loop")
    refused(hf(ck, out), out, "loop", "Too many levels of symbolic links")


def test_out_a_directory_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "outdir"
    out.mkdir()
    r = hf(os.path.join(FIXTURES, "olmoe"), out)
    assert r.returncode == 2 and "is a directory, not a bank file to write" in r.stderr, r.stderr
    assert os.listdir(out) == [] and not os.path.exists(str(out) + ".partial")


# ---- row 9: names from the file are escaped ---------------------------------------------

def test_control_characters_in_tensor_names_are_escaped(tmp_path):
    ck = copy_fixture(tmp_path, "olmoe")
    t = ref.read_safetensors_raw(ck / "model.safetensors")
    name = "evil\x1b[2J\nname"
    t[name] = ("F32", [4], b"\0" * 16)
    mk.write_safetensors(ck / "model.safetensors", t)
    # make the extra tensor claim bytes past the file, so the error quotes its name
    data = bytearray((ck / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name]["data_offsets"] = [len(data), len(data) + 16]
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    (ck / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + data[8 + n:])
    out = tmp_path / "b.bank"
    r = hf(ck, out)
    refused(r, out, "evil\\x1b[2J\\x0aname")
    # the same for a GGUF tensor name (same length: GGUF strings are counted)
    path = gguf_file(tmp_path, blocks=1)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"blk.0.ffn_up_exps.weight")
    raw[at:at + 24] = b"blk.9.ffn_\x1b[1m_exps\nabcd"
    path.write_bytes(bytes(raw))
    refused(gg(path, out), out, "blk.9.ffn_\\x1b[1m_exps\\x0aabcd: block 9")


# ---- row 10: SIGINT/SIGTERM -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_terminated_import_is_resumable_or_leaves_nothing(tmp_path, fmt):
    src = os.path.join(FIXTURES, "qwen2_moe") if fmt == "hf" else gguf_file(tmp_path, blocks=2)
    clean = tmp_path / "clean.bank"
    assert tool("import", fmt, src, "--out", clean, "--quiet").returncode == 0
    out = tmp_path / "b.bank"
    partial = str(out) + ".partial"
    r = tool("import", fmt, src, "--out", out, "--quiet",
             env={"QMOE_IMPORT_KILL_AFTER_LAYERS": "0", "QMOE_IMPORT_KILL_SIGNAL": "TERM"})
    assert r.returncode == -signal.SIGTERM, r
    assert "interrupted after 0 of 2 layers; nothing was kept" in r.stderr, r.stderr
    assert not out.exists() and not os.path.exists(partial)
    r = tool("import", fmt, src, "--out", out, "--quiet",
             env={"QMOE_IMPORT_KILL_AFTER_LAYERS": "1", "QMOE_IMPORT_KILL_SIGNAL": "INT"})
    assert r.returncode == -signal.SIGINT, r
    assert "interrupted after 1 of 2 layers; the partial file is kept" in r.stderr, r.stderr
    assert not out.exists() and os.path.exists(partial)
    assert tool("inspect", partial).returncode == 2  # not a bank until finished
    r = tool("import", fmt, src, "--out", out, "--quiet", "--resume")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == clean.read_bytes() and not os.path.exists(partial)


# ---- row 11: tensors sharing bytes -----------------------------------------------------

def test_gguf_tensors_sharing_data_are_refused(tmp_path):
    path = gguf_file(tmp_path, blocks=2)
    raw = bytearray(path.read_bytes())

    def info_offset_at(name):
        at = raw.index(name.encode()) + len(name)
        n_dims = struct.unpack_from("<I", raw, at)[0]
        return at + 4 + 8 * n_dims + 4

    a = info_offset_at("blk.0.ffn_gate_exps.weight")
    b = info_offset_at("blk.1.ffn_gate_exps.weight")
    raw[b:b + 8] = raw[a:a + 8]
    path.write_bytes(bytes(raw))
    out = tmp_path / "b.bank"
    refused(gg(path, out), out, "blk.", "overlaps tensor", "ffn_gate_exps.weight")


def test_safetensors_tensors_sharing_data_are_refused(tmp_path):
    ck = copy_fixture(tmp_path, "qwen3_moe")
    data = bytearray((ck / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    a = "model.layers.0.mlp.experts.0.gate_proj.weight"
    b = "model.layers.0.mlp.experts.1.gate_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    (ck / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + data[8 + n:])
    out = tmp_path / "b.bank"
    refused(hf(ck, out), out, "model.safetensors", "overlap")


# ---- item 4: what an interrupted or racing import leaves never loads --------------------

def test_the_daemon_never_loads_an_interrupted_or_racing_imports_file(tmp_path):
    import qmoed_harness as h

    if not os.path.exists(h.qmoed_path()):
        pytest.skip("qmoed not built")
    ck = os.path.join(FIXTURES, "qwen2_moe")
    out = tmp_path / "b.bank"
    partial = str(out) + ".partial"
    assert hf(ck, out).returncode == 0  # an earlier, complete import of OUT
    before = out.read_bytes()
    d = h.Daemon()
    try:
        c = d.client()
        # interrupted: killed after one layer
        os.rename(out, tmp_path / "old.bank")
        r = hf(ck, out, env={"QMOE_IMPORT_KILL_AFTER_LAYERS": "1"})
        assert r.returncode == -signal.SIGKILL and os.path.exists(partial)
        reply = c.request("model.load", {"name": "partial", "path": partial})
        assert "error" in reply, reply
        os.rename(tmp_path / "old.bank", out)
        # racing: a second import runs while the first holds OUT.partial
        env = dict(os.environ, QMOE_IMPORT_KILL_AFTER_LAYERS="1", QMOE_IMPORT_KILL_SIGNAL="STOP")
        first = subprocess.Popen([QMOE_BANK, "import", "hf", ck, "--out", str(out), "--quiet",
                                  "--bits", "8"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        try:
            assert stopped(first)
            assert hf(ck, out, "--bits", "8").returncode == 2
            assert "error" in c.request("model.load", {"name": "racing", "path": partial})
            assert "result" in c.request("model.load", {"name": "old", "path": str(out)})
        finally:
            first.send_signal(signal.SIGCONT)
            first.communicate(timeout=60)
        assert first.returncode == 0
        assert out.read_bytes() != before and not os.path.exists(partial)
        assert "result" in c.request("model.load", {"name": "new", "path": str(out)})
    finally:
        d.stop()
