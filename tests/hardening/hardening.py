"""Shared pieces of the hardening suites: the daemon under test, the checks
run after every abuse case, and /proc readings.

The daemon is started through tests/daemon/qmoed_harness.py (imported, not
copied). QMOED_BIN, when set, replaces the qmoed binary, so the same suites
run against an ASan/UBSan or valgrind build:

    QMOED_BIN=/tmp/build-asan/daemon/qmoed pytest tests/hardening

QMOED_WRAP (e.g. "valgrind --fair-sched=yes --error-exitcode=99 --leak-check=full") puts a
command in front of qmoed; /proc readings then follow the wrapped process,
which valgrind keeps as the same pid.
"""
import errno
import json
import os
import select
import shlex
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))

import qmoed_harness as harness  # noqa: E402
from qmoed_harness import Client, from_tensor, make_bank, tensor  # noqa: E402,F401

_stock_qmoed_path = harness.qmoed_path


def qmoed_path():
    return os.environ.get("QMOED_BIN") or _stock_qmoed_path()


# The harness builds its command from qmoed_path(); point it at QMOED_BIN.
harness.qmoed_path = qmoed_path

H, E, K = 64, 8, 2

# Under a sanitizer or valgrind everything is slower; timeouts scale.
SLOW = float(os.environ.get("QMOE_HARDENING_SLOW", "1"))
# RSS may exceed the baseline by this much after a case. ASan's quarantine
# (256 MiB) keeps freed memory resident: set e.g. 400 there.
RSS_SLACK_KB = int(float(os.environ.get("QMOE_HARDENING_RSS_SLACK_MB", "24")) * 1024)


class Daemon(harness.Daemon):
    """harness.Daemon plus a config file and an optional wrapper command."""

    def __init__(self, models=None, config=None, args=(), **kw):
        args = list(args)
        wait = kw.pop("wait", True)
        if config is not None:
            workdir = kw.setdefault("workdir", tempfile.mkdtemp(prefix="qmoed-h8-"))
            path = os.path.join(workdir, "qmoed.conf")
            with open(path, "w") as f:
                json.dump(config, f)
            args = ["--config", path] + args
        wrap = os.environ.get("QMOED_WRAP")
        if wrap:
            # Popen runs argv[0]; a shim script puts the wrapper first and
            # execs, so the pid stays the daemon's.
            shim = os.path.join(tempfile.mkdtemp(prefix="qmoed-wrap-"), "qmoed")
            with open(shim, "w") as f:
                f.write("#!/bin/sh\nexec %s %s \"$@\"\n" % (wrap, shlex.quote(qmoed_path())))
            os.chmod(shim, 0o755)
            harness.qmoed_path = lambda: shim
        try:
            super().__init__(models=models, args=args, wait=False, **kw)
        finally:
            harness.qmoed_path = qmoed_path
        if wait:
            self.wait_ready(timeout=30 * SLOW)

    def stop(self, timeout=15):
        # Under valgrind or a sanitizer the drain and the exit's leak check
        # are slower too.
        return super().stop(timeout * SLOW)

    @property
    def pid(self):
        return self.proc.pid

    def fds(self):
        return len(os.listdir("/proc/%d/fd" % self.pid))

    def rss_kb(self):
        with open("/proc/%d/status" % self.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def metrics(self):
        c = self.client()
        try:
            return c.call("telemetry.metrics")["text"]
        finally:
            c.close()

    def limit_hits(self, name):
        for line in self.metrics().splitlines():
            if line.startswith('qmoed_limit_hits_total{limit="%s"}' % name):
                return int(line.split()[-1])
        raise AssertionError("no limit counter " + name)


def wait_for(pred, timeout, step=0.02):
    deadline = time.time() + timeout * SLOW
    while True:
        v = pred()
        if v or time.time() > deadline:
            return v
        time.sleep(step)


def read_until_closed(sock, timeout):
    """Everything the peer sends until EOF/reset; raises on timeout."""
    sock.settimeout(timeout * SLOW)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except (ConnectionResetError, BrokenPipeError):
            return data
        if not chunk:
            return data
        data += chunk


def nothing_pending(sock):
    """True when nothing unsolicited (bytes or EOF) is waiting on the socket."""
    r, _, _ = select.select([sock], [], [], 0)
    return not r


def lines(data):
    """Splits a byte stream into parsed JSON lines (strict UTF-8)."""
    out = []
    for ln in data.split(b"\n"):
        if ln.strip():
            out.append(json.loads(ln.decode("utf-8")))
    return out


class Bystander:
    """A client connected since the start, with its own session, that must
    see nothing it did not ask for and keep working whatever others do."""

    def __init__(self, dm, model="small"):
        self.c = dm.client()
        self.sid = self.c.call("session.create", {"model": model})["session"]
        import numpy as np
        rng = np.random.default_rng(7)
        self.x = tensor(rng.standard_normal((2, H)).astype(np.float32))
        self.expect = self.infer()

    def infer(self):
        return self.c.call("session.infer", {"session": self.sid, "layer": 1,
                                             "hidden": self.x})["output"]

    def check(self):
        assert self.c.buf == b"", "bystander holds unread bytes: %r" % self.c.buf[:200]
        assert nothing_pending(self.c.sock), "bystander received something unsolicited"
        assert self.infer() == self.expect, "bystander's output changed"


class Baseline:
    """fd count and RSS of the daemon with only the bystander connected."""

    def __init__(self, dm, rss_slack_kb=RSS_SLACK_KB):
        self.dm = dm
        self.rss_slack_kb = rss_slack_kb
        # Let the accept of the bystander and any closes settle.
        time.sleep(0.1)
        self.fds = dm.fds()
        self.rss = dm.rss_kb()

    def check(self, bystander=None, settle=5.0):
        """The daemon answers daemon.status, the bystander saw nothing, fds
        return exactly to the baseline, RSS to within the slack."""
        dm = self.dm
        assert dm.proc.poll() is None, "qmoed died:\n" + dm.log_text()[-4000:]
        c = dm.client()
        st = c.call("daemon.status")
        assert st["version"]
        c.close()
        if bystander is not None:
            bystander.check()
        got = wait_for(lambda: dm.fds() == self.fds, settle)
        assert got, "daemon holds %d fds, baseline %d: %s" % (
            dm.fds(), self.fds, sorted(os.listdir("/proc/%d/fd" % dm.pid)))
        rss = dm.rss_kb()
        assert rss <= self.rss + self.rss_slack_kb, \
            "RSS %d KiB, baseline %d KiB (+%d allowed)" % (rss, self.rss, self.rss_slack_kb)
        return st


def connect(path, timeout=30):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout * SLOW)
    s.connect(path)
    return s


def req(method, params=None, id=1):
    r = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        r["params"] = params
    return (json.dumps(r, separators=(",", ":")) + "\n").encode()


def is_closed_error(e):
    return isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)) or \
        (isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.EPIPE))
