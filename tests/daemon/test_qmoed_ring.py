"""qmoed over the wire, the call ring (PROTOCOL.md "session.ring"): a
session's shared call region opened with a sealed memfd over the socket,
whose calls one daemon thread takes straight from the region.

One contract, two transports: a ring call answers what session.infer with
the same mapped tensors answers over the socket, bit for bit and error for
error, in the session's order, counted alike. The ring is untrusted input
(garbage fails that call and nothing else); it ends cleanly with its
connection, its session and the drain, waking whoever waits on it; a client
killed mid-call leaves no thread behind, and an idle ring costs no CPU.

The tests drive the region by hand (qmoe_client._ring's layout and waits)
next to raw JSON lines on the socket, so both transports are seen as bytes.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from qmoed_harness import Daemon, make_bank, memfd
from qmoed_suite import E, H, Shm, as_bytes, err, hidden, new_session, request_fds

from qmoe_client import _ring

HERE = os.path.dirname(os.path.abspath(__file__))
PYCLIENT = os.path.join(HERE, "..", "..", "clients", "python")
MAP_BYTES = 1 << 20


class RawRing:
    """A ring opened by hand on connection c (its region mapped here)."""

    def __init__(self, c, sid, **params):
        fd, self.mm = _ring.region()
        r = request_fds(c, "session.ring", dict(params, session=sid), [fd])
        os.close(fd)
        assert "result" in r, r
        self.result = r["result"]
        self.ring = _ring.Ring(self.mm, sid, 0)
        self.sock_fd = c.sock.fileno()

    def call(self, req, layer=None, timeout=30, sock_fd=None):
        """(code, stats dict, field, reason)."""
        layer = _ring.REQUEST.unpack_from(req, 0)[0] if layer is None else layer
        code, stats, field, reason = self.ring.call(
            req, layer, self.sock_fd if sock_fd is None else sock_fd, timeout)
        return code, dict(zip(_ring.STAT_NAMES, stats)), field, reason


def mapped(t):
    dt, rows, cols, m, off = t
    return {"dtype": dt, "shape": [rows, cols], "map": m, "offset": off}


def both(sid, layer, x, out, logits=None, ids=None, w=None):
    """One call as session.infer's params (mapped tensors, output_to) and
    as the ring's request. Tensors are (dtype, rows, cols, map, offset)."""
    p = {"session": sid, "layer": layer, "hidden": mapped(x),
         "output_to": {"map": out[0], "offset": out[1]}}
    if logits is not None:
        p["router_logits"] = mapped(logits)
    if ids is not None:
        p["topk_ids"] = mapped(ids)
    if w is not None:
        p["topk_weights"] = mapped(w)
    return p, _ring.request(layer, x, out, logits, ids, w)


def socket_error(r):
    e = err(r)
    d = e.get("data", {})
    return e["code"], d.get("field", ""), d.get("reason")


SIZE = {"f32": 4, "f16": 2, "bf16": 2}


def up(n):
    return (n + 63) // 64 * 64


def ring_threads(pid):
    """The daemon's ring threads (named qmoed-ring)."""
    n = 0
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                n += f.read().strip() == "qmoed-ring"
        except OSError:
            pass  # a thread that just ended
    return n


