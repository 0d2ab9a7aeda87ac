"""qmoed over the wire, budgets that size themselves (issue 38 item 4): the
budget's forms and their refusals, "auto" within MemAvailable and the
memory cgroup limits (injected through QMOED_TEST_MEMINFO and
QMOED_TEST_CGROUP, and a real memory cgroup where the machine gives one),
a pressure event (QMOED_TEST_PRESSURE) and a lowered limit shrinking auto
sessions only, quiet growing them back, outputs bitwise unchanged
throughout, and a real cgroup's limit lowered by half of what auto took
while inferences run: no OOM kill, the budget shrank, the outputs the same.
"""
import json
import os
import re
import subprocess
import threading
import time

import numpy as np
import pytest

from qmoed_harness import BUILD, Daemon, from_tensor, make_bank, tensor
from qmoed_memcg import MemCgroup
from qmoed_suite import err, hidden, new_session

WORKSPACE = 4096  # session_workspace_bytes in these daemons
RULE = 'budget: expected bytes, "N%" with 0 < N <= 100, or "auto"'
WATCH = ["--set", "session_workspace_bytes=%d" % WORKSPACE, "--set", "auto_budget_check_ms=100",
         "--set", "auto_budget_grow_after_s=1", "--set", "auto_budget_pressure_ms=0",
         "--set", "auto_budget_pressure_level=off", "--set", "auto_budget_shrink_percent=20",
         "--set", "auto_budget_grace_ms=0"]


def model_bytes(c):
    return c.call("model.list")["models"][0]["bytes_total"]


def budget_of(c, sid):
    for s in c.call("session.list")["sessions"]:
        if s["session"] == sid:
            return s["budget_bytes"]
    raise AssertionError("no session %s" % sid)


