"""What the tests/daemon/test_qmoed_*.py suites share beyond the harness: the
bank's shape, request helpers, `qmoe-bank run` as the reference, and running
a client as another uid. The fixtures (banks, daemon) are in conftest.py.
"""
import json
import mmap
import os
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

from qmoed_harness import Daemon, memfd, qmoe_bank_path

H, E, K = 64, 8, 2  # the "small" bank of conftest.banks


def hidden(T, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, H)).astype(dtype)


def err(resp):
    assert "error" in resp, resp
    return resp["error"]


def new_session(c, **params):
    p = {"model": "small"}
    p.update(params)
    return c.call("session.create", p)["session"]


def telemetry_after_vanished(c, sid, timeout=60):
    """The session's telemetry once a client that pipelined inferences on it
    and went away is done with: first c's connection is the daemon's only one
    (the other is closed, so none of its bytes is read any more), then
    telemetry.get, which waits behind the session's queue (PROTOCOL.md), so
    every inference the other client got queued has run or been skipped."""
    deadline = time.time() + timeout
    while True:
        n = c.call("daemon.status")["connections"]
        if n == 1:
            break
        assert time.time() < deadline, "%d connections after %d s" % (n, timeout)
        time.sleep(0.05)
    return c.call("telemetry.get", {"session": sid})


def run_qmoe_bank(bank, layer, x, logits=None, precision=None):
    d = tempfile.mkdtemp(prefix="qmoed-run-")
    np.save(os.path.join(d, "x.npy"), x)
    cmd = [qmoe_bank_path(), "run", bank, "--layer", str(layer), "--hidden",
           os.path.join(d, "x.npy"), "--out", os.path.join(d, "y.npy")]
    if precision:
        cmd += ["--precision", precision]
    if logits is not None:
        np.save(os.path.join(d, "r.npy"), logits)
        cmd += ["--logits", os.path.join(d, "r.npy")]
    subprocess.run(cmd, check=True)
    return np.load(os.path.join(d, "y.npy"))


def run_as(uid, fn):
    """Runs fn() in a child that dropped to `uid`; returns what it printed as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
            os.write(w, json.dumps(out).encode())
        except BaseException as e:  # report anything to the parent
            os.write(w, json.dumps({"exception": repr(e)}).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def load_trace_tool():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "qmoe_trace.py")
    spec = importlib.util.spec_from_file_location("qmoe_trace", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def daemon_open_to_all(banks):
    """A daemon serving `small` whose socket any uid may reach, for tests that
    drop a client to another uid (run_as); skipped unless running as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to fork a client that drops to another uid")
    dm = Daemon(models={"small": banks["small"]})
    os.chmod(dm.dir, 0o755)
    os.chmod(dm.socket, 0o666)
    return dm


# ---- shared-memory maps (session.map), for the shm and ring suites ----

def request_fds(c, method, params, fds):
    """One request whose first byte carries `fds` (SCM_RIGHTS); the answer."""
    req = {"jsonrpc": "2.0", "id": c.next_id, "method": method, "params": params}
    c.next_id += 1
    line = (json.dumps(req) + "\n").encode()
    sent = socket.send_fds(c.sock, [line], fds) if fds else 0
    c.sock.sendall(line[sent:])
    return json.loads(c.read_line())


def map_fd(c, sid, fd, nbytes):
    return request_fds(c, "session.map", {"session": sid, "bytes": nbytes}, [fd])


class Shm:
    """A memfd mapped here and in the daemon (map id `id`)."""

    def __init__(self, c, sid, nbytes):
        fd = memfd(nbytes)
        self.mm = mmap.mmap(fd, nbytes)
        r = map_fd(c, sid, fd, nbytes)
        os.close(fd)
        assert "result" in r, r
        assert r["result"]["bytes"] == nbytes
        self.id = r["result"]["map"]

    def put(self, offset, raw):
        self.mm[offset:offset + len(raw)] = raw

    def get(self, offset, n):
        return bytes(self.mm[offset:offset + n])


def as_bytes(x, dtype):
    if dtype == "bf16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    return x.astype({"f32": "<f4", "f16": "<f2"}[dtype]).tobytes()