def cpu_ticks(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wakeups(pid):
    """{thread id: voluntary context switches}: each time a thread of pid
    slept and was woken."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        out[tid] = int(line.split()[1])
        except FileNotFoundError:
            pass
    return out


def wait_for(pred, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture(scope="module")
def bigbank(banks):
    """One layer whose T = 256 exact call takes a good part of a second on
    two cores: it holds a session's FIFO while a ring call waits behind it."""
    return make_bank(os.path.join(banks["dir"], "big.bank"), layers=1, experts=8, hidden=2048,
                     inter=2048, k=4, bits=4, block=32, seed=5)


@pytest.fixture(scope="module")
def rdaemon(banks, bigbank):
    dm = Daemon(models={"small": banks["small"], "norouter": banks["norouter"],
                        "big": bigbank})
    yield dm
    assert dm.stop() == 0, dm.log_text()


def slow_socket_call(dm, sid, shm, T=256, calls=1):
    """Starts `calls` T-token exact calls of the big bank, pipelined on a
    connection of its own (not read): they hold sid's FIFO for a while (one
    takes 0.17 s on a quiet Zen 4, so tests that must see a call still
    waiting after 0.2 s queue several). Returns that connection."""
    c = dm.client()
    x = np.random.default_rng(9).standard_normal((T, 2048)).astype(np.float32)
    shm.put(0, x.tobytes())
    p, _ = both(sid, 0, ("f32", T, 2048, shm.id, 0), (shm.id, up(T * 2048 * 4)))
    import json
    c.send_raw(b"".join((json.dumps({"jsonrpc": "2.0", "id": 99 + i, "method": "session.infer",
                                     "params": p}) + "\n").encode() for i in range(calls)))
    return c


# ---- opening ----

def test_session_ring_opens_a_region_the_daemon_initialised(rdaemon):
    c = rdaemon.client()
    sid = new_session(c)
    r = RawRing(c, sid)
    assert r.result["bytes"] == _ring.RING_BYTES and r.result["version"] == 1
    assert isinstance(r.result["ring"], int)
    import struct
    magic, version, nbytes, state = struct.unpack_from("<4I", r.mm, 0)
    assert (magic, version, nbytes, state) == (0x31474e52, 1, 4096, 0)
    assert "call ring %d opened" % r.result["ring"] in rdaemon.log_text()
    c.close()


@pytest.mark.parametrize("case", ["none", "two", "unsealed", "small", "pipe"])
def test_session_ring_refuses_a_bad_descriptor_naming_fd(rdaemon, case):
    c = rdaemon.client()
    sid = new_session(c)
    fds = []
    if case == "two":
        fds = [memfd(4096), memfd(4096)]
    elif case == "unsealed":
        fds = [memfd(4096, seals=0)]
    elif case == "small":
        fds = [memfd(1024)]
    elif case == "pipe":
        fds = list(os.pipe())[:1]
    r = request_fds(c, "session.ring", {"session": sid}, fds)
    for fd in fds:
        os.close(fd)
    e = err(r)
    assert e["code"] == -32602 and e["data"]["field"] == "fd", r
    # The session and the connection go on.
    assert c.call("session.plan", {"session": sid})["policy"] == "whole_bank"
    c.close()


def test_session_ring_of_an_unknown_session_is_not_found(rdaemon):
    c = rdaemon.client()
    fd = memfd(4096)
    r = request_fds(c, "session.ring", {"session": "0" * 32}, [fd])
    os.close(fd)
    assert err(r)["code"] == -32001
    c.close()


# ---- one contract, two transports ----

@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("routing", ["bank", "logits", "engine"])
def test_ring_calls_equal_socket_calls_bit_for_bit(rdaemon, precision, dt, routing):
    c = rdaemon.client()
    sid = new_session(c, precision=precision)
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    for T in (1, 2, 7, 64):
        x = hidden(T, seed=T)
        o_x, o_l = 0, up(T * H * 4)
        o_ids = o_l + up(T * E * 4)
        o_w = o_ids + up(T * E * 4)
        o_a = o_w + up(T * E * 4)
        o_b = o_a + up(T * H * 4)
        shm.put(o_x, as_bytes(x, dt))
        logits = ids = w = None
        if routing == "logits":
            lg = np.random.default_rng(T + 1).standard_normal((T, E)).astype(np.float32)
            shm.put(o_l, lg.tobytes())
            logits = ("f32", T, E, shm.id, o_l)
        elif routing == "engine":
            k = 3
            rng = np.random.default_rng(T + 2)
            sel = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype("<i4")
            sel[0, 1] = -1  # a dropped route
            shm.put(o_ids, sel.tobytes())
            shm.put(o_w, as_bytes(rng.random((T, k)), dt))
            ids = ("i32", T, k, shm.id, o_ids)
            w = (dt, T, k, shm.id, o_w)
        xs = (dt, T, H, shm.id, o_x)
        p, _ = both(sid, T % 2, xs, (shm.id, o_a), logits, ids, w)
        _, req = both(sid, T % 2, xs, (shm.id, o_b), logits, ids, w)
        r = c.request("session.infer", p)
        assert "result" in r, r
        code, stats, _, reason = ring.call(req)
        assert code == 0, reason
        n = T * H * SIZE[dt]
        assert shm.get(o_a, n) == shm.get(o_b, n), (precision, dt, routing, T)
        assert stats["hits"] == r["result"]["stats"]["hits"]
        assert stats["misses"] == r["result"]["stats"]["misses"] == 0
        assert stats["compute_us"] > 0 and stats["encode_us"] == 0
    c.close()


def test_a_fast_paged_sessions_reused_units_are_laid_out_after_answers(rdaemon):
    """A fast paged session's experts, reused while it hits, are laid out in
    the fast decode's r8 layout after ring answers (qm_pager_tidy): the
    telemetry counts their bytes, and every answer, before and after, is
    bitwise the whole-bank session's, through evictions."""
    c = rdaemon.client()
    bpe = next(m for m in c.call("model.list")["models"] if m["name"] == "small")[
        "bytes_per_expert"]
    whole = new_session(c, precision="fast")
    paged = new_session(c, precision="fast", policy="lru", budget_bytes=4 * bpe)
    shm_w, shm_p = Shm(c, whole, MAP_BYTES), Shm(c, paged, MAP_BYTES)
    ring_w, ring_p = RawRing(c, whole), RawRing(c, paged)
    rng = np.random.default_rng(17)
    o_l, o_out = up(H * 4), up(H * 4) + up(E * 4)
    # 300 calls of two hot experts per layer, with a cold pair every 25th
    # (evictions: a unit read again is in rows until laid out again)
    for i in range(300):
        hot = (0, 1) if i % 25 else tuple(rng.choice(np.arange(2, E), 2, replace=False))
        lg = rng.uniform(-2, 0, (1, E)).astype(np.float32)
        lg[0, hot[0]], lg[0, hot[1]] = 4.0, 3.0
        x = hidden(1, seed=100 + i)
        outs = []
        for shm, ring in ((shm_w, ring_w), (shm_p, ring_p)):
            shm.put(0, x.tobytes())
            shm.put(o_l, lg.tobytes())
            sid = whole if ring is ring_w else paged
            _, req = both(sid, i % 2, ("f32", 1, H, shm.id, 0), (shm.id, o_out),
                          ("f32", 1, E, shm.id, o_l))
            code, _, _, reason = ring.call(req)
            assert code == 0, reason
            outs.append(shm.get(o_out, H * 4))
        assert outs[0] == outs[1], i
    t = c.call("telemetry.get", {"session": paged})
    assert t["evictions"] > 0, t
    # Whether this CPU's fast kernel reads r8: the whole-bank session laid
    # its bank out at creation (its log line).
    r8 = re.search(r"session %s created: .* (\d+) laid out for the fast CPU decode" % whole,
                   rdaemon.log_text())
    if r8 and int(r8.group(1)) > 0:
        assert t["bytes_interleaved_paged"] > 0, t
    else:
        print("this CPU's fast kernel does not read r8: nothing laid out, checked")
        assert t["bytes_interleaved_paged"] == 0, t
    c.close()


def error_cases(sid, small, big, m):
    """(name, kwargs of both()) for requests each transport refuses."""
    T = 2
    x = ("f32", T, H, m, 0)
    out = (m, 4096)
    return [
        ("layer", dict(layer=9, x=x, out=out)),
        ("hidden cols", dict(layer=0, x=("f32", T, H + 1, m, 0), out=out)),
        ("unknown map", dict(layer=0, x=("f32", T, H, m + 1000, 0), out=out)),
        ("region outside", dict(layer=0, x=("f32", T, H, m, MAP_BYTES - 64), out=out)),
        ("offset alignment", dict(layer=0, x=("f32", T, H, m, 32), out=out)),
        ("output outside", dict(layer=0, x=x, out=(m, MAP_BYTES - 64))),
        ("output alignment", dict(layer=0, x=x, out=(m, 4100))),
        ("output unknown map", dict(layer=0, x=x, out=(m + 1000, 4096))),
        ("logits cols", dict(layer=0, x=x, out=out, logits=("f32", T, E + 1, m, 8192))),
        ("logits rows", dict(layer=0, x=x, out=out, logits=("f32", T + 1, E, m, 8192))),
        ("logits with topk", dict(layer=0, x=x, out=out, logits=("f32", T, E, m, 8192),
                                  ids=("i32", T, 2, m, 12288), w=("f32", T, 2, m, 16384))),
        ("topk id range", dict(layer=0, x=x, out=out, ids=("i32", T, 2, m, 20480),
                               w=("f32", T, 2, m, 16384))),
        ("topk repeated", dict(layer=0, x=x, out=out, ids=("i32", T, 2, m, 24576),
                               w=("f32", T, 2, m, 16384))),
        ("topk rows", dict(layer=0, x=x, out=out, ids=("i32", T + 1, 2, m, 12288),
                           w=("f32", T + 1, 2, m, 16384))),
        ("topk zero cols", dict(layer=0, x=x, out=out, ids=("i32", T, 0, m, 12288),
                                w=("f32", T, 0, m, 16384))),
        ("topk weights shape", dict(layer=0, x=x, out=out, ids=("i32", T, 2, m, 12288),
                                    w=("f32", T, 3, m, 16384))),
        ("topk too wide", dict(layer=0, x=x, out=out, ids=("i32", T, E + 1, m, 12288),
                               w=("f32", T, E + 1, m, 16384))),
    ]


def test_ring_errors_equal_the_sockets(rdaemon):
    c = rdaemon.client()
    sid = new_session(c)
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    shm.put(0, hidden(2).tobytes())
    shm.put(12288, np.array([[0, 1], [2, 3], [4, 5]], "<i4").tobytes())
    shm.put(16384, np.full((3, 3), 0.5, "<f4").tobytes())
    shm.put(20480, np.array([[0, E], [1, 2]], "<i4").tobytes())
    shm.put(24576, np.array([[3, 3], [1, 2]], "<i4").tobytes())
    for name, kw in error_cases(sid, "small", "big", shm.id):
        p, req = both(sid, kw["layer"], kw["x"], kw["out"], kw.get("logits"), kw.get("ids"),
                      kw.get("w"))
        want = socket_error(c.request("session.infer", p))
        code, _, field, reason = ring.call(req)
        assert (code, field, reason) == want, name
    # A bank without a router weight: router_logits are required, alike.
    sid2 = new_session(c, model="norouter")
    shm2 = Shm(c, sid2, MAP_BYTES)
    ring2 = RawRing(c, sid2)
    p, req = both(sid2, 0, ("f32", 1, H, shm2.id, 0), (shm2.id, 4096))
    want = socket_error(c.request("session.infer", p))
    code, _, field, reason = ring2.call(req)
    assert (code, field, reason) == want and want[1] == "router_logits"
    # After every refusal the ring still serves.
    p, req = both(sid, 0, ("f32", 2, H, shm.id, 0), (shm.id, 4096))
    assert ring.call(req)[0] == 0
    c.close()


@pytest.mark.parametrize("what,field", [("dtype", "hidden.dtype"), ("flags", "flags"),
                                        ("ids dtype", "topk_ids.dtype"),
                                        ("overflow", "hidden.shape")])
def test_what_only_the_ring_can_say_is_invalid_params_naming_it(rdaemon, what, field):
    c = rdaemon.client()
    sid = new_session(c)
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    _, req = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096),
                  ids=("i32", 1, 2, shm.id, 8192), w=("f32", 1, 2, shm.id, 12288))
    req = bytearray(req)
    if what == "dtype":
        req[16] = 7
    elif what == "flags":
        req[4] |= 0x10
    elif what == "ids dtype":
        req[96] = 0
    else:
        import struct
        struct.pack_into("<QQ", req, 24, 1 << 40, 1 << 40)
    code, _, got_field, reason = ring.call(bytes(req))
    assert code == -32602 and got_field == field, reason
    c.close()


