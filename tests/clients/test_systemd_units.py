"""systemd integration: the units verify, sysusers/tmpfiles snippets apply to a
scratch root, the example config starts qmoed, and qmoed speaks the notify,
watchdog and socket-activation protocols at the right moments."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import BUILD, QMOECTL, QMOED, SOURCE, need

SYSTEMD = os.path.join(SOURCE, "systemd")

# qmoed refuses to run as root unless told to (CI runs as root).
ROOT_ARGS = ["--allow-root"] if os.geteuid() == 0 else []


def configured_service(dest, exec_path):
    """qmoed.service as CMake configures it, with ExecStart pointing at `exec_path`."""
    with open(os.path.join(SYSTEMD, "qmoed.service.in")) as f:
        text = f.read()
    text = text.replace("@CMAKE_INSTALL_FULL_SBINDIR@/qmoed", exec_path)
    text = text.replace("@CMAKE_INSTALL_FULL_SYSCONFDIR@", "/etc")
    assert "@CMAKE" not in text, "unsubstituted variable in qmoed.service.in"
    path = os.path.join(dest, "qmoed.service")
    with open(path, "w") as f:
        f.write(text)
    shutil.copy(os.path.join(SYSTEMD, "qmoed.socket"), dest)
    return path


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    service = configured_service(str(tmp_path), need(QMOED))
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", service, str(tmp_path / "qmoed.socket")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.strip() == "", p.stderr


def test_installed_service_is_configured_by_cmake():
    built = os.path.join(BUILD, "clients", "systemd", "qmoed.service")
    with open(built) as f:
        text = f.read()
    assert "@CMAKE" not in text
    for line in ("Type=notify", "NotifyAccess=main", "ExecReload=/bin/kill -HUP $MAINPID",
                 "User=qmoed", "RuntimeDirectory=qmoed", "StateDirectory=qmoed", "DevicePolicy=closed",
                 "DeviceAllow=char-nvidia-uvm rw", "PrivateDevices=no", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "RestrictAddressFamilies=AF_UNIX",
                 "LimitMEMLOCK=infinity"):
        assert line in text.splitlines(), line
    assert any(l.startswith("WatchdogSec=") for l in text.splitlines())
    with open(os.path.join(SYSTEMD, "qmoed.socket")) as f:
        sock = f.read().splitlines()
    for line in ("ListenStream=/run/qmoed/qmoed.sock", "SocketMode=0660", "SocketGroup=qmoe"):
        assert line in sock, line


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers/systemd-tmpfiles are not installed")
def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for f in ("passwd", "group", "shadow", "gshadow"):
        (root / "etc" / f).write_text("")
    p = subprocess.run(["systemd-sysusers", "--root", str(root), os.path.join(SYSTEMD, "qmoed.sysusers.conf")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    groups = [l.split(":")[0] for l in (root / "etc" / "group").read_text().splitlines()]
    assert {"qmoed", "qmoe", "qmoe-admin"} <= set(groups)
    assert (root / "etc" / "passwd").read_text().startswith("qmoed:")
    p = subprocess.run(["systemd-tmpfiles", "--root", str(root), "--create",
                        os.path.join(SYSTEMD, "qmoed.tmpfiles.conf")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    st = os.stat(root / "var" / "lib" / "qmoed")
    assert oct(st.st_mode & 0o777) == "0o750"


def test_example_config_is_accepted_by_qmoed(workdir):
    d = tempfile.mkdtemp(dir=workdir)
    sock = os.path.join(d, "qmoed.sock")
    with open(os.path.join(SYSTEMD, "qmoed.json")) as f:
        cfg = json.load(f)
    assert cfg["admin_group"] == "qmoe-admin"
    # The flags override the machine-specific keys; everything else is the shipped file.
    proc = subprocess.Popen([need(QMOED), "--config", os.path.join(SYSTEMD, "qmoed.json"), "--socket", sock,
                             "--state-dir", os.path.join(d, "state"), "--backend", "cpu",
                             "--admin-group", "root"] + ROOT_ARGS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_socket(sock, proc)
        out = subprocess.run([need(QMOECTL), "--socket", sock, "--json", "status"], capture_output=True,
                             text=True, check=True)
        assert json.loads(out.stdout)["backend"] == "cpu"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read().decode()


def wait_for_socket(path, proc, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "qmoed exited early: %s" % (proc.stdout.read().decode() if proc.stdout else "")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("qmoed did not listen on %s" % path)


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, directory):
        self.path = os.path.join(directory, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages = []  # (monotonic time, {key: value})

    def collect(self, until, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                break
            kv = dict(line.split("=", 1) for line in data.split("\n") if "=" in line)
            self.messages.append((time.monotonic(), kv))
            if until(kv):
                return kv
        return None

    def close(self):
        self.sock.close()


def test_notify_ready_status_watchdog_and_stopping(workdir, bank):
    d = tempfile.mkdtemp(dir=workdir)
    sock = os.path.join(d, "qmoed.sock")
    n = NotifyListener(d)
    env = dict(os.environ, NOTIFY_SOCKET=n.path, WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen([need(QMOED), "--socket", sock, "--backend", "cpu", "--model", "demo=" + bank,
                             "--state-dir", os.path.join(d, "state")] + ROOT_ARGS, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = n.collect(lambda kv: kv.get("READY") == "1", 20)
        assert ready is not None, "no READY=1 within 20 s: %r" % n.messages
        # READY comes once the socket listens and the preloaded model is open.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(sock)
        status = subprocess.run([need(QMOECTL), "--socket", sock, "--json", "models"], capture_output=True,
                                text=True, check=True)
        assert [m["name"] for m in json.loads(status.stdout)["models"]] == ["demo"]
        assert any("STATUS" in kv for _, kv in n.messages), "no STATUS= line: %r" % n.messages
        t0 = time.monotonic()
        n.collect(lambda kv: False, 1.3)
        pings = [t for t, kv in n.messages if kv.get("WATCHDOG") == "1" and t >= t0]
        # Half of WATCHDOG_USEC (0.2 s) is the usual interval; accept 0.4 s at most.
        assert len(pings) >= 3, "watchdog pings in 1.3 s: %d" % len(pings)
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) <= 0.45, gaps
        proc.send_signal(signal.SIGTERM)
        stopping = n.collect(lambda kv: kv.get("STOPPING") == "1", 15)
        assert stopping is not None, "no STOPPING=1 after SIGTERM: %r" % n.messages[-5:]
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        n.close()


def test_socket_activation_serves_on_the_passed_socket(workdir, bank):
    d = tempfile.mkdtemp(dir=workdir)
    path = os.path.join(d, "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    fd = listener.fileno()
    # The shell learns its own pid ($$) for LISTEN_PID, moves the socket to fd 3, then becomes qmoed.
    script = 'export LISTEN_PID=$$ LISTEN_FDS=1; exec 3<&%d %d<&-; exec "$@"' % (fd, fd)
    proc = subprocess.Popen(["bash", "-c", script, "bash", need(QMOED), "--backend", "cpu",
                             "--socket", os.path.join(d, "unused.sock"),
                             "--state-dir", os.path.join(d, "state")] + ROOT_ARGS,
                            pass_fds=(fd,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    listener.close()  # the daemon holds its own copy now
    try:
        out = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            p = subprocess.run([need(QMOECTL), "--socket", path, "--timeout", "5", "--json", "status"],
                               capture_output=True, text=True)
            if p.returncode == 0:
                out = json.loads(p.stdout)
                break
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        assert out is not None and out["backend"] == "cpu"
        assert not os.path.exists(os.path.join(d, "unused.sock")), "qmoed bound --socket despite LISTEN_FDS"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        # The passed socket belongs to systemd: qmoed must not unlink it.
        assert os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
