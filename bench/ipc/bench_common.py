"""What bench/ipc's drivers share: their common options, the test harness
(tests/daemon/qmoed_harness.py) run against a build, the two banks they
measure, and a private redis on a Unix socket."""
import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parser(workdir_name, threads=True):
    """--build (required), --workdir (default: TMP/WORKDIR_NAME, where the
    banks are kept between runs) and, with `threads`, qmoed's --threads."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), workdir_name))
    if threads:
        ap.add_argument("--threads", type=int, default=0, help="qmoed --threads (0 = cores)")
    return ap


def harness(build, src=None):
    """The test harness, its daemon and tools taken from BUILD; SRC: the
    source tree whose harness (default: this one)."""
    os.environ["QMOE_BUILD_DIR"] = build
    sys.path.insert(0, os.path.join(src or os.path.join(HERE, "..", ".."), "tests", "daemon"))
    import qmoed_harness
    return qmoed_harness


def gptoss_bank(h, workdir, layers=2):
    """A GPT-OSS-20B-like bank (H = I = 2880, E = 32, k = 4, int4 block 32)."""
    os.makedirs(workdir, exist_ok=True)
    return h.make_bank(os.path.join(workdir, "gptoss20b-like-%dl.bank" % layers), layers=layers,
                       experts=32, hidden=2880, inter=2880, k=4, bits=4, block=32,
                       activation="swiglu", fusion=1, router=True, seed=7)


def tiny_bank(h, workdir):
    """A tiny layer (H = 64, E = 32, k = 4): its compute is a few µs, so a
    call's cost is the protocol path's floor."""
    os.makedirs(workdir, exist_ok=True)
    return h.make_bank(os.path.join(workdir, "tiny-h64.bank"), layers=2, experts=32, hidden=64,
                       inter=32, k=4, bits=4, block=32, activation="swiglu", fusion=1,
                       router=True, seed=7)


def start_redis(run_dir):
    """A private redis-server (no port, no persistence) on RUN_DIR/redis.sock,
    answering when this returns: (process, socket path)."""
    sock = os.path.join(run_dir, "redis.sock")
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not os.path.exists(sock) and time.time() < deadline:
        time.sleep(0.02)
    return proc, sock