def test_garbage_in_the_request_slot_fails_only_that_call(rdaemon):
    c = rdaemon.client()
    sid = new_session(c)
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    before = c.call("telemetry.get")["daemon"]["errors"]
    rng = np.random.default_rng(4)
    codes = set()
    n = 300
    for i in range(n):
        raw = bytearray(rng.integers(0, 256, 192, dtype=np.uint8).tobytes())
        if i % 2:  # mostly plausible: small numbers, some fields right
            _, good = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
            raw = bytearray(good)
            for _ in range(3):
                raw[int(rng.integers(0, 192))] = int(rng.integers(0, 256))
        code, _, _, _ = ring.call(bytes(raw), layer=int(rng.integers(0, 4)))
        codes.add(code)
    assert codes <= {0, -32602, -32001}, codes
    assert -32602 in codes
    after = c.call("telemetry.get")["daemon"]["errors"]
    assert after > before
    # A good call afterwards, on the ring and on another connection.
    shm.put(0, hidden(1).tobytes())
    p, req = both(sid, 1, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
    _, req2 = both(sid, 1, ("f32", 1, H, shm.id, 0), (shm.id, 8192))
    assert c.request("session.infer", p)["result"]
    assert ring.call(req2)[0] == 0
    assert shm.get(4096, H * 4) == shm.get(8192, H * 4)
    c2 = rdaemon.client()
    assert c2.call("daemon.status")["sessions"] >= 1
    c2.close()
    c.close()


def test_a_writer_racing_the_daemons_reads_fails_only_its_calls(rdaemon):
    """tests/daemon/ring_racer.c: a thread rewrites the request slot while
    2000 calls are rung; each is answered 0, -32602 or -32001, and the valid
    call afterwards gives the socket's bits."""
    from qmoed_harness import BUILD
    import json
    r = subprocess.run([os.path.join(BUILD, "tests", "daemon", "ring_racer"), rdaemon.socket,
                        "small", "2000"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["ok"] + seen["invalid_params"] + seen["not_found"] == 2000
    assert seen["invalid_params"] > 0
    c = rdaemon.client()
    assert c.call("daemon.status")["models"] >= 1
    c.close()


# ---- order, counting ----

def test_ring_and_socket_calls_interleaved_keep_the_sessions_order(rdaemon):
    """A paged session's hits and misses depend on the order of its calls:
    alternating transports gives the sequence an all-socket session gives."""
    c = rdaemon.client()
    per_expert = [m for m in c.call("model.list")["models"] if m["name"] == "small"][0]
    budget = 3 * per_expert["bytes_per_expert"]

    def run(use_ring):
        # Both sessions start cold: a warm start from the model's hotness
        # profile would differ between them (the first one's calls, and the
        # racer's, whose successes depend on timing, are in the profile).
        sid = new_session(c, policy="lru", budget_bytes=budget,
                          policy_params={"prefetch": False, "warm_from_profile": False})
        shm = Shm(c, sid, MAP_BYTES)
        ring = RawRing(c, sid) if use_ring else None
        seen, outs = [], []
        for i in range(24):
            x = hidden(1 + i % 3, seed=i)
            shm.put(0, x.tobytes())
            p, req = both(sid, i % 2, ("f32", x.shape[0], H, shm.id, 0), (shm.id, 8192))
            if use_ring and i % 2:
                code, st, _, reason = ring.call(req)
                assert code == 0, reason
            else:
                st = c.call("session.infer", p)["stats"]
            seen.append((st["hits"], st["misses"]))
            outs.append(shm.get(8192, x.shape[0] * H * 4))
        tele = c.call("telemetry.get", {"session": sid})
        c.call("session.close", {"session": sid})
        return seen, outs, tele

    mixed, mixed_out, tm = run(True)
    plain, plain_out, tp = run(False)
    assert mixed == plain
    assert mixed_out == plain_out
    for k in ("requests", "tokens", "expert_hits", "expert_misses", "bytes_paged_h2d"):
        assert tm[k] == tp[k], k
    c.close()


def test_concurrent_ring_and_socket_calls_of_one_session_run_one_at_a_time(rdaemon):
    """A ring on one connection and pipelined socket calls on another: every
    output is the reference's (the pagers were never shared), every call
    counted once."""
    c = rdaemon.client()
    per_expert = [m for m in c.call("model.list")["models"] if m["name"] == "small"][0]
    sid = new_session(c, policy="lru", budget_bytes=2 * per_expert["bytes_per_expert"])
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    x = hidden(4, seed=3)
    shm.put(0, x.tobytes())
    shm.put(4096, x.tobytes())
    ref = {}
    for layer in (0, 1):
        p, _ = both(sid, layer, ("f32", 4, H, shm.id, 0), (shm.id, 65536 + layer * 4096))
        c.call("session.infer", p)
        ref[layer] = shm.get(65536 + layer * 4096, 4 * H * 4)
    before = c.call("telemetry.get", {"session": sid})["requests"]
    n_sock, n_ring = 40, 40
    c2 = rdaemon.client()
    import json
    lines = []
    for i in range(n_sock):
        p, _ = both(sid, i % 2, ("f32", 4, H, shm.id, 4096), (shm.id, 131072 + i * 1024))
        lines.append(json.dumps({"jsonrpc": "2.0", "id": i + 1, "method": "session.infer",
                                 "params": p}))
    c2.send_raw(("\n".join(lines) + "\n").encode())
    for i in range(n_ring):
        _, req = both(sid, i % 2, ("f32", 4, H, shm.id, 0), (shm.id, 262144 + i * 1024))
        assert ring.call(req)[0] == 0
        assert shm.get(262144 + i * 1024, 4 * H * 4) == ref[i % 2]
    for i in range(n_sock):
        assert "result" in c2.read()
    for i in range(n_sock):
        assert shm.get(131072 + i * 1024, 4 * H * 4) == ref[i % 2], i
    after = c.call("telemetry.get", {"session": sid})["requests"]
    assert after - before == n_sock + n_ring
    c2.close()
    c.close()


def test_ring_calls_are_counted_and_traced_as_socket_calls_are(rdaemon):
    """The same four calls (one refused) through each transport move the
    session's and the daemon's counters alike and leave the same spans."""
    c = rdaemon.client()

    def run(use_ring):
        sid = new_session(c)
        shm = Shm(c, sid, MAP_BYTES)
        ring = RawRing(c, sid) if use_ring else None
        shm.put(0, hidden(3).tobytes())
        t0 = c.call("telemetry.get", {"session": sid})
        d0 = c.call("telemetry.get")["daemon"]
        for layer in (0, 1, 0, 5):
            p, req = both(sid, layer, ("f32", 3, H, shm.id, 0), (shm.id, 4096))
            if use_ring:
                code = ring.call(req)[0]
            else:
                r = c.request("session.infer", p)
                code = r["error"]["code"] if "error" in r else 0
            assert code == (-32602 if layer == 5 else 0)
        t1 = c.call("telemetry.get", {"session": sid})  # behind the session's work
        d1 = c.call("telemetry.get")["daemon"]
        spans = [s for s in c.call("telemetry.trace", {"session": sid})["spans"]
                 if s["name"] == "session.infer"]
        delta = {k: t1[k] - t0[k] for k in ("requests", "errors", "tokens", "expert_hits",
                                              "expert_misses")}
        ddelta = {k: d1[k] - d0[k] for k in ("requests", "errors", "tokens", "expert_hits")}
        return delta, ddelta, [(s["args"]["layer"], s["args"]["tokens"], s["args"]["hits"])
                               for s in spans], t1["p50_us"]

    ring_counts, ring_daemon, ring_spans, p50 = run(True)
    sock_counts, sock_daemon, sock_spans, _ = run(False)
    assert ring_counts == sock_counts and ring_counts["requests"] == 3
    assert ring_daemon == sock_daemon and ring_daemon["errors"] == 1
    assert ring_spans == sock_spans and len(ring_spans) == 3
    assert p50 > 0
    c.close()


# ---- the ring's end ----

def test_session_close_closes_its_ring_with_not_found(rdaemon):
    c = rdaemon.client()
    pid = rdaemon.proc.pid
    assert wait_for(lambda: ring_threads(pid) == 0)  # the earlier tests' rings are gone
    base = 0
    sid = new_session(c)
    shm = Shm(c, sid, MAP_BYTES)
    ring = RawRing(c, sid)
    assert wait_for(lambda: ring_threads(pid) == base + 1)
    c.call("session.close", {"session": sid})
    assert wait_for(lambda: ring.ring.closed() is not None)
    code, reason = ring.ring.closed()
    assert code == -32001 and "closed" in reason
    _, req = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
    with pytest.raises(_ring.RingClosed) as e:
        ring.call(req)
    assert e.value.code == -32001
    assert wait_for(lambda: ring_threads(pid) == base)
    c.close()


def test_a_second_ring_on_one_connection_replaces_the_first(rdaemon):
    """One ring per session and connection: session.ring again on the same
    connection closes the ring it had (conflict) and its thread ends, so a
    connection cannot hold every ring of the daemon for one session (before,
    64 session.ring calls took all of max_rings, 64 threads, and other
    clients' rings were refused). Another connection's ring of the same
    session stays."""
    c, other = rdaemon.client(), rdaemon.client()
    pid = rdaemon.proc.pid
    assert wait_for(lambda: ring_threads(pid) == 0)  # the earlier tests' rings are gone
    sid = new_session(c)
    shm = Shm(c, sid, MAP_BYTES)
    theirs = RawRing(other, sid)
    first = RawRing(c, sid)
    for _ in range(10):
        last = RawRing(c, sid)
    assert wait_for(lambda: ring_threads(pid) == 2), ring_threads(pid)
    code, reason = first.ring.closed()
    assert code == -32008 and "another call ring" in reason, (code, reason)
    _, req = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
    shm.put(0, hidden(1).tobytes())
    assert last.call(req)[0] == 0
    assert theirs.call(req)[0] == 0
    assert "call ring %d replaced" % first.result["ring"] in rdaemon.log_text()
    # A session.ring that fails (no descriptor) replaces nothing.
    e = err(request_fds(c, "session.ring", {"session": sid}, []))
    assert e["code"] == -32602 and e["data"]["field"] == "fd", e
    assert last.ring.closed() is None and last.call(req)[0] == 0
    c.call("session.close", {"session": sid})
    assert wait_for(lambda: ring_threads(pid) == 0)
    c.close()
    other.close()


def test_a_waiter_is_woken_with_not_found_when_the_model_is_unloaded(rdaemon, bigbank):
    admin = rdaemon.client()
    admin.call("model.load", {"name": "big2", "path": bigbank})
    sid = new_session(admin, model="big2")
    shm = Shm(admin, sid, 16 << 20)
    ring = RawRing(admin, sid)
    slow = slow_socket_call(rdaemon, sid, shm, calls=4)
    time.sleep(0.1)
    shm.put(8 << 20, np.zeros((1, 2048), np.float32).tobytes())
    _, req = both(sid, 0, ("f32", 1, 2048, shm.id, 8 << 20), (shm.id, 12 << 20))
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("r", ring.call(req)))
    th.start()
    time.sleep(0.1)
    assert th.is_alive(), "the ring call should wait behind the slow one"
    admin.call("model.unload", {"name": "big2", "force": True})
    th.join(30)
    assert not th.is_alive()
    code, _, field, reason = got["r"]
    assert code == -32001 and field == "session", reason
    assert wait_for(lambda: ring.ring.closed() is not None)
    assert ring.ring.closed()[0] == -32001
    slow.read()  # the call that ran finishes (its answer)
    slow.close()
    admin.close()


def test_a_closed_connection_ends_its_ring_and_wakes_the_waiter(banks, bigbank):
    dm = Daemon(models={"big": bigbank},
                args=["--session-orphan-timeout", "1"])
    try:
        pid = dm.proc.pid
        base = ring_threads(pid)
        a = dm.client()
        sid = new_session(a, model="big")
        shm = Shm(a, sid, 16 << 20)
        ring = RawRing(a, sid)
        assert wait_for(lambda: ring_threads(pid) == base + 1)
        slow = slow_socket_call(dm, sid, shm, calls=4)
        time.sleep(0.1)
        _, req = both(sid, 0, ("f32", 1, 2048, shm.id, 8 << 20), (shm.id, 12 << 20))
        got = {}

        # The waiter's call queues behind the slow calls, which run to the
        # end (another connection's): with QMOE_KERNEL=scalar those take
        # longer than the client's default 30 s.
        def waiter():
            try:
                got["r"] = ring.call(req, sock_fd=-1, timeout=180)
            except _ring.RingClosed as e:
                got["closed"] = e.code
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.1)
        a.sock.shutdown(socket.SHUT_RDWR)
        a.close()
        th.join(200)
        assert not th.is_alive()
        assert got.get("closed") == _ring.CLOSED_CONN, got
        slow.read()
        slow.close()
        # Nobody left: the session is reclaimed, the ring's thread is gone.
        c = dm.client()
        assert wait_for(lambda: c.call("session.list")["sessions"] == [], 15)
        assert wait_for(lambda: ring_threads(pid) == base)
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_drain_lets_a_waiting_ring_call_finish_then_closes_the_ring(banks, bigbank):
    # The slow call may take many seconds under a sanitizer: the drain waits.
    dm = Daemon(models={"big": bigbank}, args=["--set", "drain_timeout_s=600"])
    a = dm.client()
    sid = new_session(a, model="big")
    shm = Shm(a, sid, 16 << 20)
    ring = RawRing(a, sid)
    slow = slow_socket_call(dm, sid, shm)
    time.sleep(0.1)
    x = np.random.default_rng(1).standard_normal((1, 2048)).astype(np.float32)
    shm.put(8 << 20, x.tobytes())
    _, req = both(sid, 0, ("f32", 1, 2048, shm.id, 8 << 20), (shm.id, 12 << 20))
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("r", ring.call(req)))
    th.start()
    time.sleep(0.5)  # the ring's thread has taken the call (it waits behind the slow one)
    dm.signal(signal.SIGTERM)
    th.join(30)
    assert got["r"][0] == 0, got  # accepted before the drain: answered
    assert "result" in slow.read()
    assert wait_for(lambda: ring.ring.closed() is not None)
    assert ring.ring.closed()[0] == -32007
    with pytest.raises(_ring.RingClosed) as e:
        ring.call(req, sock_fd=-1)
    assert e.value.code == -32007
    slow.close()
    a.close()
    rc = dm.proc.wait(120)  # the drain ends by itself
    dm.stop()
    assert rc == 0, dm.log_text()


