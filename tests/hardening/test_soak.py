"""A soak of the daemon: several clients at once do, in a random order,
what engines and operators do — sessions of every offered policy and of
budgets in bytes, percents and "auto", exact and fast, now and then with
the session's options (a miss run on the host or either way, prefetch or
the profile's warm start off, shared residency, a routing trace of its
own, banks kept whole, pins, a warm list), the policy's knobs, or the id
of a session it closed (re-created; a live one's id is refused); layer calls over the
socket and over the call ring (mapped tensors), with the bank's router and
with router logits given; one session every client calls at once;
resizes, plans, telemetry and listings; calls that are wrong (a bad layer,
a bad width); garbage lines; sessions closed, connections dropped with
sessions open, and client processes killed in the middle of their calls;
an operator unloading a model under its sessions and loading it again,
sending memory pressure events (auto budgets shrink, and grow back after a
quiet second) and SIGHUP, reading the metrics and the trace; the daemon
keeps a state dir (hotness profiles, routing traces; the preadv backend
with record_routing on) — for
QMOE_SOAK_S seconds (default 10) on each of four backends: the CPU, with
the banks paged from the disk where the filesystem takes O_DIRECT (through
io_uring, and through its fallback, a pool of preadv threads); one
emulated device; two, the models placed across them, copies at 20 MB/s
and one worker.

What must hold: every answer to a valid call equals, bit for bit, the
whole-bank answer computed before the soak (paging, sharing and resizing
never change an output bit); every wrong call fails with -32602 naming its
field, and the session it named still serves; a garbage line gets a parse
error and its connection still serves; a bystander connected throughout
sees nothing. Afterwards the daemon is alive, every orphaned session is
reclaimed, so is every map the workers left in the shared session, every routing trace recorded reads whole, the unloaded model's
profile was saved, the device memory in use is what it was before the soak, the
descriptors are exactly those, no thread more, RSS within 48 MiB of
where it started, and it exits 0 (under the sanitizers: with no report). QMOE_SOAK_SEED replays a run (the
seed is printed).
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from hardening import HERE, RSS_SLACK_KB, SLOW, Baseline, Bystander, Daemon, make_bank
from qmoed_harness import Client as RawClient, offered_policies

PYCLIENT = os.path.join(HERE, "..", "..", "clients", "python")
sys.path.insert(0, PYCLIENT)
from qmoe_client import Client, QmoeError  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import qmoe_trace  # noqa: E402

SOAK_S = float(os.environ.get("QMOE_SOAK_S", "10"))
WORKERS = 3
LAYERS, EXPERTS, HID, K = 4, 16, 64, 2
MODELS = {"q4": dict(bits=4, block=32, seed=11), "q8": dict(bits=8, block=0, seed=12)}
TOKENS = (1, 2, 5, 8)
ORPHAN_S = 1
UNLOADED = "q8"  # the model the operator unloads (force) and loads again
# The config file the daemon starts with; the operator rewrites it before
# each SIGHUP (Soak.reconfigure).
CONFIG = {"session_orphan_timeout_s": ORPHAN_S, "auto_budget_check_ms": 100,
          "auto_budget_grow_after_s": 1, "auto_budget_shrink_percent": 20,
          "auto_budget_grace_ms": 0}


def disk_dir():
    """A new directory on a filesystem that takes O_DIRECT (the banks are
    then paged from the disk through the io engine), else in the temp dir
    (paged from the mapping, as the daemon logs). The caller removes it."""
    for d in (os.environ.get("QMOE_TEST_DISK_DIR"), "/var/tmp"):
        if not d or not os.path.isdir(d):
            continue
        try:
            path = tempfile.mkdtemp(dir=d, prefix="qmoed-soak-")
        except OSError:
            continue
        probe = os.path.join(path, "probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 8192)
            os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
            os.unlink(probe)
            return path
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix="qmoed-soak-")


def inputs_of(seed):
    """Per model, the inputs of the calls: (layer, hidden [T, H] f32 or f16,
    routing): the bank's router, router logits [T, E], or the engine's own
    top-k (ids [T, k] int32, -1 for no route, and f32 weights)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(24):
        t = TOKENS[i % len(TOKENS)]
        x = rng.standard_normal((t, HID)).astype(np.float16 if i % 4 == 3 else np.float32)
        route = {}
        if i % 3 == 0:
            route["router_logits"] = rng.standard_normal((t, EXPERTS)).astype(np.float32)
        elif i % 3 == 1:
            ids = np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(t)]).astype(np.int32)
            ids[0, -1] = -1
            route["topk_ids"] = ids
            route["topk_weights"] = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
        out.append((i % LAYERS, x, route))
    return out


DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.int32): "i32"}


def raw(dm):
    """A raw-socket client whose reads wait as long as the daemon's slowness
    (QMOE_HARDENING_SLOW under valgrind or a sanitizer) needs."""
    c = RawClient(dm.socket)
    c.sock.settimeout(30 * SLOW)
    return c


def daemon_fds_threads(pid):
    return len(os.listdir("/proc/%d/fd" % pid)), len(os.listdir("/proc/%d/task" % pid))


def daemon_fd_names(pid):
    out = []
    for fd in sorted(os.listdir("/proc/%d/fd" % pid), key=int):
        try:
            out.append("%s %s" % (fd, os.readlink("/proc/%d/fd/%s" % (pid, fd))))
        except OSError:
            pass
    return out


class Soak:
    def __init__(self, dm, banks, seed, devices=1):
        self.dm, self.seed, self.devices = dm, seed, devices
        self.traces = 0  # record_trace files asked for
        self.inputs = {m: inputs_of(seed + j) for j, m in enumerate(MODELS)}
        c = Client(dm.socket, reconnect=0, timeout=30 * SLOW)
        self.bpe = {m["name"]: m["bytes_per_expert"] for m in c.models()}
        # The reference: whole_bank sessions, every input, both precisions.
        self.ref = {}
        for m in MODELS:
            for prec in ("exact", "fast"):
                sid = c.create_session(m, policy="whole_bank", precision=prec)["session"]
                for i, (layer, x, route) in enumerate(self.inputs[m]):
                    self.ref[m, prec, i] = c.infer(sid, layer, x, **route).output.tobytes()
                c.close_session(sid)
        self.shared_client, self.shared = c, None
        self.policies = offered_policies()
        self.errors = []
        self.counts = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def open_shared(self):
        """One session every worker calls too, over its own connection and
        ring, and none closes (the soak does, at its end)."""
        self.shared = self.shared_client.create_session("q4", policy="next_use", budget="50%",
                                                        precision="fast")["session"]

    def count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, msg):
        with self.lock:
            self.errors.append(msg)
        self.stop.set()

    def budget(self, rng, model):
        b = rng.choice(["bytes", "bytes", "pct", "auto", None])
        if b == "bytes":
            return rng.randint(1, 3 * LAYERS * K) * self.bpe[model]
        if b == "pct":
            return "%d%%" % rng.choice((10, 25, 50, 100))
        return b

    # ---- one worker: its own connection, its own sessions ----
    def worker(self, w):
        rng = random.Random(self.seed * 100 + w)
        me = {"c": Client(self.dm.socket, reconnect=0, timeout=30 * SLOW), "sessions": self.own(),
              "closed": []}
        try:
            while not self.stop.is_set():
                try:
                    self.step(me, rng)
                except QmoeError as e:
                    if e.code != -32001:
                        raise
                    self.gone(me, e)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            self.fail("worker %d: %r" % (w, e))
        finally:
            me["c"].close()

    def own(self):
        """A worker's sessions: sid -> [model, precision, its map here or
        None, shared]; the shared one from the start."""
        return {self.shared: ["q4", "fast", None, True]}

    def step(self, me, rng):
        c, sessions = me["c"], me["sessions"]
        mine = [sid for sid, v in sessions.items() if not v[3]]
        r = rng.random()
        if not mine or (r < 0.03 and len(mine) < 3):
            self.create(c, rng, sessions, me["closed"])
        elif r < 0.50:
            self.call(c, rng, sessions, ring=False)
        elif r < 0.80:
            self.call(c, rng, sessions, ring=True)
        elif r < 0.86:
            self.resize(c, rng, sessions)
        elif r < 0.91:
            self.look(c, rng, sessions)
        elif r < 0.96:
            self.wrong(c, rng, sessions)
        elif r < 0.965:
            self.unmap(c, rng, sessions)
        elif r < 0.975:
            sid = rng.choice(mine)
            c.close_session(sid)
            sessions.pop(sid)
            me["closed"].append(sid)
            self.count("close")
        elif r < 0.98:
            c.close()  # its sessions are left to the orphan reclaim
            me["c"], me["sessions"] = Client(self.dm.socket, reconnect=0, timeout=30 * SLOW), self.own()
            self.count("drop")
        else:
            self.garbage(rng)

    def gone(self, me, e):
        """not_found: only sessions of the model the operator unloads (with
        force, which closes them) may have gone."""
        sessions = me["sessions"]
        live = {s["session"] for s in me["c"].sessions()}
        lost = [sid for sid in sessions if sid not in live]
        if not lost or any(sessions[sid][0] != UNLOADED for sid in lost):
            raise AssertionError("not_found (%s) with sessions %s lost (%s)" % (
                e, lost, [sessions[sid][0] for sid in lost]))
        for sid in lost:
            sessions.pop(sid)
        self.count("session closed by unload")

    def policy_params(self, rng, policy):
        """Now and then the session-level options and the policy's knobs:
        what a miss does (paged in, run on the host, or either), prefetch
        and the profile's warm start on or off, shared residency, a trace
        of its own routing in the state dir, banks kept whole below a unit
        size, pins given. None of them may change an output bit."""
        pp = {}
        if policy == "whole_bank" or rng.random() < 0.4:
            return pp
        if rng.random() < 0.4:
            pp["on_miss"] = rng.choice(("page", "host", "auto"))
        if rng.random() < 0.3:
            pp["prefetch"] = rng.random() < 0.5
        if rng.random() < 0.3:
            pp["warm_from_profile"] = rng.random() < 0.5
        if policy in ("lfu", "next_use") and rng.random() < 0.3:
            pp["decay"] = rng.choice((0.9, 0.99, 0.999))
        if policy == "next_use" and rng.random() < 0.3:
            pp["prior_weight"] = rng.choice((0, 5, 50))
        if policy == "static_hot" and rng.random() < 0.3:
            pp["pin_fraction"] = rng.choice((0.0, 0.5, 1.0))
        r = rng.random()
        if r < 0.35:
            pp["share_residency"] = True
        elif r < 0.5:
            with self.lock:
                self.traces += 1
                pp["record_trace"] = "soak-%d.qmtr" % self.traces
        elif r < 0.6:
            pp["min_split_bytes"] = rng.choice((0, 1 << 20))
        elif r < 0.7 and policy == "static_hot":
            pp["hot"] = [{"layer": l, "experts": rng.sample(range(EXPERTS), rng.randint(1, 4))}
                         for l in rng.sample(range(LAYERS), rng.randint(1, LAYERS))]
        return pp

    def create(self, c, rng, sessions, closed):
        model = rng.choice(list(MODELS))
        prec = rng.choice(("exact", "fast"))
        policy = rng.choice(self.policies)
        budget = None if policy == "whole_bank" else self.budget(rng, model)
        p = {"model": model, "policy": policy, "precision": prec}
        if budget is not None:
            p["budget"] = budget
        pp = self.policy_params(rng, policy)
        if pp:
            p["policy_params"] = pp
        if rng.random() < 0.2:  # a re-created session's old residency
            p["warm"] = [{"layer": l, "experts": rng.sample(range(EXPERTS), rng.randint(1, EXPERTS))}
                         for l in rng.sample(range(LAYERS), rng.randint(1, LAYERS))]
        if closed and rng.random() < 0.3:  # an id this client closed, re-created
            p["session"] = closed.pop(rng.randrange(len(closed)))
        try:
            r = c.call("session.create", p)
        except QmoeError as e:
            # A budget below one expert unit, or more than this machine has;
            # max_sessions while dropped connections' sessions await reclaim.
            if e.code == -32001 and model == UNLOADED:
                self.count("create of an unloaded model")
                return
            if "max_sessions" in e.reason:
                self.count("create refused: max_sessions")
                time.sleep(0.05)  # as a client would, before trying again
                return
            # Shared residency only on a daemon with one cpu or emu device.
            if (e.code == -32602 and e.field == "policy_params.share_residency"
                    and self.devices > 1):
                self.count("create refused: share_residency on several devices")
                return
            if e.field not in ("budget_bytes", "budget"):
                raise AssertionError("session.create %s: %s (code %s, field %s)" % (
                    p, e, e.code, e.field))
            self.count("create refused: budget")
            return
        sid = r["session"]
        if "session" in p and sid != p["session"]:
            self.fail("session re-created as %s took the id %s" % (p["session"], sid))
        if "warm" in p and "warmed" not in r:
            self.fail("session.create with warm answered no warmed: %s" % r)
        sessions[sid] = [model, prec, None, False]
        self.count("create (re-created)" if "session" in p else "create")
        for k in sorted(pp) + (["warm"] if "warm" in p else []):
            self.count("create with " + k)

    def call(self, c, rng, sessions, ring):
        sid = rng.choice(list(sessions))
        model, prec, shm, shared = sessions[sid]
        i = rng.randrange(len(self.inputs[model]))
        layer, x, route = self.inputs[model][i]
        if ring:
            if shm is None:
                shm = sessions[sid][2] = c.map(sid, 1 << 16)
            shm.reset()

            def mapped(a):
                t = shm.alloc(a.shape, DTYPE[a.dtype])
                t.array[:] = a
                return t
            out = shm.alloc(x.shape, DTYPE[x.dtype])
            got = c.infer(sid, layer, mapped(x), output_to=out,
                          **{k: mapped(v) for k, v in route.items()}).output
            got = np.array(got, copy=True)
            if not c.ring_active(sid):
                self.fail("session %s: a call with every tensor mapped did not take the ring" % sid)
        else:
            got = c.infer(sid, layer, x, **route).output
        if got.tobytes() != self.ref[model, prec, i]:
            self.fail("session %s (%s, %s) input %d layer %d over the %s: output differs from "
                      "whole_bank's" % (sid, model, prec, i, layer, "ring" if ring else "socket"))
        self.count(("ring call" if ring else "socket call") + (" (shared)" if shared else ""))

    def unmap(self, c, rng, sessions):
        """A map the ring calls used, unmapped; the next ring call maps anew."""
        held = [sid for sid, v in sessions.items() if v[2] is not None]
        if held:
            sid = rng.choice(held)
            c.unmap(sessions[sid][2])
            sessions[sid][2] = None
            self.count("unmap")

    def resize(self, c, rng, sessions):
        sid = rng.choice(list(sessions))
        b = self.budget(rng, sessions[sid][0])
        if b is None:
            b = self.bpe[sessions[sid][0]] * LAYERS * K
        try:
            if isinstance(b, int):
                c.resize_session(sid, budget_bytes=b)
            else:
                c.resize_session(sid, budget=b)
            self.count("resize")
        except QmoeError as e:
            # a budget below what the session's plan needs (a whole_bank
            # session's whole model, else one unit) is refused, naming it
            if e.code not in (-32602, -32003) or e.field not in ("budget_bytes", "budget"):
                raise
            self.count("resize refused")

    def look(self, c, rng, sessions):
        sid = rng.choice(list(sessions))
        what = rng.choice(("plan", "telemetry", "sessions", "status"))
        r = {"plan": lambda: c.plan(sid), "telemetry": lambda: c.telemetry(sid),
             "sessions": c.sessions, "status": c.status}[what]()
        assert isinstance(r, (dict, list)), (what, r)
        self.count(what)

    def wrong(self, c, rng, sessions):
        sid = rng.choice(list(sessions))
        model = sessions[sid][0]
        x = np.zeros((1, HID), np.float32)
        case = rng.choice(("layer", "hidden.shape", "session"))
        try:
            if case == "session":  # re-creating a session the daemon has
                c.call("session.create", {"model": "q4", "session": self.shared})
            elif case == "layer":
                c.infer(sid, LAYERS + rng.randrange(5), x)
            else:
                c.infer(sid, 0, np.zeros((1, HID + 1), np.float32))
        except QmoeError as e:
            if e.code == -32001:
                raise  # its session went with an unload: step's caller sees
            if e.code != (-32008 if case == "session" else -32602) or e.field != case:
                self.fail("wrong %s on %s: %r (code %s, field %s)" % (case, sid, e, e.code, e.field))
            self.count("wrong call")
        else:
            self.fail("wrong %s on %s (%s) was served" % (case, sid, model))

    def garbage(self, rng):
        rc = raw(self.dm)
        try:
            junk = rng.choice((b'{"jsonrpc":"2.0","id":1,"method":"session.infer","params":{',
                               b"\x00\xff\xfe not json at all", b"[1,2,3"))
            rc.send_raw(junk + b"\n")
            r = rc.read()
            assert r.get("error", {}).get("code") == -32700, r
            assert rc.call("daemon.status")["version"], "connection after garbage"
            self.count("garbage")
        finally:
            rc.close()

    def reconfigure(self, rng, conf):
        """SIGHUP after the config file was rewritten (atomically): the
        reloadable limits moved within what the soak's clients meet, or,
        one time in five, a file that does not load (the daemon keeps its
        configuration whole and serves on)."""
        cfg = dict(CONFIG)
        bad = rng.random() < 0.2
        if bad:
            cfg[rng.choice(("max_sessions", "frames_per_wakeup", "no_such_key"))] = 0
        else:
            cfg.update(frames_per_wakeup=rng.randint(1, 32), max_batch=rng.randint(8, 128),
                       session_orphan_timeout_s=rng.choice((1, 2)),
                       auto_budget_shrink_percent=rng.randint(10, 40),
                       auto_budget_check_ms=rng.choice((50, 100, 200)),
                       auto_budget_grace_ms=rng.choice((0, 100)),
                       # never below the soak's length: the shared session's
                       # creator idles throughout, and its connection is in the
                       # baseline the end compares against
                       idle_timeout_s=rng.choice((0, max(300, int(2 * SOAK_S)))),
                       frame_timeout_s=rng.choice((0, 30)),
                       max_sessions=rng.choice((48, 64)), queue_depth=rng.choice((256, 1024)),
                       max_connections=rng.choice((128, 256)),
                       max_output_bytes=rng.choice((16 << 20, 64 << 20)))
        with open(conf + ".new", "w") as f:
            json.dump(cfg, f)
        os.replace(conf + ".new", conf)
        self.dm.proc.send_signal(signal.SIGHUP)
        self.count("operator: sighup" + (" (bad file)" if bad else ""))

    # ---- an operator unloading a model under its sessions, loading it again ----
    def operator(self, path, fifo, conf):
        """Now and then: the 8-bit model unloaded with force under its
        sessions and loaded again; a memory pressure event (auto budgets
        shrink, and grow back after a quiet second); SIGHUP with the config
        file rewritten (reconfigure); the metrics and the trace read."""
        rng = random.Random(self.seed * 100 + 98)
        rc = raw(self.dm)
        try:
            while not self.stop.wait(rng.uniform(0.2, 0.8)):
                what = rng.choice(("reload model", "pressure", "pressure", "sighup", "read"))
                if what == "reload model":
                    r = rc.request("model.unload", {"name": UNLOADED, "force": True})
                    assert "result" in r, r
                    time.sleep(rng.uniform(0.0, 0.3))
                    r = rc.request("model.load", {"name": UNLOADED, "path": path})
                    assert "result" in r, r
                elif what == "pressure":
                    with open(fifo, "w") as f:
                        f.write("pressure\n")
                elif what == "sighup":
                    self.reconfigure(rng, conf)
                    continue
                else:
                    assert "qmoed_" in rc.call("telemetry.metrics")["text"]
                    assert isinstance(rc.call("telemetry.trace", {"limit": 50})["spans"], list)
                self.count("operator: " + what)
        except Exception as e:  # noqa: BLE001
            self.fail("operator: %r" % (e,))
        finally:
            rc.close()

    # ---- processes killed in the middle of their calls ----
    def killer(self):
        rng = random.Random(self.seed * 100 + 99)
        code = textwrap.dedent("""
            import sys, numpy as np
            sys.path.insert(0, %r)
            from qmoe_client import Client, QmoeError
            c = Client(%r, reconnect=0, timeout=%d)
            try:
                sid = c.create_session(sys.argv[1], policy="lru", budget=int(sys.argv[2]))["session"]
                shm = c.map(sid, 1 << 16)
            except QmoeError as e:
                print("refused %%d %%s" %% (e.code, e), flush=True)
                sys.exit(3)
            x = np.ones((8, %d), np.float32)
            print("ready", flush=True)
            i = 0
            while True:
                if i %% 2:
                    c.infer(sid, i %% %d, x)
                else:
                    shm.reset()
                    h = shm.alloc(x.shape, "f32"); h.array[:] = x
                    c.infer(sid, i %% %d, h, output_to=shm.alloc(x.shape, "f32"))
                i += 1
        """) % (PYCLIENT, self.dm.socket, 30 * SLOW, HID, LAYERS, LAYERS)
        while not self.stop.is_set():
            model = rng.choice(list(MODELS))
            p = subprocess.Popen([sys.executable, "-c", code, model, str(2 * self.bpe[model])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = p.stdout.readline().strip()
            if line != "ready":
                p.kill()
                err = p.stderr.read()
                p.wait()
                # max_sessions while dropped sessions await reclaim; the
                # operator's model out, or unloaded under the new session
                if line.startswith("refused -32003") or (
                        line.startswith("refused -32001") and model == UNLOADED):
                    self.count("killed client refused")
                    time.sleep(0.2)
                    continue
                self.fail("killed client did not start: %s %s" % (line, err[-2000:]))
                return
            time.sleep(rng.uniform(0.05, 0.4))
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.count("client killed")


def wait_for(what, fn, timeout=30 * SLOW):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v:
            return v
        assert time.time() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def used_bytes(c):
    return [d["used_bytes"] for d in c.call("daemon.status")["devices"]]


# The CPU backend (units read from the disk into host memory: through
# io_uring where the kernel gives it, and through the pool of preadv
# threads, its fallback), one emulated device (not host visible: every unit
# copied into its arena) and two (the models' layers placed across them),
# these with copies at 20 MB/s and one worker, so that jobs wait behind
# copies and each other.
BACKENDS = {"cpu": [], "cpu-threads": ["--set", "io_engine=threads", "--set", "record_routing=true"],
            "emu": ["--backend", "emu"],
            "two-emu": ["--device", "emu:0,emu:1", "--set", "emu_copy_mbps=20", "--workers", "1"]}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_soak_many_clients_at_once_bitwise_and_nothing_left_behind(backend, capsys):
    seed = int(os.environ.get("QMOE_SOAK_SEED", str(int(time.time()) % 100000)))
    d, dm, rc = disk_dir(), None, None
    try:
        banks = {m: make_bank(os.path.join(d, "%s.bank" % m), layers=LAYERS, experts=EXPERTS,
                              hidden=HID, k=K, bits=o["bits"], block=o["block"], seed=o["seed"])
                 for m, o in MODELS.items()}
        fifo = os.path.join(d, "pressure")  # the operator's memory pressure events
        os.mkfifo(fifo)
        state = os.path.join(d, "state")  # hotness profiles, routing traces
        os.mkdir(state)
        conf = os.path.join(d, "qmoed.conf")
        with open(conf, "w") as f:
            json.dump(CONFIG, f)
        dm = Daemon(models=banks, env={"QMOED_TEST_PRESSURE": fifo},
                    args=["--config", conf, "--log-level", "info", "--state-dir", state]
                    + BACKENDS[backend])
        soak = Soak(dm, banks, seed, devices=2 if backend == "two-emu" else 1)
        bystander = Bystander(dm, model="q4")
        watch = raw(dm)
        # RSS may end up to 48 MiB over (or the hardening slack, when
        # larger): the preadv pool's threads and the rings' keep their
        # caches; a session's freed memory left in the heaps (B15) was 85 MB.
        base = Baseline(dm, rss_slack_kb=max(RSS_SLACK_KB, 48 << 10))
        used0 = used_bytes(watch)
        threads0 = daemon_fds_threads(dm.proc.pid)[1]
        names0 = daemon_fd_names(dm.proc.pid)
        soak.open_shared()
        threads = [threading.Thread(target=soak.worker, args=(w,)) for w in range(WORKERS)]
        threads.append(threading.Thread(target=soak.killer))
        threads.append(threading.Thread(target=soak.operator, args=(banks[UNLOADED], fifo, conf)))
        for t in threads:
            t.start()
        soak.stop.wait(SOAK_S)
        soak.stop.set()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a soak thread is stuck (seed %d)" % seed
        with capsys.disabled():
            print("\nsoak %s, seed %d, %.0f s: %s" % (backend, seed, SOAK_S,
                                                      dict(sorted(soak.counts.items()))))
        assert not soak.errors, "seed %d: %s\n%s" % (seed, soak.errors, dm.log_text()[-4000:])
        if os.environ.get("QMOE_SOAK_LOG"):
            with capsys.disabled():
                print("\n".join(l for l in dm.log_text().splitlines()
                                if re.search(r"warn|error|fail", l, re.I))[-6000:])
        assert dm.proc.poll() is None, dm.log_text()[-4000:]
        assert soak.counts.get("socket call", 0) > 0 and soak.counts.get("ring call", 0) > 0
        paged = re.findall(r"pages from disk: O_DIRECT reads of \S+ through (\S+),", dm.log_text())
        if backend == "cpu-threads" and paged:
            assert set(paged) == {"threads"}, set(paged)
        # The workers' connections are closed and their creator never
        # mapped: the maps they left in the shared session are reclaimed
        # (they used to stay until the session closed: B26).
        wait_for(lambda: "maps left in the shared session: %s" % watch.call("session.list"),
                 lambda: [s["maps"] for s in watch.call("session.list")["sessions"]
                          if s["session"] == soak.shared] == [0])
        soak.shared_client.close_session(soak.shared)  # its connection stays: in the baseline
        # Every session but the bystander's is gone (closed or reclaimed),
        # its memory with it.
        wait_for(lambda: "sessions left: %s" % watch.call("session.list"),
                 lambda: [s["session"] for s in watch.call("session.list")["sessions"]]
                 == [bystander.sid])
        # The bystander's, the shared session's creator's and this one.
        wait_for("connections left", lambda: watch.call("daemon.status")["connections"] == 3)
        assert used_bytes(watch) == used0
        # No thread more than before the soak (the rings' threads reaped) and,
        # Baseline's check, the descriptors exactly as before (the rings'
        # regions and the maps unmapped and closed), RSS within the slack,
        # the bystander untouched.
        wait_for(lambda: "threads: before %d, now %d; descriptors before %s, now %s" % (
            threads0, daemon_fds_threads(dm.proc.pid)[1], names0, daemon_fd_names(dm.proc.pid)),
            lambda: daemon_fds_threads(dm.proc.pid)[1] <= threads0)
        base.check(bystander, settle=10.0 * SLOW)
        # Every routing trace the sessions recorded (their own files, and
        # record_routing's) reads whole, its sessions closed or reclaimed.
        traces = [f for f in os.listdir(state) if f.endswith(".qmtr")]
        for f in traces:
            tr = qmoe_trace.read_trace(os.path.join(state, f))
            assert (tr.layers, tr.experts, tr.k) == (LAYERS, EXPERTS, K), (f, tr.layers, tr.experts)
            assert all(-1 <= e < EXPERTS for e in tr.ids), f
        # The unloaded model's hotness profile was saved at its unload (and
        # read back at its load: the load would have failed on a bad file).
        if soak.counts.get("operator: reload model"):
            assert os.path.isfile(os.path.join(state, UNLOADED + ".hot")), os.listdir(state)
        with capsys.disabled():
            print("soak: RSS %d KiB before, %d KiB after; %d descriptors, %d threads; "
                  "%d routing traces" % (base.rss, dm.rss_kb(), base.fds, threads0, len(traces)))
        watch.close()
        bystander.c.close()
        soak.shared_client.close()
    finally:
        if dm is not None:
            rc = dm.stop()
        shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, dm.log_text()[-4000:]
