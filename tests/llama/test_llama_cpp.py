"""llama.cpp with its routed experts served by qmoed (clients/llama.cpp).

clients/llama.cpp/build.sh builds the patched tools against this tree's
libqmoe-client (installed into a scratch prefix, found through pkg-config);
the build is cached outside the clone, so only the first run on a machine
pays for it. Tiny GGUFs are made at test time from the tiny Hugging Face
fixtures with llama.cpp's own convert_hf_to_gguf.py and llama-quantize
(make_ggufs.py, in the torch environment) for qwen3moe, mixtral (llama with
experts), gpt-oss and deepseek2 (a dense first block and a shared expert),
as Q8_0 and Q4_0; each is imported with `qmoe-bank import gguf` (int8 and
exact int4 banks) and served by a real qmoed on a temp socket.

What llama.cpp computes differently from qmoed: for Q8_0/Q4_0 expert
weights ggml-cpu quantises each expert input row to Q8_0 (blocks of 32,
d = max|x_b|/127, |x - d*round(x/d)| <= max|x_b|/254 per element) before
the dot products; qmoed's exact precision keeps the f32 inputs. So each
expert projection differs by at most (1/254) * sum_b max|x_b| * |W_{n,b}|_1,
and that error travels through the later layers to the logits. The bound is
measured per fixture with a reference llama.cpp cannot tell apart from
qmoed: the same GGUF with its expert tensors stored as F32 holding the
dequantised weights (FAM.Q-f32exps.gguf), where llama.cpp computes the
experts in f32 on exactly the bank's weights. With A = llama.cpp alone,
B = that reference and C = llama.cpp + qmoed:
  |C - B| <= 1e-4 * max|B|            (the same f32 math; measured ~1e-7)
  |C - A| <= |B - A| + 1e-4 * max|B|  (only llama.cpp's activation
                                       quantisation separates them)
and C generates B's 16 greedy tokens on every fixture. Where C's tokens
part from A's, the logits at that step are within the same bound. (Scaling
the output head would not keep A off near-ties: it scales the margins and
A's error alike, and greedy picks are invariant under it.)

Skips, saying which prerequisite is missing, only when the tools cannot be
built here (no torch environment, no pkg-config/patch/C++ compiler/CMake, or
no sdist: not cached and no network).
"""
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, os.path.join(SRC, "tests", "daemon"))
from qmoed_harness import BUILD, Daemon, qmoe_bank_path  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2"]
TYPES = ["q8_0", "q4_0"]
# Every (family, type) the GGUFs hold (make_ggufs.py): GPT-OSS in MXFP4 too,
# which imports to the e2m1 code book (docs/BANK_FORMAT.md).
CASES = [(f, q) for f in FAMILIES for q in TYPES] + [("gpt_oss", "mxfp4_moe")]
IMPORTED = {"q4_0": "int4 block 32", "q8_0": "int8 block 32",
            "mxfp4_moe": "e2m1 code book block 32"}
PROMPT = "the quick brown fox"
TOKENS = 16
EPS = 1e-4  # f32 against f32: relative to the largest logit
BUILD_TIMEOUT = 3600  # the first build on a 2-core machine; later runs take seconds


def torch_python():
    for d in (os.environ.get("QMOE_TORCH_VENV"), "/var/cache/qmoed/venv-torch",
              os.path.expanduser("~/.cache/qmoed/venv-torch")):
        if d and os.path.exists(os.path.join(d, "bin", "python")):
            return os.path.join(d, "bin", "python")
    return None


