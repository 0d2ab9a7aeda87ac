"""Peer-credential security against a real qmoed (issue 8, item 4).

As root, clients are forked that drop to uid 65534 (nobody) and to uid
65533; the socket stays mode 0660 and is given to group 65534 so both can
open it. The authorization matrix is PROTOCOL.md's roles: admin (root, or a
member of --admin-group), owner, other user x every method.
"""
import json
import os
import re
import select
import signal
import socket
import stat
import time

import numpy as np
import pytest

from hardening import H, SLOW, Daemon, make_bank, req, tensor

USER_A, USER_B, GROUP = 65534, 65533, 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to fork clients that drop to other uids")


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    d = tmp_path_factory.mktemp("h8sec")
    os.chmod(str(d), 0o755)
    path = make_bank(str(d / "small.bank"))
    os.chmod(path, 0o644)
    return path


def open_to_group(dm):
    """The socket file stays 0660; the dropped uids reach it through its group."""
    os.chmod(dm.dir, 0o755)
    mode = stat.S_IMODE(os.stat(dm.socket).st_mode)
    assert mode == 0o660, "socket mode is %o, PROTOCOL.md says 0660" % mode
    assert os.stat(dm.socket).st_uid == os.geteuid()
    os.chown(dm.socket, -1, GROUP)


