"""Orphan reclaim over the wire (docs/OPERATIONS.md "Orphaned sessions"):
a session no open connection has used, with nothing of it queued or
running, is closed after session_orphan_timeout_s as session.close would
close it: its maps unmapped, its budget returned, a log line and the
sessions_reclaimed counter. A client that comes back in time keeps it; a
call still running holds it; timeout 0 keeps every session, as before.
A map whose connection (the last to make or name it) closed is unmapped
as long after in a session other connections keep (maps_reclaimed); a
call naming it in time keeps it; an orphaned session's maps go with it,
on its clock.

The daemons here run with a 2 s timeout; each test waits a few seconds.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from qmoed_harness import BUILD, Daemon, make_bank
from qmoed_suite import H, Shm, hidden

HERE = os.path.dirname(os.path.abspath(__file__))
PYCLIENT = os.path.join(HERE, "..", "..", "clients", "python")
TIMEOUT_S = 2


@pytest.fixture(scope="module")
def bank():
    d = tempfile.mkdtemp(prefix="qmoed-reclaim-")
    return make_bank(os.path.join(d, "small.bank"))


@pytest.fixture(scope="module")
def daemon(bank):
    dm = Daemon(models={"small": bank},
                args=["--session-orphan-timeout", str(TIMEOUT_S)])
    yield dm
    assert dm.stop() == 0, dm.log_text()


def listed(c, sid):
    """The session's session.list entry, or None once it is gone."""
    for s in c.call("session.list")["sessions"]:
        if s["session"] == sid:
            return s
    return None


def mapped_regions(pid, name):
    with open("/proc/%d/maps" % pid) as f:
        return sum(1 for line in f if ("memfd:" + name) in line)


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def reclaimed_count(c):
    return c.call("telemetry.get")["daemon"]["sessions_reclaimed"]


def wait_gone(c, sid, within):
    deadline = time.time() + within
    while listed(c, sid) is not None:
        assert time.time() < deadline, "session %s still listed after %g s" % (sid, within)
        time.sleep(0.05)
    return time.time()