def test_sigterm_amid_back_to_back_ring_calls_exits_clean(banks):
    """A ring's thread may take a call as the drain ends: the loop has
    stopped and never takes that job back. The daemon still exits 0 and
    gives back what the job held (under ASan its LeakSanitizer reported the
    session, its pool and its model until qm_pool_stop discarded them).
    The signal lands at several points of a stream of calls."""
    for delay in (0.01, 0.02, 0.05, 0.08, 0.12, 0.2, 0.35):
        dm = Daemon(models={"small": banks["small"]})
        a = dm.client()
        sid = new_session(a)
        shm = Shm(a, sid, MAP_BYTES)
        ring = RawRing(a, sid)
        shm.put(0, hidden(1, seed=3).tobytes())
        _, req = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
        codes = []
        first = threading.Event()

        def hammer():
            while True:
                try:
                    codes.append(ring.call(req, timeout=30)[0])
                    first.set()
                except _ring.RingClosed as e:
                    codes.append(("closed", e.code))
                    return
                except Exception as e:  # noqa: BLE001 - the assertion shows it
                    codes.append(repr(e))
                    first.set()
                    return

        th = threading.Thread(target=hammer)
        th.start()
        assert first.wait(60), codes  # calls are flowing (slow machines, sanitizers)
        time.sleep(delay)
        dm.signal(signal.SIGTERM)
        th.join(60)
        assert not th.is_alive()
        a.close()
        rc = dm.proc.wait(120)
        dm.stop()
        assert rc == 0, (delay, dm.log_text())
        answered = [c for c in codes if c == 0]
        assert answered and codes[-1] == ("closed", -32007), (delay, codes[-3:])
        assert len(answered) == len(codes) - 1, (delay, [c for c in codes if c != 0])