def cache(key):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    raise AssertionError("%s not in CMakeCache.txt" % key)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """PREFIX/bin with the patched llama.cpp tools, built by build.sh (or
    $QMOE_LLAMA_PREFIX: tools installed by an earlier build.sh)."""
    if os.environ.get("QMOE_LLAMA_PREFIX"):
        if torch_python() is None:
            pytest.skip("no torch environment (QMOE_TORCH_VENV, /var/cache/qmoed/venv-torch) for "
                        "convert_hf_to_gguf.py: run scripts/setup.sh")
        return os.environ["QMOE_LLAMA_PREFIX"]
    missing = [t for t in ("pkg-config", "patch", "cmake", "c++") if shutil.which(t) is None]
    if missing:
        pytest.skip("cannot build llama.cpp here: %s not installed" % ", ".join(missing))
    if torch_python() is None:
        pytest.skip("no torch environment (QMOE_TORCH_VENV, /var/cache/qmoed/venv-torch) for "
                    "convert_hf_to_gguf.py: run scripts/setup.sh")
    root = tmp_path_factory.mktemp("qmoe-install")
    r = subprocess.run(["cmake", "-P", os.path.join(BUILD, "clients", "cmake_install.cmake")],
                       env=dict(os.environ, DESTDIR=str(root)), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    prefix = cache("CMAKE_INSTALL_PREFIX")
    pc = os.path.join(str(root), prefix.lstrip("/"), cache("CMAKE_INSTALL_LIBDIR"), "pkgconfig")
    out = tmp_path_factory.mktemp("llama")
    t0 = time.time()
    r = subprocess.run(["bash", os.path.join(SRC, "clients", "llama.cpp", "build.sh"), str(out)],
                       env=dict(os.environ, PKG_CONFIG_PATH=pc), capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT)
    if r.returncode == 3:
        pytest.skip("cannot build llama.cpp here: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    print("build.sh: %.0f s: %s" % (time.time() - t0, r.stdout.strip().splitlines()[-1]))
    return out


def tool(tools, name):
    return os.path.join(str(tools), "bin", name)


def make_ggufs(tools, out):
    share = os.path.join(str(tools), "share", "qmoed-llama.cpp")
    r = subprocess.run([torch_python(), os.path.join(HERE, "make_ggufs.py"), "--share", share,
                        "--quantize", tool(tools, "llama-quantize"), "--out", str(out)] + FAMILIES,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return out


@pytest.fixture(scope="module")
def ggufs(tools, tmp_path_factory):
    return make_ggufs(tools, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def daemon(tools, ggufs, tmp_path_factory):
    """qmoed serving an int8 bank (Q8_0) and an exact int4 bank (Q4_0) per family,
    and GPT-OSS's MXFP4 as an e2m1 code-book bank, each under the GGUF's base name."""
    d = tmp_path_factory.mktemp("banks")
    models = {}
    for fam, q in CASES:
        name = "%s.%s" % (fam, q)
        bank = str(d / (name + ".bank"))
        r = subprocess.run([qmoe_bank_path(), "import", "gguf", str(ggufs / (name + ".gguf")),
                            "--out", bank], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "exact repack -> " + IMPORTED[q] in r.stdout, r.stdout
        models[name] = bank
    dm = Daemon(models=models, args=["--threads", "2"])
    yield dm
    assert dm.stop() == 0, dm.log_text()[-3000:]


def env_with_tools():
    """qmoe-bank on PATH (--qmoed-bank imports with it)."""
    return dict(os.environ, PATH=os.path.dirname(qmoe_bank_path()) + os.pathsep + os.environ["PATH"])


def run(cmd, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_with_tools(),
                          stdin=subprocess.DEVNULL)


# The runs are deterministic (same binaries, inputs and thread counts), so a
# run several tests need is made once.
_runs = {}


def logits(tools, gguf, out_dir, args=(), prompt=PROMPT):
    """The next-token logits after `prompt` (llama-debug --save-logits), f32 [vocab]."""
    key = ("logits", str(gguf), tuple(args), prompt)
    if key not in _runs:
        os.makedirs(str(out_dir), exist_ok=True)
        r = run([tool(tools, "llama-debug"), "-m", str(gguf), "-p", prompt, "--save-logits",
                 "--logits-output-dir", str(out_dir), "-t", "2", "-c", "64"] + list(args))
        assert r.returncode == 0, r.stderr[-4000:]
        stem = os.path.basename(str(gguf))[:-len(".gguf")]
        _runs[key] = np.fromfile(os.path.join(str(out_dir), "llamacpp-%s.bin" % stem), dtype=np.float32)
    return _runs[key]


def generate(tools, gguf, args=(), n=TOKENS, ctx=64, timeout=120, memo=True):
    """Greedy continuation of PROMPT (llama-completion --temp 0); with this
    vocabulary each token is one character, so the text is the token ids."""
    key = ("generate", str(gguf), tuple(args), n, ctx)
    if memo and key in _runs:
        return _runs[key]
    r = run([tool(tools, "llama-completion"), "-m", str(gguf), "-p", PROMPT, "-n", str(n),
             "--temp", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup",
             "-t", "2", "-c", str(ctx), "--simple-io", "-lv", "4"] + list(args), timeout=timeout)
    if memo and r.returncode == 0:
        _runs[key] = r
    return r


def text_of(r):
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.endswith("\n\n"), repr(r.stdout)
    return r.stdout[:-2]


def qmoed_args(daemon, *extra):
    return ["--qmoed", daemon.socket] + list(extra)


def gguf_of(ggufs, fam, q, suffix=""):
    return ggufs / ("%s.%s%s.gguf" % (fam, q, suffix))


def within_bound(a, b, c):
    """(|C - B| <= EPS max|B|, |C - A| <= |B - A| + EPS max|B| everywhere, the figures)."""
    scale = float(np.abs(b).max())
    d_cb, d_ab, d_ca = (float(np.abs(x - y).max()) for x, y in ((c, b), (a, b), (c, a)))
    return (d_cb <= EPS * scale, bool(np.all(np.abs(c - a) <= np.abs(b - a) + EPS * scale)),
            "max|logit| %.4g; |qmoed - llama.cpp f32 experts| %.3g; |llama.cpp - f32 experts| %.3g "
            "(%.2g of max); |qmoed - llama.cpp| %.3g" % (scale, d_cb, d_ab, d_ab / scale, d_ca))


@pytest.mark.parametrize("fam,q", CASES)
def test_first_step_logits_within_activation_quantisation(tools, ggufs, daemon, fam, q, tmp_path):
    a = logits(tools, gguf_of(ggufs, fam, q), tmp_path / "a")
    b = logits(tools, gguf_of(ggufs, fam, q, "-f32exps"), tmp_path / "b")
    c = logits(tools, gguf_of(ggufs, fam, q), tmp_path / "c", qmoed_args(daemon))
    same_math, within, figures = within_bound(a, b, c)
    print("%s %s: %s" % (fam, q, figures))
    assert same_math and within, figures
    assert not np.array_equal(a, b), "llama.cpp quantised no activation: the reference measures nothing"


@pytest.mark.parametrize("fam,q", CASES)
def test_greedy_tokens(tools, ggufs, daemon, fam, q, tmp_path):
    """qmoed's 16 tokens are llama.cpp's on the same weights in f32; against
    llama.cpp alone they part only where its own activation error decides
    (at the first step that differs, the logits there are within the bound)."""
    ref = text_of(generate(tools, gguf_of(ggufs, fam, q, "-f32exps")))
    alone = text_of(generate(tools, gguf_of(ggufs, fam, q)))
    r = generate(tools, gguf_of(ggufs, fam, q), qmoed_args(daemon))
    got = text_of(r)
    assert "qmoed: session" in r.stderr and "layer calls" in r.stderr, r.stderr[-3000:]
    # One call ring per context carried every layer call.
    assert "layer calls through its call ring" in r.stderr, r.stderr[-3000:]
    assert "layer calls (call ring)" in r.stderr, r.stderr[-3000:]
    assert len(ref) == TOKENS and got == ref, (got, ref)
    s = next((i for i in range(TOKENS) if got[i] != alone[i]), None)
    print("%s %s: qmoed %r, llama.cpp %r (%s)" % (fam, q, got, alone,
                                                  "the same" if s is None else "first differs at %d" % s))
    if s is not None:
        prefix = PROMPT + got[:s]
        a = logits(tools, gguf_of(ggufs, fam, q), tmp_path / "a", prompt=prefix)
        b = logits(tools, gguf_of(ggufs, fam, q, "-f32exps"), tmp_path / "b", prompt=prefix)
        c = logits(tools, gguf_of(ggufs, fam, q), tmp_path / "c", qmoed_args(daemon), prompt=prefix)
        same_math, within, figures = within_bound(a, b, c)
        margin = float(a.max() - a[int(c.argmax())])
        print("  at step %d: llama.cpp's pick leads qmoed's by %.3g in its own logits; %s" % (s, margin, figures))
        assert same_math and within, figures


@pytest.mark.parametrize("fam,q", CASES)
def test_paging_changes_no_bit(tools, ggufs, daemon, fam, q, tmp_path):
    gguf = gguf_of(ggufs, fam, q)
    lru = ("--qmoed-policy", "lru", "--qmoed-budget", "30%")
    whole = logits(tools, gguf, tmp_path / "whole", qmoed_args(daemon))
    paged = logits(tools, gguf, tmp_path / "lru", qmoed_args(daemon, *lru))
    assert whole.tobytes() == paged.tobytes()
    r = generate(tools, gguf, qmoed_args(daemon, *lru))
    assert text_of(r) == text_of(generate(tools, gguf, qmoed_args(daemon)))
    m = re.search(r"expert hits (\d+), misses (\d+)", r.stderr)
    assert m and int(m.group(2)) > 0, "a 30%% budget paged nothing: %s" % r.stderr[-2000:]


def test_budget_auto_and_a_bad_budget(tools, ggufs, daemon):
    """--qmoed-budget auto: the daemon sizes it (the log says how) and the
    tokens are the whole bank's; a share goes to the daemon as given; a
    budget that is none of bytes, NN% or auto is refused at load, the
    daemon's rule for a bad share at the session."""
    fam, q = FAMILIES[0], TYPES[0]
    gguf = gguf_of(ggufs, fam, q)
    r = generate(tools, gguf, qmoed_args(daemon, "--qmoed-policy", "lru", "--qmoed-budget", "auto"))
    assert text_of(r) == text_of(generate(tools, gguf, qmoed_args(daemon)))
    assert re.search(r"qmoed: session \S+ of '\S+': policy lru, budget \d+ of \d+ expert bytes "
                     r"\(budget auto: .* = ", r.stderr), r.stderr[-3000:]
    # Auto counts what is in use when the session is made: the weights are
    # read in before it unless a load mode was asked for.
    read_in = "qmoed: --qmoed-budget auto: the weights are read in (load mode none)"
    assert read_in in r.stderr, r.stderr[-3000:]
    mapped = generate(tools, gguf, qmoed_args(daemon, "--qmoed-policy", "lru", "--qmoed-budget", "auto",
                                              "--load-mode", "mmap"))
    assert text_of(mapped) == text_of(r) and read_in not in mapped.stderr
    # What the context takes after its session is made goes to the daemon
    # as pending, which counts toward the reserve: its compute buffers, and
    # the weights it maps and has not read yet.
    pending = re.compile(r"the auto budget was told what this context takes next: compute buffers "
                         r"([\d.]+) MiB, mapped weights ([\d.]+) MiB")
    skipped = re.search(r"their expert tensors \(([\d.]+) MiB\) are not loaded", r.stderr)
    assert skipped, r.stderr[-3000:]
    rest_mib = os.path.getsize(gguf) / 1048576.0 - float(skipped.group(1))  # and the GGUF's header
    for run, is_mapped in ((r, False), (mapped, True)):
        m = pending.search(run.stderr)
        assert m and float(m.group(1)) > 0, run.stderr[-3000:]
        mapped_mib = float(m.group(2))
        # (the log's MiB are rounded to 0.01 and 0.1)
        assert (0 < mapped_mib <= rest_mib + 0.06) if is_mapped else mapped_mib == 0, \
            (mapped_mib, rest_mib, run.stderr[-3000:])
        assert "the client's pending " in run.stderr, run.stderr[-3000:]
    assert read_in not in generate(tools, gguf, qmoed_args(daemon)).stderr
    r = generate(tools, gguf, qmoed_args(daemon, "--qmoed-policy", "lru", "--qmoed-budget", "12.5%"))
    m = re.search(r"budget (\d+) of (\d+) expert bytes", r.stderr)
    assert m and int(m.group(1)) == int(m.group(2)) // 8, r.stderr[-3000:]
    r = generate(tools, gguf, qmoed_args(daemon, "--qmoed-budget", "8X"), memo=False)
    assert r.returncode != 0 and "--qmoed-budget '8X'" in r.stderr and "or auto" in r.stderr, r.stderr[-2000:]
    r = generate(tools, gguf, qmoed_args(daemon, "--qmoed-budget", "150%"), memo=False)
    assert r.returncode != 0 and '"N%" with 0 < N <= 100' in r.stderr, r.stderr[-2000:]


def test_a_daemon_that_refuses_a_ring_serves_the_same_tokens_through_the_socket(tools, ggufs,
                                                                                daemon, tmp_path):
    """A daemon at max_rings 0 refuses every session.ring: the context says
    so and its layer calls take the socket, with the same tokens."""
    fam, q = FAMILIES[0], TYPES[0]
    name = "%s.%s" % (fam, q)
    bank = str(tmp_path / (name + ".bank"))
    r = subprocess.run([qmoe_bank_path(), "import", "gguf", str(gguf_of(ggufs, fam, q)),
                        "--out", bank], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    dm = Daemon(models={name: bank}, args=["--threads", "2", "--set", "max_rings=0"])
    try:
        r = generate(tools, gguf_of(ggufs, fam, q), qmoed_args(dm), memo=False)
        assert "no call ring (resource_exhausted" in r.stderr, r.stderr[-3000:]
        assert "layer calls (socket)" in r.stderr, r.stderr[-3000:]
        assert text_of(r) == text_of(generate(tools, gguf_of(ggufs, fam, q), qmoed_args(daemon)))
    finally:
        assert dm.stop() == 0, dm.log_text()[-3000:]


def test_a_bank_of_another_model_is_refused(tools, ggufs, daemon, tmp_path):
    """The same shapes from another GGUF, another quantisation of the same
    model, another layer map, another expert count: each refused at load with
    the mismatch named, nothing generated, nothing left loaded."""
    synthetic = str(tmp_path / "four.bank")
    subprocess.run([qmoe_bank_path(), "create", "--out", synthetic, "--layers", "2", "--experts", "4",
                    "--hidden", "64", "--inter", "32", "--k", "2", "--bits", "8", "--block-size", "32",
                    "--activation", "swiglu", "--quiet"], check=True)
    daemon.client().call("model.load", {"name": "four", "path": synthetic})
    gguf = gguf_of(ggufs, "qwen3_moe", "q8_0")
    for other, why in (("mixtral.q8_0", "bank 'mixtral.q8_0' (%s) was not imported from this GGUF: its "
                                        "qmoe.source names 'mixtral.q8_0.gguf', not 'qwen3_moe.q8_0.gguf'"
                        % daemon_path(daemon, "mixtral.q8_0")),
                       ("qwen3_moe.q4_0", "its qmoe.source names 'qwen3_moe.q4_0.gguf'"),
                       ("deepseek_v2.q8_0", "serves blocks [1,2] (its layer map); the GGUF's MoE blocks are [0,1]"),
                       ("four", "has 4 experts per layer; the GGUF's blocks have 8")):
        r = generate(tools, gguf, qmoed_args(daemon, "--qmoed-model", other), n=2, memo=False)
        assert r.returncode != 0 and why in r.stderr, (other, r.stderr[-3000:])
        assert "error loading model: qmoed: bank '%s'" % other in r.stderr
        assert r.stdout == ""
    daemon.client().call("model.unload", {"name": "four"})
    assert not [x for x in daemon.client().call("session.list")["sessions"]]


def daemon_path(daemon, name):
    return next(m["path"] for m in daemon.client().call("model.list")["models"] if m["name"] == name)


def test_a_missing_bank_is_imported_and_loaded(tools, ggufs, tmp_path):
    gguf = gguf_of(ggufs, "mixtral", "q4_0")
    bank = tmp_path / "mixtral.bank"
    dm = Daemon(args=["--threads", "2"])
    try:
        r = generate(tools, gguf, qmoed_args(dm, "--qmoed-bank", str(bank)), memo=False)
        assert text_of(r) == text_of(generate(tools, gguf_of(ggufs, "mixtral", "q4_0", "-f32exps")))
        assert bank.exists()
        listed = dm.client().call("model.list")["models"]
        assert [(m["name"], m["path"]) for m in listed] == [("mixtral.q4_0", os.path.realpath(str(bank)))]
    finally:
        assert dm.stop() == 0, dm.log_text()[-3000:]


def completion_cmd(tools, gguf, n, *extra):
    return [tool(tools, "llama-completion"), "-m", str(gguf), "-p", PROMPT, "-n", str(n), "--temp", "0",
            "--ignore-eos", "-no-cnv", "--no-display-prompt", "--no-warmup", "-t", "2", "-c", "4096",
            "--simple-io"] + list(extra)


def test_the_daemon_gone_for_good_fails_the_step_and_emits_no_token_from_it(tools, ggufs, tmp_path):
    """The daemon killed mid-generation and never restarted: once the
    reconnection window (1 s here) has passed, the layer call fails the
    whole step with the line naming the daemon, llama-completion exits 1,
    and every token it printed is one of the undisturbed run's, in order:
    nothing computed on a failed step (whose later ops only wrote zeros)
    reached the output."""
    name = "gpt_oss.q8_0"
    gguf = gguf_of(ggufs, "gpt_oss", "q8_0")
    bank = tmp_path / (name + ".bank")
    subprocess.run([qmoe_bank_path(), "import", "gguf", str(gguf), "--out", str(bank), "--quiet"],
                   check=True)
    dm = Daemon(models={name: str(bank)}, args=["--threads", "2"])
    p = subprocess.Popen(completion_cmd(tools, gguf, 4000, *qmoed_args(dm)), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, QMOED_RECONNECT_S="1"))
    try:
        c = dm.client()
        deadline = time.time() + 60
        while time.time() < deadline:  # generation under way: the daemon has answered layer calls
            if c.call("telemetry.get")["daemon"]["requests"] >= 40:
                break
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.02)
        p.send_signal(signal.SIGSTOP)  # no token between the check and the kill
        assert p.poll() is None
        dm.proc.kill()
        dm.proc.wait()
        t0 = time.time()
        p.send_signal(signal.SIGCONT)
        out, err = p.communicate(timeout=60)  # bounded: a hang fails here
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1 and 0 < len(out) < 4000, (p.returncode, len(out), err[-3000:])
    assert "qmoed: the daemon at %s went away during block" % dm.socket in err, err[-3000:]
    assert "giving up on session" in err, err[-3000:]
    assert took < 15, took
    assert "Segmentation" not in err
    # The reference: the same run undisturbed, as far as this one got.
    ref = Daemon(models={name: str(bank)}, args=["--threads", "2"])
    try:
        r = run(completion_cmd(tools, gguf, len(out) + 1, *qmoed_args(ref)))
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        assert ref.stop() == 0
    assert r.stdout.startswith(out), (out[-80:], r.stdout[len(out) - 80:len(out) + 2])


def test_llama_completion_survives_random_sigkills(tools, ggufs, tmp_path):
    """qmoed under a supervisor that restarts it as systemd would, through
    the socket unit's inherited fd (tests/hardening/restart.py), serving a
    paged session; SIGKILLed (the last run: SIGTERM, a graceful restart) at
    a random token-layer of each run. The
    restarted daemon has no model: the context's client loads the bank
    --qmoed-bank names, re-creates the session under its id, warm, passes
    its map again and retries the layer call; every run ends with the
    undisturbed run's tokens."""
    sys.path.insert(0, os.path.join(SRC, "tests", "hardening"))
    from restart import Killer, Supervisor
    gguf = gguf_of(ggufs, "gpt_oss", "q8_0")
    bank = str(tmp_path / "gpt_oss.q8_0.bank")
    args = ["--qmoed-bank", bank, "--qmoed-policy", "lru", "--qmoed-budget", "50%"]
    sup = Supervisor(str(tmp_path / "calm"), args=["--threads", "2"])
    try:
        calm = run(completion_cmd(tools, gguf, 48, "--qmoed", sup.socket, *args))
        assert calm.returncode == 0, calm.stderr[-3000:]
        total = sup.client().call("telemetry.get")["daemon"]["tokens"]
    finally:
        assert sup.stop() == 0, sup.log_text()[-3000:]
    assert len(calm.stdout) > 40
    for i in range(3):
        sup = Supervisor(str(tmp_path / ("run%d" % i)), args=["--threads", "2"])
        # A run decodes in tens of ms on a fast CPU: kill in its first half,
        # polling the daemon's count every ms, so the engine is still
        # running when the daemon goes. The third run's daemon is stopped
        # as `systemctl restart` stops it: SIGTERM, whose drain answers the
        # engine's next layer call shutting_down.
        killer = Killer(sup, span=(total // 4, total // 2), seed=40 + i, poll=0.001,
                        graceful=i == 2)
        try:
            p = subprocess.Popen(completion_cmd(tools, gguf, 48, "--qmoed", sup.socket, *args),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env_with_tools())
            killer.start()
            out, err = p.communicate(timeout=120)
            killer.finish()
        finally:
            killer.finish()
            sup.stop()
        assert killer.error is None and len(killer.points) == 1, (killer.error, killer.points)
        assert p.returncode == 0, err[-3000:]
        assert out == calm.stdout, (out, calm.stdout)
        assert "is back after" in err and "its model loaded again from its bank" in err, err[-3000:]


def test_llama_server_slots_share_the_context_session(tools, ggufs, daemon, tmp_path):
    import http.client
    import socket as sk
    s = sk.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = subprocess.Popen([tool(tools, "llama-server"), "-m", str(gguf_of(ggufs, "qwen3_moe", "q8_0")),
                               "--host", "127.0.0.1", "--port", str(port), "-np", "2", "-c", "128", "-t", "2",
                               "--no-webui"] + qmoed_args(daemon),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=open(str(tmp_path / "server.log"), "w"))
    try:
        deadline = time.time() + 60
        while True:
            try:
                h = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                h.request("GET", "/health")
                if h.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, \
                (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.1)
        c = daemon.client()
        mine = [x for x in c.call("session.list")["sessions"] if x["model"] == "qwen3_moe.q8_0"]
        assert len(mine) == 1, mine
        results = []

        def complete(prompt):
            h = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            h.request("POST", "/completion", json.dumps({"prompt": prompt, "n_predict": 8, "temperature": 0}),
                      {"Content-Type": "application/json"})
            resp = h.getresponse()
            results.append((resp.status, json.loads(resp.read())))
        import threading
        ts = [threading.Thread(target=complete, args=(p,)) for p in (PROMPT, "a lazy dog")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert [st for st, _ in results] == [200, 200], results
        assert all(len(j["content"]) == 8 for _, j in results), results
        after = [x for x in c.call("session.list")["sessions"] if x["model"] == "qwen3_moe.q8_0"]
        assert [x["session"] for x in after] == [x["session"] for x in mine]
    finally:
        server.terminate()
        server.wait(timeout=30)
    gone = [x for x in daemon.client().call("session.list")["sessions"] if x["model"] == "qwen3_moe.q8_0"]
    assert gone == [], "the server's session outlived it"


def test_llama_bench_takes_the_options(tools, ggufs, daemon):
    r = run([tool(tools, "llama-bench"), "-m", str(gguf_of(ggufs, "qwen3_moe", "q4_0")), "-p", "8", "-n", "4",
             "-r", "1", "-t", "2", "-o", "jsonl"] + qmoed_args(daemon, "--qmoed-policy", "lru",
                                                               "--qmoed-budget", "50%"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert len(rows) == 2 and all(x["avg_ts"] > 0 for x in rows), r.stdout
