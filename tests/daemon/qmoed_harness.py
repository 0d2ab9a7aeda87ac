"""Start a real qmoed on a temp socket and talk to it over raw sockets.

Shared by tests/daemon and bench/ipc. Nothing here is a client library: it
writes JSON lines and reads JSON lines, so the tests see exactly the bytes
on the wire.
"""
import base64
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(os.path.dirname(__file__), "../../build"))


def qmoed_path():
    return os.path.join(BUILD, "daemon", "qmoed")


def root_args():
    """qmoed refuses to run as root unless told to; CI runs as root."""
    return ["--allow-root"] if os.geteuid() == 0 else []


def qmoe_bank_path():
    return os.path.join(BUILD, "tools", "qmoe-bank", "qmoe-bank")


def offered_policies():
    """The policies the daemon offers, the residency registry's order (the
    default first): session.create's `policy` row as `qmoectl --json
    methods` prints it, so a test that means "every policy" walks the
    registry rather than a list of its own."""
    qmoectl = os.path.join(BUILD, "clients", "qmoectl")
    rows = json.loads(subprocess.run([qmoectl, "--json", "methods", "session.create"],
                                     capture_output=True, text=True, check=True).stdout)
    return next(p for p in rows[0]["params"] if p["member"] == "policy")["names"]


def make_bank(path, layers=2, experts=8, hidden=64, inter=32, k=2, bits=4, block=32,
              activation="swiglu", fusion=1, router=True, seed=1, scale_dtype=None,
              codebook=None):
    """`qmoe-bank create` into path (kept when it exists). codebook="e2m1":
    a code book bank (bits 4; docs/BANK_FORMAT.md, qmoe.codebook)."""
    if os.path.exists(path):
        return path
    cmd = [qmoe_bank_path(), "create", "--out", path, "--layers", str(layers),
           "--experts", str(experts), "--hidden", str(hidden), "--inter", str(inter),
           "--k", str(k), "--bits", str(bits), "--block-size", str(block),
           "--activation", activation, "--swiglu-fusion", str(fusion), "--seed", str(seed),
           "--quiet"]
    if router:
        cmd.append("--router")
    if scale_dtype:  # else create's default: f16 scales, f32 biases and router
        cmd += ["--scale-dtype", scale_dtype]
    if codebook:
        cmd += ["--codebook", codebook]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


class Daemon:
    """A qmoed process on a socket in a fresh temp dir."""

    def __init__(self, models=None, args=(), env=None, workdir=None, socket_path=None,
                 wait=True, root_flag=True, binary=None):
        self.dir = workdir or tempfile.mkdtemp(prefix="qmoed-test-")
        self.socket = socket_path or os.path.join(self.dir, "qmoed.sock")
        self.log_path = os.path.join(self.dir, "qmoed.log")
        cmd = [binary or qmoed_path(), "--socket", self.socket, "--log-level", "debug"]
        if root_flag and os.geteuid() == 0 and "--user" not in args:
            cmd.append("--allow-root")  # CI runs as root; say so, as the daemon asks
        for name, path in (models or {}).items():
            cmd += ["--model", "%s=%s" % (name, path)]
        cmd += list(args)
        self.log = open(self.log_path, "ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=full_env)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("qmoed exited with %d:\n%s" % (self.proc.returncode,
                                                                  self.log_text()))
            try:
                c = Client(self.socket)
                c.close()
                return
            except OSError:
                time.sleep(0.01)
        raise RuntimeError("qmoed did not come up:\n" + self.log_text())

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def client(self):
        return Client(self.socket)

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc


class Client:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.buf = b""
        self.next_id = 1

    def close(self):
        self.sock.close()

    def send_raw(self, data):
        self.sock.sendall(data)

    def read_line(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def read(self):
        return json.loads(self.read_line())

    def request(self, method, params=None, id=None, raw=False):
        if id is None:
            id = self.next_id
            self.next_id += 1
        req = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            req["params"] = params
        self.send_raw((json.dumps(req) + "\n").encode())
        line = self.read_line()
        return line if raw else json.loads(line)

    def call(self, method, params=None):
        """The result, or an AssertionError naming the error."""
        r = self.request(method, params)
        assert "result" in r, r
        return r["result"]


def memfd(nbytes, seals=None, name="test-map"):
    """A memfd of nbytes for session.map, sealed with `seals` (default
    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL; 0 for none)."""
    import fcntl
    if seals is None:
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def tensor(array):
    """numpy array -> wire tensor."""
    import numpy as np
    dtype = {np.dtype("float32"): "f32", np.dtype("float16"): "f16",
             np.dtype("int32"): "i32"}[array.dtype]
    a = np.ascontiguousarray(array)
    return {"dtype": dtype, "shape": list(a.shape),
            "data": base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode()}


def from_tensor(t):
    import numpy as np
    dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[t["dtype"]]
    return np.frombuffer(base64.b64decode(t["data"]), dtype=dt).reshape(t["shape"])