def test_a_client_killed_mid_call_leaves_no_thread_behind(banks, bigbank):
    dm = Daemon(models={"big": bigbank}, args=["--session-orphan-timeout", "1"])
    try:
        pid = dm.proc.pid
        base = ring_threads(pid)
        script = textwrap.dedent("""
            import sys, numpy as np
            sys.path.insert(0, %r)
            from qmoe_client import Client
            c = Client(%r, close_sessions_at_exit=False)
            sid = c.create_session("big")["session"]
            shm = c.map(sid, 16 << 20)
            x = shm.tensor(0, (128, 2048), "f32")
            x.array[:] = np.random.default_rng(0).standard_normal((128, 2048))
            out = shm.tensor(8 << 20, (128, 2048), "f32")
            c.infer(sid, 0, x, output_to=out)  # opens the ring
            print("calling", flush=True)
            c.infer(sid, 0, x, output_to=out)
            print("done", flush=True)
        """ % (PYCLIENT, dm.socket))
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "calling"
        time.sleep(0.05)
        p.kill()
        p.wait()
        c = dm.client()
        # The daemon serves meanwhile, and once the call is through nothing
        # of the client is left: no ring thread, no session.
        assert c.call("daemon.status")["models"] == 1
        assert wait_for(lambda: c.call("session.list")["sessions"] == [], 30)
        assert wait_for(lambda: ring_threads(pid) == base, 10), (ring_threads(pid), base)
        assert "reclaimed" in dm.log_text()
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


