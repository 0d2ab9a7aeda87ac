"""Fixtures for the client tests: the built binaries, a generated bank, and a
real qmoed on a temp socket (CPU backend)."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

SOURCE = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SOURCE, "build"))

QMOED = os.path.join(BUILD, "daemon", "qmoed")
QMOECTL = os.path.join(BUILD, "clients", "qmoectl")
QMOE_BANK = os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")

# A small bank: 2 layers x 8 experts, H=64, I=32, top-2, int4 with blocks of 32, router included.
BANK_ARGS = ["--layers", "2", "--experts", "8", "--hidden", "64", "--inter", "32", "--k", "2",
             "--bits", "4", "--block-size", "32", "--activation", "silu", "--router", "--seed", "7"]
LAYERS, EXPERTS, HIDDEN = 2, 8, 64


def need(path):
    assert os.access(path, os.X_OK), "%s is not built (build the whole tree first)" % path
    return path


@pytest.fixture(scope="session")
def workdir():
    # Not pytest's tmp_path: that lives under a 0700 directory, and the
    # permission tests run a client as another uid that must reach the socket.
    d = tempfile.mkdtemp(prefix="qmoe-clients-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def bank(workdir):
    path = os.path.join(workdir, "demo.qmoe")
    subprocess.run([need(QMOE_BANK), "create", "--out", path, "--quiet"] + BANK_ARGS, check=True,
                   stdout=subprocess.DEVNULL)
    os.chmod(path, 0o644)
    return path


class Daemon:
    def __init__(self, workdir, bank, name, with_model=True, extra=()):
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "qmoed.sock")
        self.bank = bank
        self.log_path = os.path.join(self.dir, "qmoed.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [need(QMOED), "--socket", self.socket, "--backend", "cpu"]
            + (["--model", "demo=" + bank] if with_model else [])
            + (["--allow-root"] if os.geteuid() == 0 else []) + [
             "--state-dir", os.path.join(self.dir, "state"), "--device-budget", "1GiB",
             "--log-level", "info"] + list(extra),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("qmoed exited with %s at start:\n%s" % (self.proc.returncode, self.logs()))
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError("qmoed did not listen on %s within 20 s:\n%s" % (self.socket, self.logs()))

    def logs(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def daemon(workdir, bank, request):
    d = Daemon(workdir, bank, "d-" + request.module.__name__)
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(workdir, bank, request):
    """A daemon of its own, for tests that stop it."""
    d = Daemon(workdir, bank, "f-" + request.node.name[:40])
    yield d
    d.stop()


def run_as_nobody_preexec():
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def torch_python():
    for d in (os.environ.get("QMOE_TORCH_VENV"), "/var/cache/qmoed/venv-torch",
              os.path.expanduser("~/.cache/qmoed/venv-torch")):
        if d and os.path.exists(os.path.join(d, "bin", "python")):
            return os.path.join(d, "bin", "python")
    return None


@pytest.fixture(scope="session")
def torchpy():
    """The torch environment's python (transformers >= 5), or a skip saying
    why there is none."""
    py = torch_python()
    if py is None:
        pytest.skip("no torch environment (QMOE_TORCH_VENV, /var/cache/qmoed/venv-torch): "
                    "run scripts/setup.sh to install torch and transformers")
    r = subprocess.run([py, "-c", "import torch, transformers; print(transformers.__version__)"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("the torch environment at %s cannot import torch/transformers: %s"
                    % (py, r.stderr.strip()[-300:]))
    major = int(r.stdout.strip().split(".")[0])
    assert major >= 5, "transformers %s: the hook needs >= 5" % r.stdout.strip()
    return py