# A client that creates a session, maps 1 MiB into it, writes its id and
# dies by SIGKILL: nothing of it closes anything.
KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    import qmoe_client
    cl = qmoe_client.Client(sys.argv[1])
    sid = cl.create_session("small", policy="lru", budget_bytes=int(sys.argv[3]))["session"]
    shm = cl.map(sid, 1 << 20)
    print(sid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_clients_session_map_and_memory_are_reclaimed(daemon):
    c = daemon.client()  # session.list, daemon.status and telemetry.get name no session
    pid = daemon.proc.pid
    before_used = c.call("daemon.status")["device"]["used_bytes"]
    before_count = reclaimed_count(c)
    budget = 4 * c.call("model.list")["models"][0]["bytes_per_expert"]
    before_fds = open_fds(pid)
    p = subprocess.run([sys.executable, "-c", KILLED, daemon.socket, PYCLIENT, str(budget)],
                       capture_output=True, text=True, timeout=60)
    killed_at = time.time()
    assert p.returncode == -signal.SIGKILL, p.stderr
    sid = p.stdout.strip()
    assert mapped_regions(pid, "qmoe-map") == 1
    assert c.call("daemon.status")["device"]["used_bytes"] > before_used
    # Orphaned now, reclaimed in at most the timeout.
    deadline = time.time() + 1
    while (listed(c, sid) or {}).get("orphaned_since") is None:
        assert time.time() < deadline, listed(c, sid)
        time.sleep(0.02)
    s = listed(c, sid)
    assert abs(s["orphaned_since"] - killed_at) <= 2, s
    assert 0 <= s["reclaim_in_s"] <= TIMEOUT_S, s
    gone_at = wait_gone(c, sid, within=5 - (time.time() - killed_at))
    assert gone_at - killed_at >= TIMEOUT_S - 0.5  # not before its time
    # Everything it held is back: the budget, the map, the descriptor.
    assert c.call("daemon.status")["device"]["used_bytes"] == before_used
    assert mapped_regions(pid, "qmoe-map") == 0
    assert open_fds(pid) == before_fds
    assert reclaimed_count(c) == before_count + 1
    metrics = c.call("telemetry.metrics")["text"]
    assert "qmoed_sessions_reclaimed_total %d\n" % (before_count + 1) in metrics
    assert re.search(r"session %s reclaimed: no open connection had used it for \d+ s "
                     r"\(session_orphan_timeout_s 2\)" % sid, daemon.log_text())
    # As after session.close: the id is unknown.
    e = c.request("session.plan", {"session": sid})["error"]
    assert e["code"] == -32001, e
    c.close()


def test_a_client_that_comes_back_in_time_keeps_its_session(daemon):
    c = daemon.client()
    sid = c.call("session.create", {"model": "small"})["session"]
    c.close()
    watcher = daemon.client()
    time.sleep(TIMEOUT_S * 0.6)
    assert listed(watcher, sid)["orphaned_since"] is not None
    # The engine reconnects and calls it: the mark goes, the clock stops.
    back = daemon.client()
    back.call("session.plan", {"session": sid})
    assert listed(watcher, sid)["orphaned_since"] is None
    assert listed(watcher, sid)["reclaim_in_s"] is None
    time.sleep(TIMEOUT_S * 0.6)  # past the first deadline
    assert listed(watcher, sid) is not None
    # Gone again: the clock restarts from now, not from the first orphaning.
    back.close()
    left_at = time.time()
    gone_at = wait_gone(watcher, sid, within=TIMEOUT_S + 3)
    assert gone_at - left_at >= TIMEOUT_S - 0.5
    watcher.close()


def test_an_open_connection_that_touched_it_keeps_it_whoever_touched_last(daemon):
    """The creator's connection stays open; another connection calls the
    session and goes: the session is not orphaned."""
    owner = daemon.client()
    sid = owner.call("session.create", {"model": "small"})["session"]
    other = daemon.client()
    other.call("telemetry.get", {"session": sid})
    other.close()
    time.sleep(TIMEOUT_S + 0.5)
    s = listed(owner, sid)
    assert s is not None and s["orphaned_since"] is None, s
    owner.call("session.close", {"session": sid})
    owner.close()


def maps_reclaimed(c):
    return c.call("telemetry.get")["daemon"]["maps_reclaimed"]


def mapped_call(c, sid, shm, T=2):
    """A call whose input and output are in shm's map (its answer, or error)."""
    shm.put(0, hidden(T).tobytes())
    t = {"dtype": "f32", "shape": [T, H], "map": shm.id, "offset": 0}
    return c.request("session.infer", {"session": sid, "layer": 0, "hidden": t,
                                       "output_to": {"map": shm.id, "offset": T * H * 4}})


# A client that maps 1 MiB into a session another client keeps, calls it
# through its ring (every tensor mapped) and dies by SIGKILL.
MAPS_AND_DIES = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import qmoe_client
    cl = qmoe_client.Client(sys.argv[1])
    sid = sys.argv[3]
    shm = cl.map(sid, 1 << 20)
    x = shm.alloc((2, 64), "f32")
    x.array[:] = np.random.default_rng(1).standard_normal((2, 64))
    out = shm.alloc((2, 64), "f32")
    cl.infer(sid, 0, x, output_to=out)
    assert cl.ring_active(sid), "the call did not take the ring"
    print("called", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_dead_clients_maps_in_a_session_others_keep_are_reclaimed(daemon):
    """Before, they stayed until the session closed: a session several
    engines share filled up with the maps of clients long gone (a soak
    found it at 256, the most a session may hold: session.map refused)."""
    pid = daemon.proc.pid
    owner = daemon.client()
    sid = owner.call("session.create", {"model": "small"})["session"]
    mine = Shm(owner, sid, 8192)
    before = maps_reclaimed(owner)
    p = subprocess.run([sys.executable, "-c", MAPS_AND_DIES, daemon.socket, PYCLIENT, sid],
                       capture_output=True, text=True, timeout=60)
    died_at = time.time()
    assert p.returncode == -signal.SIGKILL and p.stdout.strip() == "called", p.stderr
    assert mapped_regions(pid, "qmoe-map") == 1
    s = listed(owner, sid)
    assert s["maps"] == 2 and s["mapped_bytes"] == 8192 + (1 << 20), s
    deadline = died_at + TIMEOUT_S + 3
    while mapped_regions(pid, "qmoe-map"):
        assert time.time() < deadline, "the dead client's map is still mapped"
        time.sleep(0.05)
    assert time.time() - died_at >= TIMEOUT_S - 0.5  # not before its time
    assert maps_reclaimed(owner) == before + 1
    assert "qmoed_maps_reclaimed_total %d\n" % (before + 1) in owner.call("telemetry.metrics")["text"]
    assert re.search(r"session %s: 1 map \(1048576 bytes\) reclaimed: the connection that last "
                     r"used it closed 2 s ago" % sid, daemon.log_text())
    # The session and the map of the client that keeps it are untouched,
    # past the timeout too.
    s = listed(owner, sid)
    assert s is not None and s["orphaned_since"] is None, s
    assert s["maps"] == 1 and s["mapped_bytes"] == 8192, s
    time.sleep(0.5)
    assert "result" in mapped_call(owner, sid, mine)
    assert maps_reclaimed(owner) == before + 1
    owner.call("session.close", {"session": sid})
    owner.close()


def test_a_map_named_again_in_time_is_kept(daemon):
    """A map whose connection closed is held again by the next connection
    that names it (here a socket call): it stays past the first deadline."""
    owner = daemon.client()
    sid = owner.call("session.create", {"model": "small"})["session"]
    other = daemon.client()
    shm = Shm(other, sid, 8192)
    other.close()
    before = maps_reclaimed(owner)
    time.sleep(TIMEOUT_S * 0.5)
    assert "result" in mapped_call(owner, sid, shm)
    time.sleep(TIMEOUT_S + 0.5)  # past the first deadline
    assert "result" in mapped_call(owner, sid, shm)
    assert maps_reclaimed(owner) == before
    # Held by the owner's connection now: it goes once that one has gone
    # and another keeps the session.
    keeper = daemon.client()
    keeper.call("session.plan", {"session": sid})
    owner.close()
    deadline = time.time() + TIMEOUT_S + 3
    while maps_reclaimed(keeper) == before:
        assert time.time() < deadline
        time.sleep(0.05)
    e = mapped_call(keeper, sid, shm)["error"]
    assert e["code"] == -32001 and e["data"]["field"] == "hidden.map", e
    keeper.call("session.close", {"session": sid})
    keeper.close()


def test_an_orphaned_sessions_maps_start_again_when_a_client_comes_back(daemon):
    """The session and its map orphaned together; a client names the
    session before its time: the map's clock starts again then, so the
    client can still use it after the first deadline."""
    c = daemon.client()
    sid = c.call("session.create", {"model": "small"})["session"]
    shm = Shm(c, sid, 8192)
    c.close()
    watcher = daemon.client()
    before = maps_reclaimed(watcher)
    time.sleep(TIMEOUT_S * 0.75)
    back = daemon.client()
    back.call("session.plan", {"session": sid})
    time.sleep(TIMEOUT_S * 0.5)  # past the map's first deadline
    assert "result" in mapped_call(back, sid, shm)
    assert maps_reclaimed(watcher) == before
    back.call("session.close", {"session": sid})
    back.close()
    watcher.close()


# A client that starts one slow call (the experts of layer 1 paged in at
# 1 MB/s, two at a time) and dies while it runs.
RUNNING = textwrap.dedent("""
    import base64, json, os, signal, socket, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import qmoe_client
    cl = qmoe_client.Client(sys.argv[1])
    sid = cl.create_session("big", policy="lru", budget_bytes=int(sys.argv[3]),
                            policy_params={"prefetch": False})["session"]
    x = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    hidden = {"dtype": "f32", "shape": [64, 512], "data": base64.b64encode(x.tobytes()).decode()}
    req = {"jsonrpc": "2.0", "id": 1, "method": "session.infer",
           "params": {"session": sid, "layer": 1, "hidden": hidden}}
    cl._sock.sendall((json.dumps(req) + "\\n").encode())
    print(sid, flush=True)
    time.sleep(0.5)  # the call is running
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_session_is_never_reclaimed_while_its_call_runs():
    d = tempfile.mkdtemp(prefix="qmoed-reclaim-big-")
    big = make_bank(os.path.join(d, "big.bank"), layers=2, experts=8, hidden=512, inter=512)
    dm = Daemon(models={"big": big},
                args=["--backend", "emu", "--set", "emu_copy_mbps=1",
                      "--session-orphan-timeout", str(TIMEOUT_S)])
    try:
        c = dm.client()
        m = c.call("model.list")["models"][0]
        # Over 3 s of copies at 1 MB/s: every expert of a layer, once.
        assert 8 * m["bytes_per_expert"] / 1e6 > TIMEOUT_S + 1, m
        p = subprocess.run([sys.executable, "-c", RUNNING, dm.socket, PYCLIENT,
                            str(2 * m["bytes_per_expert"])],
                           capture_output=True, text=True, timeout=60)
        killed_at = time.time()
        assert p.returncode == -signal.SIGKILL, p.stderr
        sid = p.stdout.strip()
        # Past the timeout since its client died, the call still runs: kept,
        # and not even marked.
        time.sleep(TIMEOUT_S + 0.3 - (time.time() - killed_at))
        s = listed(c, sid)
        assert s is not None and s["orphaned_since"] is None, (s, dm.log_text())
        # Once the call is done, the clock starts; then it goes.
        wait_gone(c, sid, within=10)
        t = c.call("telemetry.get")["daemon"]
        assert t["sessions_reclaimed"] == 1 and t["expert_misses"] >= 7, t
        log = dm.log_text()
        assert log.index("session %s orphaned" % sid) < log.index("session %s reclaimed" % sid)
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_timeout_zero_keeps_an_orphaned_session(bank):
    dm = Daemon(models={"small": bank}, args=["--set", "session_orphan_timeout_s=0"])
    try:
        c = dm.client()
        sid = c.call("session.create", {"model": "small"})["session"]
        c.close()
        watcher = dm.client()
        time.sleep(TIMEOUT_S + 0.5)
        s = listed(watcher, sid)
        assert s is not None and s["orphaned_since"] is not None, s
        assert s["reclaim_in_s"] is None, s  # never
        assert reclaimed_count(watcher) == 0
        # qmoectl sessions: STATE orphaned, RECLAIM-IN never.
        qmoectl = os.path.join(BUILD, "clients", "qmoectl")
        out = subprocess.run([qmoectl, "--socket", dm.socket, "sessions"], check=True,
                             capture_output=True, text=True).stdout
        row = [l for l in out.splitlines() if l.startswith(sid)]
        assert row and re.split(r"\s{2,}", row[0].strip())[-2:] == ["orphaned", "never"], out
        assert "kept until closed (session_orphan_timeout_s 0)" in dm.log_text()
        watcher.call("session.close", {"session": sid})
        watcher.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_the_default_timeout_is_300_s(bank):
    dm = Daemon(models={"small": bank})
    try:
        c = dm.client()
        sid = c.call("session.create", {"model": "small"})["session"]
        assert listed(c, sid)["orphaned_since"] is None
        c.close()
        watcher = dm.client()
        deadline = time.time() + 2
        while listed(watcher, sid)["orphaned_since"] is None:
            assert time.time() < deadline
            time.sleep(0.02)
        assert 298 <= listed(watcher, sid)["reclaim_in_s"] <= 300
        watcher.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


@pytest.mark.parametrize("value", ["-1", "x", str(1 << 31)])
def test_a_bad_timeout_is_refused_at_start(bank, value):
    dm = Daemon(models={"small": bank}, args=["--session-orphan-timeout", value], wait=False)
    assert dm.proc.wait(10) == 2
    dm.log.close()
    assert "session_orphan_timeout_s must be" in dm.log_text(), dm.log_text()


def test_an_orphan_whose_resize_waits_for_a_worker_past_its_time_goes_after_it(bank, tmp_path):
    """The memory watcher queues resizes of auto sessions, orphaned or not.
    An orphan whose resize still waits for the one worker (busy with another
    session's call, copies at 1 MB/s) when its reclaim time comes is not due
    until that job is handed back; then it goes. Before, the reclaim timer
    restarted itself at 0 ms from its own callback, which libuv ran again in
    the same pass: the loop thread spun for good and nobody was answered
    (docs/RELIABILITY.md B17)."""
    from qmoed_harness import Client, tensor
    import numpy as np
    big = make_bank(str(tmp_path / "big.bank"), layers=2, experts=8, hidden=512, inter=512)
    fifo = str(tmp_path / "pressure")
    os.mkfifo(fifo)
    dm = Daemon(models={"big": big, "small": bank}, env={"QMOED_TEST_PRESSURE": fifo},
                args=["--backend", "emu", "--set", "emu_copy_mbps=1", "--workers", "1",
                      "--session-orphan-timeout", "1", "--set", "auto_budget_check_ms=100",
                      "--set", "auto_budget_grace_ms=0", "--set", "auto_budget_shrink_percent=20",
                      "--set", "auto_budget_grow_after_s=3600"])
    try:
        c = dm.client()
        bpe = {m["name"]: m["bytes_per_expert"] for m in c.call("model.list")["models"]}
        gone = Client(dm.socket)
        orphan = gone.call("session.create", {"model": "small", "policy": "lru",
                                              "budget": "auto"})["session"]
        busy = c.call("session.create", {"model": "big", "policy": "lru",
                                         "budget_bytes": 2 * bpe["big"],
                                         "policy_params": {"prefetch": False}})["session"]
        # The worker's next seconds: every expert of a layer copied at 1 MB/s.
        assert 8 * bpe["big"] / 1e6 > 3, bpe
        x = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
        c.send_raw((json.dumps({"jsonrpc": "2.0", "id": 99, "method": "session.infer",
                                "params": {"session": busy, "layer": 1, "hidden": tensor(x)}})
                    + "\n").encode())
        time.sleep(0.3)  # taken by the worker
        gone.close()  # orphaned now, due in 1 s
        deadline = time.time() + 5
        while (listed(c, orphan) or {}).get("orphaned_since") is None:
            assert time.time() < deadline, dm.log_text()[-2000:]
            time.sleep(0.02)
        with open(fifo, "w") as f:  # the watcher queues its resize behind the busy call
            f.write("pressure\n")
        time.sleep(1.5)  # past its reclaim time, its resize still queued
        probe = Client(dm.socket)
        probe.sock.settimeout(5)
        assert probe.call("daemon.status")["version"], "the daemon answers"
        assert listed(probe, orphan) is not None, "reclaimed with its resize queued"
        probe.close()
        assert c.read()["id"] == 99  # the busy call's answer
        wait_gone(c, orphan, within=20)
        assert re.search(r"session %s: auto budget shrank .* \(memory pressure\)" % orphan,
                         dm.log_text()), dm.log_text()[-3000:]
        c.close()
    finally:
        rc = dm.stop()
    assert rc == 0, dm.log_text()[-3000:]