# ---- cost ----

def warm_rings(c, n):
    """n sessions with a ring each, 20 calls back to back on every ring (the
    threads learn to spin): [(session, its Shm, its RawRing, a request)]."""
    rings = []
    for _ in range(n):
        sid = new_session(c)
        shm = Shm(c, sid, MAP_BYTES)
        r = RawRing(c, sid)
        shm.put(0, hidden(1).tobytes())
        _, req = both(sid, 0, ("f32", 1, H, shm.id, 0), (shm.id, 4096))
        for _ in range(20):
            assert r.call(req)[0] == 0
        rings.append((sid, shm, r, req))
    return rings


def test_open_idle_rings_use_no_cpu(rdaemon):
    c = rdaemon.client()
    rings = warm_rings(c, 4)  # noqa: F841 (kept open)
    time.sleep(0.5)  # any spin after the last call is over by now
    t0 = cpu_ticks(rdaemon.proc.pid)
    time.sleep(3)
    used = cpu_ticks(rdaemon.proc.pid) - t0
    assert used <= 1, "%d clock ticks in 3 s with 4 idle rings" % used
    c.close()


def test_an_idle_daemon_with_open_rings_never_wakes(banks):
    """No timer ticks while nothing can expire: with rings open (their
    connection spared by idle_timeout_s), no auto budget and no call, not
    one of the daemon's threads is woken in 2 s (the loop used to wake
    every second, the memory watcher too)."""
    dm = Daemon(models={"small": banks["small"]})
    try:
        c = dm.client()
        rings = warm_rings(c, 2)
        time.sleep(1.5)  # spins over; the watcher's first check found no auto budget
        before = wakeups(dm.proc.pid)
        time.sleep(2)
        after = wakeups(dm.proc.pid)
        woke = {t: after[t] - before[t] for t in after if t in before and after[t] != before[t]}
        assert not woke, "threads woken while idle (tid: times): %s" % woke
        # And the rings still answer.
        assert all(r.call(req)[0] == 0 for _, _, r, req in rings)
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def daemon_awake(ring):
    """The daemon's thread is not parked on the doorbell (it spins): a
    client ringing now would need no futex wake."""
    return int.from_bytes(ring.mm[_ring.OFF_DAEMON_PARKED:_ring.OFF_DAEMON_PARKED + 4],
                          "little") == 0