def wait_budget(c, sid, pred, what, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = budget_of(c, sid)
        if pred(b):
            return b
        time.sleep(0.05)
    raise AssertionError("budget of %s never %s (now %d)" % (sid, what, budget_of(c, sid)))


def outputs(c, sid, n=6):
    """Outputs of n fixed calls over both layers."""
    return [from_tensor(c.call("session.infer", {"session": sid, "layer": i % 2,
                                                 "hidden": tensor(hidden(1 + i % 3, seed=40 + i))})
                        ["output"]) for i in range(n)]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


class FakeMemory:
    """A meminfo file and a cgroup v1 directory the daemon reads instead of
    the machine's (QMOED_TEST_MEMINFO, QMOED_TEST_CGROUP)."""

    def __init__(self, root, limit, usage, inactive=0, mem_total=100 << 30, mem_available=90 << 30):
        self.dir = os.path.join(root, "cg")
        os.makedirs(self.dir, exist_ok=True)
        self.meminfo = os.path.join(root, "meminfo")
        self.set_meminfo(mem_total, mem_available)
        self.write("memory.limit_in_bytes", limit)
        self.write("memory.usage_in_bytes", usage)
        with open(os.path.join(self.dir, "memory.stat"), "w") as f:
            f.write("cache 0\ntotal_inactive_file %d\n" % inactive)

    def set_meminfo(self, total, available):
        with open(self.meminfo, "w") as f:
            f.write("MemTotal: %d kB\nMemFree: 0 kB\nMemAvailable: %d kB\n" % (total >> 10, available >> 10))

    def write(self, name, value):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write("%d\n" % value)

    def env(self, fifo=None):
        e = {"QMOED_TEST_MEMINFO": self.meminfo, "QMOED_TEST_CGROUP": self.dir}
        if fifo:
            e["QMOED_TEST_PRESSURE"] = fifo
        return e


@pytest.fixture
def small(banks):
    return banks["small"]


@pytest.fixture
def watched(small, tmp_path):
    """A daemon whose memory is FakeMemory's (a 1 GiB cgroup, nothing in use;
    auto_budget_reserve 10000 bytes) and whose pressure events come from a
    FIFO: (daemon, FakeMemory, the FIFO's path). It must exit 0."""
    fm = FakeMemory(str(tmp_path), limit=1 << 30, usage=0)
    fifo = os.path.join(str(tmp_path), "pressure")
    os.mkfifo(fifo)
    dm = Daemon(models={"small": small}, env=fm.env(fifo),
                args=WATCH + ["--set", "auto_budget_reserve=10000"])
    yield dm, fm, fifo
    assert dm.stop() == 0, dm.log_text()


def test_budget_forms_over_the_wire(daemon):
    c = daemon.client()
    total = model_bytes(c)
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "25%"})
    assert r["budget_bytes"] == total // 4
    assert "budget_auto" not in r
    sid = r["session"]
    assert "budget_auto" not in c.call("session.plan", {"session": sid})
    r = c.call("session.resize", {"session": sid, "budget": "50%"})
    assert r["budget_bytes"] == total // 2
    r = c.call("session.resize", {"session": sid, "budget": total // 3})
    assert r["budget_bytes"] == total // 3
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "12.5%"})
    assert r["budget_bytes"] == total // 8
    for bad in ("abc", "0%", "101%", "-5%", "5 %", "2G", "0", "", "AUTO"):
        e = err(c.request("session.create", {"model": "small", "budget": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "budget", (bad, e)
        assert e["data"]["reason"].startswith(RULE), e
        e = err(c.request("session.resize", {"session": sid, "budget": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "budget", (bad, e)
    for bad in (0, -1, 1.5, True, None, [1], {}):
        e = err(c.request("session.create", {"model": "small", "budget": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "budget", (bad, e)
    e = err(c.request("session.create", {"model": "small", "budget": "auto", "budget_bytes": 5}))
    assert e["data"]["field"] == "budget" and "give one of them" in e["data"]["reason"]
    e = err(c.request("session.create", {"model": "small", "budget_bytes": "50%"}))
    assert e["data"]["field"] == "budget_bytes" and "non-negative integer" in e["data"]["reason"]
    e = err(c.request("session.resize", {"session": sid}))
    assert e["data"]["field"] == "budget_bytes"


def test_auto_is_sized_by_the_tightest_of_meminfo_and_the_cgroup_chain(watched):
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    x = total // 2
    # The cgroup: 4000 bytes in use (usage less its inactive page cache), no
    # experts of qmoed's among them: they count toward the reserve, whose
    # other 6000 bytes are kept free; a limit that leaves x after them and a
    # workspace.
    limit = 10000 + WORKSPACE + x
    fm.write("memory.limit_in_bytes", limit)
    fm.write("memory.usage_in_bytes", 4000 + 3000)
    with open(os.path.join(fm.dir, "memory.stat"), "w") as f:
        f.write("total_inactive_file 3000\n")
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})
    assert r["budget_bytes"] == x, r
    a = r["budget_auto"]
    assert a["bound"] == "memory" and a["target_bytes"] == x and a["reserve_bytes"] == 10000
    assert a["reserve_free_bytes"] == 6000, a
    m = a["memory"]
    assert m["source"] == "cgroup v1" and m["path"] == fm.dir
    assert m["limit_bytes"] == limit and m["page_cache_bytes"] == 3000
    assert m["in_use_bytes"] == 4000 and m["experts_bytes"] == 0
    assert m["available_bytes"] == x + 6000 + WORKSPACE
    assert re.match(r"budget auto: .* = cgroup limit .* kB - in use 4\.0 kB - reserve 10\.0 kB "
                    r"\+ its 4\.0 kB in use - workspace 4\.1 kB \(cgroup v1 .*/cg\)$",
                    a["reason"]), a["reason"]
    plan = c.call("session.plan", {"session": r["session"]})
    assert plan["budget_auto"] == a
    assert "budget auto: " in dm.log_text()
    # MemAvailable tighter than the cgroup: it bounds (and keeps the whole
    # reserve free).
    fm.write("memory.limit_in_bytes", 1 << 30)
    fm.write("memory.usage_in_bytes", 0)
    fm.set_meminfo(100 << 30, 10000 + WORKSPACE + total // 4)
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})
    by_meminfo = ((10000 + WORKSPACE + total // 4) >> 10 << 10) - 10000 - WORKSPACE  # kB
    assert r["budget_bytes"] == by_meminfo
    assert r["budget_auto"]["memory"]["source"] == "MemAvailable"
    assert r["budget_auto"]["reason"].startswith("budget auto: ")
    # Room for everything: the model bounds it.
    fm.set_meminfo(100 << 30, 90 << 30)
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})
    assert r["budget_bytes"] == total and r["budget_auto"]["bound"] == "model"
    # Nothing left: refused with the arithmetic. The rest uses more than the
    # reserve, which keeps nothing free then: the watcher leaves the
    # sessions above alone while anything is available.
    fm.write("memory.usage_in_bytes", (1 << 30) - 3000 + 3000)  # the page cache left out
    e = err(c.request("session.create", {"model": "small", "budget": "auto"}))
    assert e["code"] == -32003 and e["data"]["field"] == "budget", e
    assert "nothing left for expert weights" in e["data"]["reason"]
    assert "auto_budget_reserve" in e["data"]["reason"]
    t = c.call("telemetry.get")["daemon"]
    assert t["auto_budget_bytes"] == x + by_meminfo + total


def test_a_clients_pending_bytes_are_left_free_by_its_auto_budget(watched):
    """client_pending_bytes (what the engine takes after session.create: its
    buffers, weights it maps and has not read) is left free beside what the
    reserve keeps, and shows in budget_auto and its reason; it is refused
    with any other budget, and a bad value names the field."""
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    x = total // 2
    # 4000 bytes of the rest in use: the reserve (10000) keeps 6000 free.
    fm.write("memory.limit_in_bytes", 10000 + WORKSPACE + x)
    fm.write("memory.usage_in_bytes", 4000)
    pending = x // 3
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto",
                                  "client_pending_bytes": pending})
    assert r["budget_bytes"] == x - pending, r
    a = r["budget_auto"]
    assert a["client_pending_bytes"] == pending and a["target_bytes"] == x - pending, a
    assert re.search(r"- reserve 10\.0 kB \+ its 4\.0 kB in use - the client's pending [\d.]+ [kMG]?B "
                     r"- workspace ", a["reason"]), a["reason"]
    assert c.call("session.plan", {"session": r["session"]})["budget_auto"] == a
    c.call("session.close", {"session": r["session"]})
    # Without it, or at 0: the whole room, as before.
    for extra in ({}, {"client_pending_bytes": 0}):
        r = c.call("session.create", dict({"model": "small", "policy": "lru", "budget": "auto"}, **extra))
        assert r["budget_bytes"] == x and r["budget_auto"]["client_pending_bytes"] == 0, r
        assert "the client's pending" not in r["budget_auto"]["reason"]
        c.call("session.close", {"session": r["session"]})
    # More than the room: nothing left, the arithmetic names it.
    e = err(c.request("session.create", {"model": "small", "budget": "auto",
                                         "client_pending_bytes": x + 1}))
    assert e["code"] == -32003 and e["data"]["field"] == "budget", e
    assert "the client's pending" in e["data"]["reason"], e
    for budget in (None, "50%", total // 2):
        p = {"model": "small", "client_pending_bytes": 100}
        if budget is not None:
            p["budget"] = budget
        e = err(c.request("session.create", p))
        assert e["code"] == -32602 and e["data"]["field"] == "client_pending_bytes", e
        assert 'needs budget "auto"' in e["data"]["reason"], e
    for bad in (-1, 1.5, "100", True, None, 2 ** 60):
        e = err(c.request("session.create", {"model": "small", "budget": "auto",
                                             "client_pending_bytes": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "client_pending_bytes", (bad, e)
    assert c.call("session.list")["sessions"] == []


def test_auto_on_this_machine_is_within_memavailable(daemon):
    c = daemon.client()
    total = model_bytes(c)
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})
    a = r["budget_auto"]
    avail = a["memory"]["available_bytes"]
    assert r["budget_bytes"] == min(total, avail - a["reserve_free_bytes"] - (16 << 20))
    if a["memory"]["source"] == "MemAvailable":
        assert a["reserve_free_bytes"] == a["reserve_bytes"]
    with open("/proc/meminfo") as f:
        now = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
    assert avail <= now["MemTotal"]


def test_pressure_shrinks_auto_sessions_only_and_quiet_grows_them_back(watched):
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    ref = outputs(c, new_session(c))
    auto = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
    fixed = c.call("session.create", {"model": "small", "policy": "lru", "budget": total})["session"]
    assert same(outputs(c, auto), ref)
    with open(fifo, "w") as f:
        f.write("pressure\n")
    shrunk = wait_budget(c, auto, lambda b: b < total, "shrunk")
    assert shrunk == total - total // 5, (shrunk, total)
    assert budget_of(c, fixed) == total  # only auto budgets give way
    assert same(outputs(c, auto), ref)
    t = c.call("telemetry.get")
    assert t["daemon"]["memory_pressure_events"] == 1
    assert t["daemon"]["auto_shrinks"] == 1 and t["daemon"]["auto_shrunk_bytes"] == total // 5
    s = next(x for x in t["sessions"] if x["session"] == auto)
    assert s["auto_shrinks"] == 1 and s["auto_budget_bytes"] == shrunk
    assert re.search(r"session %s: auto budget shrank .* \(memory pressure\)" % auto, dm.log_text())
    # A second event within the check interval is the same episode; then quiet.
    grown = wait_budget(c, auto, lambda b: b == total, "grown back", timeout=15)
    assert grown == total
    assert same(outputs(c, auto), ref)
    t = c.call("telemetry.get")["daemon"]
    assert t["auto_grows"] == 1 and t["auto_grown_bytes"] == total // 5
    assert re.search(r"session %s: auto budget grew .* \(no memory pressure for 1 s" % auto,
                     dm.log_text())
    plan = c.call("session.plan", {"session": auto})
    assert plan["budget_bytes"] == total and plan["budget_auto"]["target_bytes"] == total



def shrunk_by_20(b):
    """What one pressure step leaves of a budget (auto_budget_shrink_percent 20)."""
    return b - (b // 100 * 20 + b % 100 * 20 // 100)


def test_pressure_after_a_growth_is_a_relapse_that_slows_and_caps_the_next(watched):
    """Pressure within twice auto_budget_grow_after_s (1 s here) of a growth
    is a relapse: the next growth waits twice as long, goes first only to
    the budget the relapse's shrink left (its ceiling, in the plan), and
    past it after a whole wait held there; at the auto size for two plain
    waits, the wait is the plain one again. Outputs never change."""
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    ref = outputs(c, new_session(c))
    sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]

    def event():
        with open(fifo, "w") as f:
            f.write("pressure\n")

    def relapses():
        t = c.call("telemetry.get")
        s = next(x for x in t["sessions"] if x["session"] == sid)
        return t["daemon"]["auto_relapses"], s["auto_relapses"]

    # Pressure with no growth before it: a plain shrink, back after 1 s.
    event()
    one = wait_budget(c, sid, lambda b: b < total, "shrunk")
    assert one == shrunk_by_20(total)
    wait_budget(c, sid, lambda b: b == total, "grown back")
    assert relapses() == (0, 0)
    # Pressure right after that growth: a relapse. Twice, 0.3 s apart (one
    # episode, one relapse): the ceiling is what the first shrink left.
    event()
    t0 = time.time()
    wait_budget(c, sid, lambda b: b == one, "shrunk by the relapse")
    time.sleep(max(0.0, t0 + 0.3 - time.time()))
    event()
    two = wait_budget(c, sid, lambda b: b == shrunk_by_20(one), "shrunk again")
    ts = time.time()
    assert relapses() == (1, 1)
    assert c.call("session.plan", {"session": sid})["budget_auto"]["ceiling_bytes"] == one
    plan = subprocess.run([os.path.join(BUILD, "clients", "qmoectl"),
                           "--socket", dm.socket, "plan", sid], capture_output=True, text=True,
                          timeout=30)
    assert plan.returncode == 0 and re.search(
        r"^pressure came back after it grew: growth stops at \S+ \S+ until", plan.stdout,
        re.M), plan.stdout + plan.stderr
    assert re.search(r"auto budgets: memory pressure \d+\.\d s after they grew \(relapse 1\): "
                     r"the next growth waits 2 s of quiet", dm.log_text()), dm.log_text()[-2000:]
    assert same(outputs(c, sid), ref)
    # Growth waits 2 s of quiet now, not the plain 1 s (times measured from
    # what this test saw, the daemon's own a little earlier), and goes to
    # the ceiling only; after 2 s more held there, past it.
    grown = wait_budget(c, sid, lambda b: b != two, "grown to the ceiling")
    t1 = time.time()
    assert grown == one and t1 - ts >= 1.3, (grown, one, t1 - ts)
    assert re.search(r"session %s: auto budget grew .* \(no memory pressure for 2 s" % sid,
                     dm.log_text())
    grown = wait_budget(c, sid, lambda b: b != one, "grown past the ceiling")
    assert grown == total and time.time() - t1 >= 1.3, (grown, total, time.time() - t1)
    assert c.call("session.plan", {"session": sid})["budget_auto"]["ceiling_bytes"] is None
    assert same(outputs(c, sid), ref)
    # Held at the auto size for 2 s: the wait is 1 s again, and pressure
    # then is no relapse.
    wait_log = r"at their auto size without memory pressure for 2 s: growth waits 1 s again"
    deadline = time.time() + 10
    while not re.search(wait_log, dm.log_text()) and time.time() < deadline:
        time.sleep(0.1)
    assert re.search(wait_log, dm.log_text()), dm.log_text()[-2000:]
    event()
    wait_budget(c, sid, lambda b: b < total, "shrunk")
    wait_budget(c, sid, lambda b: b == total, "grown back")
    assert relapses() == (1, 1)
    assert same(outputs(c, sid), ref)


def test_pressure_waits_its_grace_after_an_auto_budget_is_made_or_grown(small, tmp_path):
    """Events within auto_budget_grace_ms of an auto session's creation, or
    of the watcher's growing it, are counted and not acted on: that
    allocation and the engine's loading evict page cache, which the kernel
    reports as pressure. After the grace an event shrinks as before."""
    grace = 3.0
    fm = FakeMemory(str(tmp_path), limit=1 << 30, usage=0)
    fifo = os.path.join(str(tmp_path), "pressure")
    os.mkfifo(fifo)
    dm = Daemon(models={"small": small}, env=fm.env(fifo),
                args=WATCH + ["--set", "auto_budget_reserve=10000",
                              "--set", "auto_budget_grace_ms=%d" % (grace * 1000)])
    try:
        c = dm.client()
        total = model_bytes(c)

        def event():
            with open(fifo, "w") as f:
                f.write("pressure\n")

        t0 = time.time()
        sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
        event()
        time.sleep(0.5)
        assert time.time() - t0 < grace  # the check below means something
        assert budget_of(c, sid) == total
        t = c.call("telemetry.get")["daemon"]
        assert t["memory_pressure_events"] == 1 and t["auto_shrinks"] == 0, t
        time.sleep(max(0.0, grace + 0.2 - (time.time() - t0)))
        event()
        shrunk = wait_budget(c, sid, lambda b: b < total, "shrunk after the grace")
        assert shrunk == total - total // 5
        # Quiet (1 s) grows it back; an event right after the growth waits too.
        wait_budget(c, sid, lambda b: b == total, "grown back", timeout=15)
        t1 = time.time()
        event()
        time.sleep(0.5)
        assert time.time() - t1 < grace
        assert budget_of(c, sid) == total
        t = c.call("telemetry.get")["daemon"]
        assert t["memory_pressure_events"] == 3 and t["auto_shrinks"] == 1, t
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_a_lowered_limit_takes_what_is_missing_from_auto_budgets(watched):
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    ref = outputs(c, new_session(c))
    # No auto budget yet: the watcher's timer has stopped by now; the auto
    # session's creation starts it again.
    time.sleep(0.3)
    auto = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
    assert budget_of(c, auto) == total
    # This cgroup's usage (0) does not follow the daemon's: nothing of the
    # rest's in use, the reserve's 10000 bytes are all kept free. A limit
    # lowered within half of them: the reserve absorbs it.
    fm.write("memory.limit_in_bytes", 6000)
    time.sleep(0.5)
    assert budget_of(c, auto) == total
    # 6000 bytes of the reserve eaten: that much goes (and again at each
    # check, since the usage does not follow).
    fm.write("memory.limit_in_bytes", 4000)
    wait_budget(c, auto, lambda b: b < total, "shrunk")
    first = re.search(r"session %s: auto budget shrank (\S+ \S+) -> (\S+ \S+) \(cgroup limit "
                      r"4\.0 kB - in use 0 bytes leaves less than the reserve 10\.0 kB\)" % auto,
                      dm.log_text())
    kb = lambda n: "%.1f kB" % (n / 1e3)  # the daemon's units at this size
    assert first and first.groups() == (kb(total), kb(total - 6000)), dm.log_text()[-2000:]
    assert same(outputs(c, auto), ref)
    fm.write("memory.limit_in_bytes", 1 << 30)
    assert wait_budget(c, auto, lambda b: b == total, "grown back", timeout=15) == total



def test_resizing_an_auto_session(watched):
    dm, fm, fifo = watched
    c = dm.client()
    total = model_bytes(c)
    sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
    # Bytes end auto: the watcher leaves it alone from then on.
    r = c.call("session.resize", {"session": sid, "budget": "50%"})
    assert r["budget_bytes"] == total // 2 and "budget_auto" not in r
    assert "budget_auto" not in c.call("session.plan", {"session": sid})
    with open(fifo, "w") as f:
        f.write("pressure\n")
    time.sleep(0.5)
    assert budget_of(c, sid) == total // 2
    # "auto" sizes it again, its own resident bytes counted as its (the rest
    # in use covers the reserve: nothing is kept free for it).
    fm.write("memory.usage_in_bytes", (1 << 30) - total // 3)
    res = next(s for s in c.call("session.list")["sessions"] if s["session"] == sid)["resident_bytes"]
    assert res > 0
    r = c.call("session.resize", {"session": sid, "budget": "auto"})
    assert r["budget_bytes"] == min(total, total // 3 + res), (r, res)
    assert "its own" in r["budget_auto"]["reason"]
    assert c.call("session.plan", {"session": sid})["budget_auto"]["target_bytes"] == r["budget_bytes"]
    # "auto" leaving the client's pending bytes free (a longer context's KV
    # cache to come), as session.create does; refused beside any other
    # budget, and a bad value names the field; the session keeps its budget.
    pending = total // 6
    r = c.call("session.resize", {"session": sid, "budget": "auto", "client_pending_bytes": pending})
    assert r["budget_bytes"] == min(total, total // 3 + res - pending), (r, res)
    assert r["budget_auto"]["client_pending_bytes"] == pending
    assert "- the client's pending " in r["budget_auto"]["reason"], r["budget_auto"]["reason"]
    assert c.call("session.plan", {"session": sid})["budget_auto"] == r["budget_auto"]
    kept = r["budget_bytes"]
    for budget in ({"budget": "50%"}, {"budget": total // 2}, {"budget_bytes": total // 2}):
        e = err(c.request("session.resize", dict({"session": sid, "client_pending_bytes": 1},
                                                 **budget)))
        assert e["code"] == -32602 and e["data"]["field"] == "client_pending_bytes", (budget, e)
        assert 'needs budget "auto"' in e["data"]["reason"], e
    for bad in (-1, 1.5, "100", True, None, 2 ** 60):
        e = err(c.request("session.resize", {"session": sid, "budget": "auto",
                                             "client_pending_bytes": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "client_pending_bytes", (bad, e)
    assert budget_of(c, sid) == kept
    # Without it: the whole room again.
    r = c.call("session.resize", {"session": sid, "budget": "auto"})
    assert r["budget_auto"]["client_pending_bytes"] == 0
    assert r["budget_bytes"] == min(total, total // 3 + res), (r, res)



def test_plans_pipelined_behind_auto_resizes_are_whole(watched):
    """session.resize "auto" and "50%" alternating with session.plan,
    pipelined on one connection: a plan may be written on a worker while
    the loop replaces the session's auto budget (the resize before it just
    finished); every plan answer is whole JSON, and any budget_auto it
    carries is one whole auto budget, never half of one and half of none."""
    dm, fm, fifo = watched
    c = dm.client()
    sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
    n = 150
    lines = []
    for i in range(n):
        budget = "auto" if i % 2 == 0 else "50%"
        lines.append({"jsonrpc": "2.0", "id": 2 * i + 1, "method": "session.resize",
                      "params": {"session": sid, "budget": budget}})
        lines.append({"jsonrpc": "2.0", "id": 2 * i + 2, "method": "session.plan",
                      "params": {"session": sid}})
    c.send_raw(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    seen = 0
    for _ in range(2 * n):
        r = json.loads(c.read_line().decode("utf-8"))
        assert "result" in r, r
        if r["id"] % 2 == 0:
            a = r["result"].get("budget_auto")
            if a is not None:
                assert a["reason"].startswith("budget auto: ") and "\x00" not in a["reason"], a
                assert a["target_bytes"] > 0 and a["bound"] in ("memory", "model", "device"), a
                seen += 1
    assert seen > 0


# ---- a real memory cgroup ----

def real_bank(d):
    # 4 layers x 16 experts of ~2.4 MB: 150 MB, big against the daemon's own memory.
    return make_bank(os.path.join(d, "real.bank"), layers=4, experts=16, hidden=1024, inter=1536,
                     k=2, bits=4, block=32, seed=5)


def test_a_real_cgroup_bounds_auto_and_a_limit_lowered_mid_run_is_followed(banks):
    why = MemCgroup.unavailable()
    if why:
        pytest.skip("no memory cgroup: " + why)
    bank = real_bank(banks["dir"])
    reserve = 48 << 20
    args = ["--set", "paging_source=direct", "--set", "auto_budget_reserve=%d" % reserve,
            "--set", "auto_budget_check_ms=100", "--set", "auto_budget_pressure_ms=0",
            "--set", "auto_budget_pressure_level=off", "--set", "auto_budget_grow_after_s=3600"]
    rng = np.random.default_rng(200)
    calls = [(i % 4, rng.standard_normal((1 + i % 2, 1024)).astype(np.float32)) for i in range(40)]
    # The reference: a whole_bank session of a daemon outside the group.
    rd = Daemon(models={"real": bank})
    try:
        rc = rd.client()
        total = model_bytes(rc)
        rsid = rc.call("session.create", {"model": "real"})["session"]
        ref = [from_tensor(rc.call("session.infer", {"session": rsid, "layer": l, "hidden": tensor(x)})
                           ["output"]) for l, x in calls]
    finally:
        assert rd.stop() == 0
    g = MemCgroup(8 << 30)
    dm = Daemon(models={"real": bank}, args=args)
    try:
        g.add(dm.proc.pid)
        c = dm.client()
        # A limit that leaves about 60% of the model after the reserve and a workspace.
        limit = g.usage() + reserve + (16 << 20) + int(total * 0.6)
        g.set_limit(limit)
        limit = g.limit()  # in pages
        r = c.call("session.create", {"model": "real", "policy": "lru", "budget": "auto"})
        a, took = r["budget_auto"], r["budget_bytes"]
        assert a["bound"] == "memory" and a["memory"]["source"].startswith("cgroup"), a
        assert a["memory"]["path"] == g.path and a["memory"]["limit_bytes"] == limit
        assert took <= limit - reserve - (16 << 20) and took >= total // 2, (took, total)
        sid = r["session"]
        got, errors = [None] * len(calls), []

        def run():
            try:
                for rnd in range(3):
                    for i, (l, x) in enumerate(calls):
                        out = from_tensor(c2.call("session.infer", {"session": sid, "layer": l,
                                                                    "hidden": tensor(x)})["output"])
                        if got[i] is None or rnd == 2:
                            got[i] = out
                        if not np.array_equal(out, ref[i]):
                            errors.append("call %d of round %d differs" % (i, rnd))
            except Exception as e:  # reported below
                errors.append(repr(e))

        c2 = dm.client()
        t = threading.Thread(target=run)
        t.start()
        # Lower the limit by half of what auto took, a third of the reserve at a
        # time, as a controller would: each step the watcher gives back.
        goal, refused = limit - took // 2, 0
        cur = limit
        while cur > goal:
            nxt = max(goal, cur - reserve // 3)
            try:
                g.set_limit(nxt)
                cur = nxt
            except OSError:
                refused += 1
                assert refused < 100, "the kernel kept refusing the lower limit"
            time.sleep(0.3)
        t.join(300)
        assert not t.is_alive()
        assert not errors, errors[:3]
        assert dm.proc.poll() is None, "qmoed died:\n" + dm.log_text()[-3000:]
        assert g.oom_kills() == 0
        b = budget_of(c, sid)
        shrinks = c.call("telemetry.get")["daemon"]["auto_shrinks"]
        print("real cgroup: limit %d -> %d, auto took %d, now %d after %d shrinks; %d limit "
              "writes refused; usage %d" % (limit, cur, took, b, shrinks, refused, g.usage()))
        assert b <= took - took // 2 + reserve, (b, took)
        assert re.search(r"session %s: auto budget shrank .* leaves less than the reserve" % sid,
                         dm.log_text())
        assert g.usage() <= cur
        assert all(o is not None and np.array_equal(o, r_) for o, r_ in zip(got, ref))
    finally:
        rc_ = dm.stop()
        g.remove()
        assert rc_ == 0, dm.log_text()[-3000:]


def test_a_real_pressure_event_shrinks_an_auto_budget(small, tmp_path):
    """The kernel's own event: a memory cgroup whose page cache a reader
    churns (a file four times its limit, read through it) reclaims, which
    cgroup v1 reports as memory.pressure_level events (level low) and v2 as
    PSI stall in memory.pressure; the daemon in that group shrinks its auto
    session."""
    why = MemCgroup.unavailable()
    if why:
        pytest.skip("no memory cgroup: " + why)
    g = MemCgroup(8 << 30)
    args = WATCH + ["--set", "auto_budget_reserve=1000", "--set", "auto_budget_pressure_ms=5",
                    "--set", "auto_budget_pressure_level=low", "--set", "auto_budget_grow_after_s=3600"]
    dm = Daemon(models={"small": small}, args=args)
    try:
        g.add(dm.proc.pid)
        g.set_limit(g.usage() + (64 << 20))
        c = dm.client()
        total = model_bytes(c)
        sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
        assert budget_of(c, sid) == total
        deadline = time.time() + 5  # the watcher arms its sources at its first step
        while "listening for memory pressure on" not in dm.log_text() and time.time() < deadline:
            time.sleep(0.05)
        if "listening for memory pressure on" not in dm.log_text():
            pytest.skip("no memory pressure source could be armed here:\n" + dm.log_text()[-1500:])
        churn = str(tmp_path / "churn")
        with open(churn, "wb") as f:
            f.truncate(256 << 20)
        for _ in range(10):
            subprocess.run(g.prefix() + ["dd", "if=" + churn, "of=/dev/null", "bs=1M"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            if budget_of(c, sid) < total:
                break
        b = wait_budget(c, sid, lambda b: b < total, "shrunk by a real pressure event", timeout=10)
        assert b >= qmoe_floor(c, sid)
        t = c.call("telemetry.get")["daemon"]
        assert t["memory_pressure_events"] > 0 and t["auto_shrinks"] >= 1, t
        assert re.search(r"session %s: auto budget shrank .* \(memory pressure\)" % sid, dm.log_text())
        assert g.oom_kills() == 0
    finally:
        rc = dm.stop()
        g.remove()
        assert rc == 0, dm.log_text()[-3000:]


def qmoe_floor(c, sid):
    """One expert unit: the least a paged session's budget goes to."""
    return c.call("model.list")["models"][0]["bytes_per_expert"]



def pressure_fds(pid):
    """The daemon's descriptors on memory pressure files (PSI triggers, a
    cgroup v1 memory.pressure_level registration)."""
    out = []
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if "pressure" in target:
            out.append(target)
    return sorted(out)


def test_pressure_sources_close_with_the_last_auto_session_and_open_with_the_next(small):
    """While auto sessions are open qmoed listens for memory pressure; with
    none open it holds no trigger or registration (a PSI trigger keeps the
    kernel's monitor polling), and the next auto session arms them again,
    said once in the log."""
    args = WATCH + ["--set", "auto_budget_pressure_ms=150", "--set", "auto_budget_pressure_level=medium",
                    "--log-level", "info"]
    dm = Daemon(models={"small": small}, args=args)
    try:
        c = dm.client()
        assert pressure_fds(dm.proc.pid) == []
        fixed = new_session(c, policy="lru", budget_bytes=model_bytes(c))
        sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
        deadline = time.time() + 5  # armed at the watcher's first step
        while not pressure_fds(dm.proc.pid) and time.time() < deadline:
            time.sleep(0.05)
        armed = pressure_fds(dm.proc.pid)
        if not armed:
            pytest.skip("no memory pressure source could be armed here:\n" + dm.log_text()[-1500:])
        c.call("session.close", {"session": sid})
        deadline = time.time() + 5
        while pressure_fds(dm.proc.pid) and time.time() < deadline:
            time.sleep(0.05)
        assert pressure_fds(dm.proc.pid) == [], "still held with no auto session open"
        assert outputs(c, fixed)  # the other session serves on
        sid = c.call("session.create", {"model": "small", "policy": "lru", "budget": "auto"})["session"]
        deadline = time.time() + 5
        while pressure_fds(dm.proc.pid) != armed and time.time() < deadline:
            time.sleep(0.05)
        assert pressure_fds(dm.proc.pid) == armed
        log = dm.log_text()
        for what in set(re.findall(r"listening for memory pressure on (.*)", log)):
            assert log.count("listening for memory pressure on " + what) == 1, log[-2000:]
    finally:
        rc = dm.stop()
        assert rc == 0, dm.log_text()[-3000:]
