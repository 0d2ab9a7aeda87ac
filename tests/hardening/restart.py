"""qmoed under a supervisor that restarts it as systemd does, and a killer
that SIGKILLs it at random moments of an engine's run: what the restart
tests (tests/hardening/test_restart.py, tests/llama/test_llama_cpp.py) and
bench/restart/run.py share.

With socket activation (the default, as systemd/qmoed.socket + qmoed.service
run it) the supervisor binds the listening socket once and keeps it across
restarts; each daemon gets it as fd 3 with LISTEN_FDS=1 and LISTEN_PID set
to its own pid (daemon/qm_notify.c). Connections made while no daemon runs
wait in the socket's backlog for the next one. Without it each daemon binds
the path itself (a killed one leaves a stale file that the next removes), so
clients see ECONNREFUSED until it is back.
"""
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))

import qmoed_harness as harness  # noqa: E402


class Supervisor(harness.Daemon):
    """Starts qmoed, SIGKILLs and restarts it. `models` ({name: bank}) are
    given to every daemon it starts (the config's models, loaded at start);
    `activation` hands each daemon the supervisor's socket. client(),
    log_text() and stop() are the harness's (stop: SIGTERM, a clean
    drain; the exit status), stop() also closes the supervisor's socket."""

    def __init__(self, workdir, models=None, args=(), activation=True, env=None):
        self.dir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.socket = os.path.join(workdir, "qmoed.sock")
        self.models = dict(models or {})
        self.args = list(args)
        self.activation = activation
        self.env = dict(os.environ, **(env or {}))
        self.log_path = os.path.join(workdir, "qmoed.log")
        self.log = open(self.log_path, "ab")
        self.proc = None
        self.starts = 0
        self.listener = None
        if activation:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.socket)
            os.chmod(self.socket, 0o660)
            self.listener.listen(511)
        self.start()

    def command(self):
        cmd = [harness.qmoed_path(), "--socket", self.socket, "--log-level", "info",
               "--state-dir", os.path.join(self.dir, "state")] + harness.root_args()
        for name, path in self.models.items():
            cmd += ["--model", "%s=%s" % (name, path)]
        return cmd + self.args

    def start(self, wait=True):
        self.starts += 1
        if self.activation:
            fd = self.listener.fileno()
            # The pid systemd would name is the daemon's: the shell's own, kept by exec.
            dup = "3<&%d" % fd + ("" if fd == 3 else " %d<&-" % fd)
            cmd = ["bash", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=qmoed.socket '
                               'exec "$0" "$@" ' + dup] + self.command()
            self.proc = subprocess.Popen(cmd, pass_fds=(fd,), stdout=self.log,
                                         stderr=subprocess.STDOUT, env=self.env)
        else:
            self.proc = subprocess.Popen(self.command(), stdout=self.log,
                                         stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=30):
        """Until the daemon answers daemon.status (with activation the
        socket accepts before it runs)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("qmoed exited with %s:\n%s" % (self.proc.returncode,
                                                                  self.log_text()[-3000:]))
            try:
                c = harness.Client(self.socket)
                c.sock.settimeout(max(0.1, deadline - time.time()))
                c.call("daemon.status")
                c.close()
                return
            except (OSError, EOFError, AssertionError):
                time.sleep(0.01)
        raise RuntimeError("qmoed did not answer within %s s:\n%s" % (timeout,
                                                                       self.log_text()[-3000:]))

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def restart(self, delay=0.0, wait=False, graceful=False):
        """SIGKILL (or, `graceful`, SIGTERM and its drain to the end, as
        `systemctl restart` does), then a new daemon after `delay` seconds
        (RestartSec)."""
        if graceful and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            rc = self.proc.wait(60)
            if rc != 0:
                raise RuntimeError("qmoed's drain exited %s:\n%s" % (rc, self.log_text()[-3000:]))
        self.kill()
        if delay:
            time.sleep(delay)
        self.start(wait=wait)

    def stop(self, timeout=15):
        rc = super().stop(timeout) if self.proc is not None else None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.socket)
            except FileNotFoundError:
                pass
        return rc


def daemon_tokens(sup):
    """The tokens the running daemon has computed (telemetry: every layer
    call's rows), or None when it cannot be asked right now."""
    try:
        c = sup.client()
        c.sock.settimeout(2)
        n = c.call("telemetry.get")["daemon"]["tokens"]
        c.close()
        return n
    except (OSError, EOFError, AssertionError, KeyError):
        return None


class Killer(threading.Thread):
    """While an engine runs: once the daemon has computed `at` token-layers
    (its telemetry, read every `poll` s), SIGKILL it and start the next one
    after `delay` s; `kills` times, each at a new random count within
    `span` (from what the restarted daemon counts afresh). Records when
    each kill happened."""

    def __init__(self, sup, span, kills=1, delay=0.0, seed=None, poll=0.005, graceful=False):
        super().__init__(daemon=True)
        self.sup, self.span, self.kills, self.delay, self.poll = sup, span, kills, delay, poll
        self.graceful = graceful  # SIGTERM and its drain (systemctl restart), not SIGKILL
        self.rng = random.Random(seed)
        self.points, self.times = [], []
        self.stop_flag = threading.Event()
        self.error = None

    def run(self):
        try:
            for _ in range(self.kills):
                at = self.rng.randint(max(1, self.span[0]), max(1, self.span[1]))
                while not self.stop_flag.is_set():
                    n = daemon_tokens(self.sup)
                    if n is not None and n >= at:
                        break
                    time.sleep(self.poll)
                if self.stop_flag.is_set():
                    return
                self.points.append(at)
                self.times.append(time.monotonic())
                self.sup.restart(self.delay, graceful=self.graceful)
        except Exception as e:  # reported by the test
            self.error = e

    def finish(self):
        self.stop_flag.set()
        self.join(30)