def test_an_anticipating_ring_is_awake_for_its_calls_and_then_sleeps(banks):
    """session.ring's `anticipate`: the thread learns the gap after each
    layer's call and is awake (spinning, DAEMON_PARKED 0) when the next one
    is due, as a plain ring is not (calls 3 ms apart: far more than it
    spins); the answers are the socket's, bit for bit; once calls stop it
    sleeps, and no thread of the daemon wakes while it is idle."""
    dm = Daemon(models={"small": banks["small"]})
    try:
        c = dm.client()
        awake = {}
        for anticipate in (False, True):
            sid = new_session(c)
            shm = Shm(c, sid, MAP_BYTES)
            r = RawRing(c, sid, **({"anticipate": True} if anticipate else {}))
            x = hidden(1, seed=5)
            shm.put(0, x.tobytes())
            n = 0
            # 60 calls; the anticipating ring up to 180 until it was seen
            # awake 3 times (a loaded machine's sleeps jitter).
            for i in range(180 if anticipate else 60):
                if i >= 60 and n >= 3:
                    break
                p, req = both(sid, i % 2, ("f32", 1, H, shm.id, 0), (shm.id, 8192))
                time.sleep(0.003)
                n += daemon_awake(r)  # just before the call rings
                code, _, _, reason = r.call(req)
                assert code == 0, reason
                if i % 20 == 19:  # the socket's answer, bit for bit
                    p["output_to"] = {"map": shm.id, "offset": 16384}
                    assert "result" in c.request("session.infer", p)
                    assert shm.get(8192, H * 4) == shm.get(16384, H * 4)
            awake[anticipate] = n
        # Timing on a shared machine: the anticipating thread is found awake
        # (machine B: 4-19 times in 60 calls, the plain one never); the
        # plain one parks between calls 3 ms apart.
        assert awake[True] >= 1 and awake[False] < 30, awake
        assert "(anticipating its calls)" in dm.log_text()
        time.sleep(1.5)  # past every window, and the loop counted the calls
        before = wakeups(dm.proc.pid)
        time.sleep(1)
        after = wakeups(dm.proc.pid)
        woke = {t: after[t] - before[t] for t in after if t in before and after[t] != before[t]}
        assert not woke, "threads woken while idle (tid: times): %s" % woke
        r = c.request("session.ring", {"session": sid, "anticipate": "yes"})
        assert err(r)["code"] == -32602 and err(r)["data"]["field"] == "anticipate", r
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