def run_as(uid, gid, fn, timeout=30):
    """fn() in a child that dropped to uid/gid; what it returned (JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = {"exception": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    deadline = time.time() + timeout * SLOW
    while True:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.time()))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            raise AssertionError("client as uid %d did not finish" % uid)
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "exception" not in out, out
    return out


class Raw:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(20 * SLOW)
        self.s.connect(path)
        self.f = self.s.makefile("rb")

    def __call__(self, method, params=None):
        self.s.sendall(req(method, params))
        return json.loads(self.f.readline())


# Built before any fork: a child that dropped to nobody may not be able to
# import modules lazily from a root-only Python install.
_X = tensor(np.random.default_rng(1).standard_normal((1, H)).astype(np.float32))


def x():
    return _X


def code(r):
    return r["error"]["code"] if "error" in r else 0


@needs_root
def test_authorization_matrix_for_users_and_admins(bank):
    dm = Daemon(models={"small": bank})
    try:
        open_to_group(dm)
        root = Raw(dm.socket)
        root_sid = root("session.create", {"model": "small"})["result"]["session"]

        def as_b():
            c = Raw(dm.socket)
            return {"sid": c("session.create", {"model": "small"})["result"]["session"]}

        b_sid = run_as(USER_B, GROUP, as_b)["sid"]

        def as_a():
            c = Raw(dm.socket)
            out = {}
            own = c("session.create", {"model": "small"})
            out["create"] = own
            sid = own["result"]["session"]
            for name, other in (("root", root_sid), ("b", b_sid)):
                out["plan_" + name] = c("session.plan", {"session": other})
                out["infer_" + name] = c("session.infer", {"session": other, "layer": 0,
                                                           "hidden": x()})
                out["tele_" + name] = c("telemetry.get", {"session": other})
                out["close_" + name] = c("session.close", {"session": other})
            out["plan_own"] = c("session.plan", {"session": sid})
            out["infer_own"] = c("session.infer", {"session": sid, "layer": 1, "hidden": x()})
            out["tele_own"] = c("telemetry.get", {"session": sid})
            out["list"] = c("session.list")
            out["tele_all"] = c("telemetry.get")
            out["metrics"] = c("telemetry.metrics")
            out["status"] = c("daemon.status")
            out["models"] = c("model.list")
            out["load"] = c("model.load", {"name": "x", "path": bank})
            out["unload"] = c("model.unload", {"name": "small", "force": True})
            out["trace"] = c("telemetry.trace")
            out["shutdown"] = c("daemon.shutdown")
            out["close_own"] = c("session.close", {"session": sid})
            out["after"] = c("daemon.status")
            return out

        out = run_as(USER_A, GROUP, as_a)
        for k in ("plan_root", "infer_root", "tele_root", "close_root",
                  "plan_b", "infer_b", "tele_b", "close_b",
                  "load", "unload", "trace", "shutdown"):
            assert code(out[k]) == -32002, (k, out[k])
            reason = out[k]["error"]["data"]["reason"]
            assert root_sid not in reason and b_sid not in reason, (k, reason)
        for k in ("create", "plan_own", "infer_own", "tele_own", "list", "tele_all", "metrics",
                  "status", "models", "close_own", "after"):
            assert code(out[k]) == 0, (k, out[k])
        a_sid = out["create"]["result"]["session"]
        assert [s["session"] for s in out["list"]["result"]["sessions"]] == [a_sid]
        assert [s["session"] for s in out["tele_all"]["result"]["sessions"]] == [a_sid]
        text = out["metrics"]["result"]["text"]
        assert root_sid not in text and b_sid not in text
        # Nothing the user tried took effect: both sessions and the model live.
        listed = {s["session"]: s["owner_uid"] for s in root("session.list")["result"]["sessions"]}
        assert listed == {root_sid: 0, b_sid: USER_B}
        assert [m["name"] for m in root("model.list")["result"]["models"]] == ["small"]
        assert dm.proc.poll() is None
        # An admin may use and close anyone's session.
        assert code(root("session.infer", {"session": b_sid, "layer": 0, "hidden": x()})) == 0
        assert code(root("session.close", {"session": b_sid})) == 0
    finally:
        assert dm.stop() == 0, dm.log_text()[-2000:]


@needs_root
def test_admin_group_members_are_admins(bank):
    import grp
    group = grp.getgrgid(GROUP).gr_name
    dm = Daemon(models={"small": bank}, args=["--admin-group", group])
    try:
        open_to_group(dm)
        root = Raw(dm.socket)
        root_sid = root("session.create", {"model": "small"})["result"]["session"]

        def as_admin():
            c = Raw(dm.socket)
            return {"plan": c("session.plan", {"session": root_sid}),
                    "list": c("session.list"),
                    "trace": c("telemetry.trace", {"limit": 1}),
                    "load": c("model.load", {"name": "again", "path": bank}),
                    "unload": c("model.unload", {"name": "again"})}

        out = run_as(USER_A, GROUP, as_admin)
        assert all(code(v) == 0 for v in out.values()), out
        assert root_sid in [s["session"] for s in out["list"]["result"]["sessions"]]
    finally:
        assert dm.stop() == 0


@needs_root
def test_a_uid_outside_the_socket_group_cannot_connect(bank):
    dm = Daemon(models={"small": bank})
    try:
        open_to_group(dm)

        def as_stranger():
            try:
                Raw(dm.socket)
            except PermissionError:
                return {"refused": True}
            return {"refused": False}

        assert run_as(USER_B, USER_B, as_stranger)["refused"]
    finally:
        assert dm.stop() == 0


def test_session_ids_are_unguessable(bank):
    dm = Daemon(models={"small": bank})
    try:
        c = Raw(dm.socket)
        ids = []
        for _ in range(64):
            sid = c("session.create", {"model": "small"})["result"]["session"]
            ids.append(sid)
            c("session.close", {"session": sid})
        assert all(re.fullmatch(r"[0-9a-f]{32}", s) for s in ids)
        assert len(set(ids)) == len(ids)
        assert len({s[:8] for s in ids}) == len(ids), "ids share prefixes: not random"
        bits = "".join(bin(int(s, 16))[2:].zfill(128) for s in ids)
        ones = bits.count("1") / len(bits)
        assert 0.45 < ones < 0.55, ones
    finally:
        assert dm.stop() == 0


def test_model_load_refuses_non_regular_files_without_blocking(bank):
    """BUGS.md B7 (fixed in cb54dcb): model.load opens the path with a blocking open(2) on the
    loop thread; a FIFO freezes the whole daemon until someone writes to it."""
    dm = Daemon(models={"small": bank})
    fifo = os.path.join(dm.dir, "fifo")
    os.mkfifo(fifo)
    try:
        c = Raw(dm.socket)
        for path in ("/dev/zero", "/dev/null", dm.dir):
            assert code(c("model.load", {"name": "x", "path": path})) == -32005, path
        c.s.settimeout(3 * SLOW)
        other = Raw(dm.socket)
        other.s.settimeout(3 * SLOW)
        c.s.sendall(req("model.load", {"name": "x", "path": fifo}))
        try:
            status_ok = code(other("daemon.status")) == 0
            answer = json.loads(c.f.readline())
        except (socket.timeout, TimeoutError):
            status_ok, answer = False, None
        finally:
            # Unblock a daemon stuck in open(2) so the rest of the suite runs.
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass
        assert status_ok, "daemon.status got no answer while model.load opened a FIFO"
        assert answer and code(answer) == -32005, answer
    finally:
        assert dm.stop() == 0