# ---- refusals, and clients that fall back ----

def test_the_python_client_asks_for_anticipation_and_does_without_on_an_older_daemon(banks):
    """Client.ring_anticipate True: the rings it opens carry `anticipate`;
    a daemon that names the member unknown (one older than it) gets the
    plain session.ring, and the calls take a ring all the same."""
    from qmoe_client import Client, QmoeError
    dm = Daemon(models={"small": banks["small"]})
    try:
        outs = []
        for older in (False, True):
            cl = Client(dm.socket)
            cl.ring_anticipate = True
            asked = []
            if older:
                call = cl.call

                def refusing(method, params=None, fd=None):
                    asked.append(dict(params or {}))
                    if method == "session.ring" and "anticipate" in (params or {}):
                        raise QmoeError(-32602, "invalid_params",
                                        "unknown member 'anticipate'; expected session", "anticipate")
                    return call(method, params, fd=fd)
                cl.call = refusing
            s = cl.create_session("small")["session"]
            shm = cl.map(s, 1 << 16)
            x = shm.tensor(0, (1, H), "f32")
            x.array[:] = hidden(1)
            out = shm.tensor(4096, (1, H), "f32")
            for _ in range(3):
                cl.infer(s, 0, x, output_to=out)
            assert cl.ring_active(s)
            outs.append(out.array.copy())
            if older:
                rings = [p for p in asked if "session" in p and len(p) <= 2 and "anticipate" in p]
                assert rings, asked  # it asked, was refused, and opened the ring without
            cl.close_session(s)
            cl.close()
        assert dm.log_text().count("(anticipating its calls)") == 1
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_a_connection_at_max_rings_may_open_its_ring_again(banks):
    """The ring a session.ring replaces does not count against max_rings:
    at max_rings 1 the connection holding the one ring opens it again; a
    ring of another connection is still refused."""
    dm = Daemon(models={"small": banks["small"]}, args=["--set", "max_rings=1"])
    try:
        c, other = dm.client(), dm.client()
        sid = new_session(c)
        first = RawRing(c, sid)
        again = RawRing(c, sid)
        assert wait_for(lambda: first.ring.closed() is not None)
        assert first.ring.closed()[0] == -32008 and again.ring.closed() is None
        fd = memfd(_ring.RING_BYTES)
        e = err(request_fds(other, "session.ring", {"session": sid}, [fd]))
        os.close(fd)
        assert e["code"] == -32003 and "max_rings" in e["message"] + json.dumps(e.get("data")), e
        c.call("session.close", {"session": sid})
        c.close()
        other.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_max_rings_refuses_and_the_python_client_falls_back_to_the_socket(banks, capfd):
    from qmoe_client import Client
    dm = Daemon(models={"small": banks["small"]}, args=["--set", "max_rings=1"])
    try:
        c1, c2 = Client(dm.socket), Client(dm.socket)
        s1 = c1.create_session("small")["session"]
        s2 = c2.create_session("small")["session"]
        outs = []
        for cl, s in ((c1, s1), (c2, s2)):
            shm = cl.map(s, 1 << 16)
            x = shm.tensor(0, (2, H), "f32")
            x.array[:] = hidden(2)
            out = shm.tensor(4096, (2, H), "f32")
            r = cl.infer(s, 0, x, output_to=out)
            assert r.stats["hits"] > 0
            outs.append(out.array.copy())
        assert c1.ring_active(s1) and not c2.ring_active(s2)
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
        assert "no call ring for session %s (resource_exhausted" % s2 in capfd.readouterr().err
        assert "max_rings" in dm.log_text()
        c1.close_session(s1)
        c2.close_session(s2)
        c1.close()
        c2.close()
    finally:
        assert dm.stop() == 0, dm.log_text()
