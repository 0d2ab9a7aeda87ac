"""qmoed over the wire, shared-memory tensors (PROTOCOL.md "Shared-memory
tensors"): session.map with a sealed memfd passed by SCM_RIGHTS,
session.unmap, mapped inputs and output_to, bit-identical to base64 in every
dtype; every bad descriptor, region and map id answered as documented; no
descriptor or mapping left behind; a client killed mid-use harms nobody.
"""
import base64
import fcntl
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

from qmoed_harness import Daemon, memfd
from qmoed_suite import E, H, Shm, as_bytes, err, hidden, map_fd, new_session, request_fds

HERE = os.path.dirname(os.path.abspath(__file__))
PYCLIENT = os.path.join(HERE, "..", "..", "clients", "python")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def mapped_regions(pid, name="test-map"):
    with open("/proc/%d/maps" % pid) as f:
        return sum(1 for line in f if ("memfd:" + name) in line)


def b64(raw, dtype, shape):
    return {"dtype": dtype, "shape": list(shape), "data": base64.b64encode(raw).decode()}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_mapped_inputs_and_output_equal_base64_bit_for_bit(daemon, dtype):
    c = daemon.client()
    sid = new_session(c)
    shm = Shm(c, sid, 1 << 16)
    T = 5
    raw = as_bytes(hidden(T, seed=3), dtype)
    shm.put(128, raw)
    want = c.call("session.infer", {"session": sid, "layer": 1,
                                    "hidden": b64(raw, dtype, (T, H)), "return_routing": True})
    # mapped hidden, base64 output
    r1 = c.call("session.infer", {"session": sid, "layer": 1, "return_routing": True,
                                  "hidden": {"dtype": dtype, "shape": [T, H], "map": shm.id,
                                             "offset": 128}})
    assert r1["output"] == want["output"] and r1["routing"] == want["routing"]
    # mapped hidden and output_to
    out_off = 128 + ((len(raw) + 63) // 64) * 64
    r2 = c.call("session.infer", {"session": sid, "layer": 1,
                                  "hidden": {"dtype": dtype, "shape": [T, H], "map": shm.id,
                                             "offset": 128},
                                  "output_to": {"map": shm.id, "offset": out_off}})
    assert r2["output"] == {"dtype": dtype, "shape": [T, H], "map": shm.id, "offset": out_off}
    assert shm.get(out_off, len(raw)) == base64.b64decode(want["output"]["data"])
    # base64 hidden, output_to; and output_to over hidden itself (in place)
    r3 = c.call("session.infer", {"session": sid, "layer": 1, "hidden": b64(raw, dtype, (T, H)),
                                  "output_to": {"map": shm.id, "offset": 32768}})
    assert r3["output"]["map"] == shm.id
    assert shm.get(32768, len(raw)) == base64.b64decode(want["output"]["data"])
    c.call("session.infer", {"session": sid, "layer": 1,
                             "hidden": {"dtype": dtype, "shape": [T, H], "map": shm.id,
                                        "offset": 128},
                             "output_to": {"map": shm.id, "offset": 128}})
    assert shm.get(128, len(raw)) == base64.b64decode(want["output"]["data"])
    c.call("session.close", {"session": sid})
    c.close()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_mapped_router_logits_equal_base64(daemon, banks, dtype):
    c = daemon.client()
    c.call("model.load", {"name": "nr-" + dtype, "path": banks["norouter"]})
    try:
        sid = c.call("session.create", {"model": "nr-" + dtype})["session"]
        shm = Shm(c, sid, 8192)
        T = 3
        x = as_bytes(hidden(T, seed=4), dtype)
        lg = as_bytes(np.random.default_rng(2).standard_normal((T, E)), dtype)
        shm.put(0, x)
        shm.put(4096, lg)
        want = c.call("session.infer", {"session": sid, "layer": 0, "hidden": b64(x, dtype, (T, H)),
                                        "router_logits": b64(lg, dtype, (T, E))})
        got = c.call("session.infer", {
            "session": sid, "layer": 0,
            "hidden": {"dtype": dtype, "shape": [T, H], "map": shm.id, "offset": 0},
            "router_logits": {"dtype": dtype, "shape": [T, E], "map": shm.id, "offset": 4096}})
        assert got["output"] == want["output"]
    finally:
        c.call("model.unload", {"name": "nr-" + dtype, "force": True})


def test_bad_descriptors_are_invalid_params_on_fd_and_closed(daemon):
    c = daemon.client()
    sid = new_session(c)
    pid = daemon.proc.pid
    before = open_fds(pid)
    n = 4096

    def expect_fd_error(fds, nbytes=n, why=None):
        r = request_fds(c, "session.map", {"session": sid, "bytes": nbytes}, fds)
        e = err(r)
        assert e["code"] == -32602 and e["data"]["field"] == "fd", e
        if why:
            assert why in e["data"]["reason"], e
        for fd in fds:
            os.close(fd)
        return e

    expect_fd_error([], why="no descriptor")
    expect_fd_error([memfd(n), memfd(n)], why="2 descriptors")
    expect_fd_error([memfd(n, seals=0)], why="not sealed")
    expect_fd_error([memfd(n, seals=fcntl.F_SEAL_SHRINK)], why="F_SEAL_SEAL")
    expect_fd_error([memfd(n, seals=fcntl.F_SEAL_SEAL)], why="F_SEAL_SHRINK")
    expect_fd_error([memfd(n)], nbytes=n + 1, why="too small")
    expect_fd_error([memfd(n, seals=SEALS | fcntl.F_SEAL_WRITE)], why="read-write")
    r, w = os.pipe()
    expect_fd_error([r, w], why="2 descriptors")
    r, w = os.pipe()
    os.close(w)
    expect_fd_error([r], why="pipe")
    f = tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(__file__)))
    expect_fd_error([os.dup(f.fileno())], why="memfd")
    f.close()
    a, b = socket.socketpair()
    expect_fd_error([a.detach()], why="socket")
    b.close()
    # A descriptor sent with another method is closed, not kept.
    fd = memfd(n)
    assert "result" in request_fds(c, "session.list", {}, [fd])
    # ...and so is one sent with a bad session.map request.
    r = request_fds(c, "session.map", {"session": sid, "bytes": n, "oops": 1}, [fd])
    assert err(r)["code"] == -32602 and err(r)["data"]["field"] == "oops"
    r = request_fds(c, "session.map", {"session": "0" * 32, "bytes": n}, [fd])
    assert err(r)["code"] == -32001
    os.close(fd)
    c.call("daemon.status")
    assert open_fds(pid) == before
    assert mapped_regions(pid) == 0
    c.call("session.close", {"session": sid})
    c.close()


def test_bad_regions_and_map_ids(daemon):
    c = daemon.client()
    sid = new_session(c)
    other = new_session(c)
    shm = Shm(c, sid, 4096)
    theirs = Shm(c, other, 4096)
    T = 2
    nb = T * H * 4
    shm.put(0, hidden(T).tobytes())

    def infer(hid, **extra):
        p = {"session": sid, "layer": 0, "hidden": hid}
        p.update(extra)
        return c.request("session.infer", p)

    def mt(offset, m=None, shape=(T, H)):
        return {"dtype": "f32", "shape": list(shape), "map": shm.id if m is None else m,
                "offset": offset}

    cases = [
        (mt(32), -32602, "hidden.offset"),                 # not a multiple of 64
        (mt(4096 - 64), -32602, "hidden.offset"),          # runs past the end
        (mt(1 << 40), -32602, "hidden.offset"),            # starts past the end
        (mt(0, shape=(100, H)), -32602, "hidden.offset"),  # too big for the map
        (mt(0, m=theirs.id), -32001, "hidden.map"),        # another session's map
        (mt(0, m=987654), -32001, "hidden.map"),           # no such map
        ({"dtype": "f32", "shape": [T, H], "map": shm.id}, -32602, "hidden.offset"),
        ({"dtype": "f32", "shape": [T, H], "map": -1, "offset": 0}, -32602, "hidden.map"),
        ({"dtype": "f32", "shape": [T, H], "map": shm.id, "offset": 0, "data": ""}, -32602,
         "hidden.data"),
    ]
    for hid, code, field in cases:
        e = err(infer(hid))
        assert (e["code"], e["data"]["field"]) == (code, field), (hid, e)
    for out, code, field in [({"map": shm.id, "offset": 4096 - 64}, -32602, "output_to.offset"),
                             ({"map": shm.id, "offset": 1}, -32602, "output_to.offset"),
                             ({"map": theirs.id, "offset": 0}, -32001, "output_to.map"),
                             ({"map": shm.id}, -32602, "output_to.offset"),
                             ({"map": shm.id, "offset": 0, "x": 1}, -32602, "output_to.x"),
                             ([1], -32602, "output_to")]:
        e = err(infer(mt(0), output_to=out))
        assert (e["code"], e["data"]["field"]) == (code, field), (out, e)
    assert "result" in infer(mt(0), output_to={"map": shm.id, "offset": nb})
    # unmap: unknown ids, another session's id, then use after unmap
    e = err(c.request("session.unmap", {"session": sid, "map": theirs.id}))
    assert e["code"] == -32001 and e["data"]["field"] == "map"
    assert c.call("session.unmap", {"session": sid, "map": shm.id}) == {}
    e = err(infer(mt(0)))
    assert e["code"] == -32001 and e["data"]["field"] == "hidden.map"
    e = err(c.request("session.unmap", {"session": sid, "map": shm.id}))
    assert e["code"] == -32001
    c.call("session.close", {"session": sid})
    c.call("session.close", {"session": other})
    time.sleep(0.1)
    assert mapped_regions(daemon.proc.pid) == 0
    c.close()


def test_truncating_a_mapped_memfd_is_refused_by_the_kernel(daemon):
    c = daemon.client()
    sid = new_session(c)
    fd = memfd(8192)
    r = map_fd(c, sid, fd, 8192)
    mid = r["result"]["map"]
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    mm = mmap.mmap(fd, 8192)
    os.close(fd)
    mm[0:T_BYTES] = hidden(1).tobytes()
    r = c.call("session.infer", {"session": sid, "layer": 0,
                                 "hidden": {"dtype": "f32", "shape": [1, H], "map": mid,
                                            "offset": 0}})
    assert r["output"]["shape"] == [1, H]
    c.call("session.close", {"session": sid})
    c.close()


T_BYTES = H * 4


def test_max_mapped_bytes_is_resource_exhausted(banks):
    dm = Daemon(models={"small": banks["small"]}, args=["--set", "max_mapped_bytes=65536"])
    try:
        c = dm.client()
        sid = new_session(c)
        before = open_fds(dm.proc.pid)
        a = memfd(49152)
        assert "result" in map_fd(c, sid, a, 49152)
        b = memfd(32768)
        e = err(map_fd(c, sid, b, 32768))
        assert e["code"] == -32003 and "max_mapped_bytes" in e["data"]["reason"], e
        assert "result" in map_fd(c, sid, b, 16384)  # exactly up to the limit
        os.close(a)
        os.close(b)
        assert open_fds(dm.proc.pid) == before
        assert mapped_regions(dm.proc.pid) == 2
        # another session has its own allowance
        other = new_session(c)
        f = memfd(65536)
        assert "result" in map_fd(c, other, f, 65536)
        os.close(f)
        # closing a session releases its maps
        c.call("session.close", {"session": sid})
        c.call("session.close", {"session": other})
        assert mapped_regions(dm.proc.pid) == 0
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_python_client_zero_copy(daemon):
    sys.path.insert(0, PYCLIENT)
    import qmoe_client

    with qmoe_client.Client(daemon.socket) as cl:
        sid = cl.create_session("small")["session"]
        shm = cl.map(sid, 1 << 16)
        x = shm.alloc((4, H), "f32")
        y = shm.alloc((4, H), "f32")
        x.array[:] = hidden(4, seed=8)
        want = cl.infer(sid, 0, hidden(4, seed=8)).output
        got = cl.infer(sid, 0, x, output_to=y)
        assert isinstance(got.output, np.ndarray)
        assert got.output.tobytes() == want.tobytes()
        # the result is a view on the map: no copy
        assert np.shares_memory(got.output, y.array)
        # the engine's routing from the map too: the same bits as given inline
        ids = shm.alloc((4, 2), "i32")
        w = shm.alloc((4, 2), "f32")
        ids.array[:] = [[0, 1], [2, 3], [1, -1], [3, 0]]
        w.array[:] = 0.5
        inline = cl.infer(sid, 0, hidden(4, seed=8), topk_ids=ids.array.copy(),
                          topk_weights=w.array.copy()).output
        mapped = cl.infer(sid, 0, x, topk_ids=ids, topk_weights=w, output_to=y).output
        assert mapped.tobytes() == inline.tobytes()
        cl.unmap(shm)
        with pytest.raises(qmoe_client.QmoeError) as ei:
            cl.call("session.unmap", {"session": sid, "map": 1 << 40})
        assert ei.value.code == -32001
        cl.close_session(sid)


def test_python_client_infer_counts_equal_the_parsed_answer(daemon):
    """Client.infer_counts (a layer hook's call: params as JSON text, the
    answer's counters read by pattern) gives the counters the JSON parse
    gives, falls back to the parse for another layout, and raises errors."""
    sys.path.insert(0, PYCLIENT)
    import qmoe_client

    with qmoe_client.Client(daemon.socket) as cl:
        sid = cl.create_session("small", policy="lru", budget_bytes=3968)["session"]
        shm = cl.map(sid, 1 << 16)
        x = shm.alloc((2, H), "f32")
        y = shm.alloc((2, H), "f32")
        x.array[:] = hidden(2, seed=9)
        names = ("hits", "misses", "bytes_paged", "queue_us", "compute_us")
        text = ('{"session":"%s","layer":%%d,"hidden":{"dtype":"f32","shape":[2,%d],"map":%d,'
                '"offset":%d},"output_to":{"map":%d,"offset":%d}%%s}'
                % (sid, H, shm.id, x.offset, shm.id, y.offset))
        want = cl.infer(sid, 0, x, output_to=y)
        ref = y.array.copy()
        real = qmoe_client._client._INFER_COUNTS

        class Spy:  # counts the answers the pattern reads whole
            matched = 0

            def fullmatch(self, raw):
                m = real.fullmatch(raw)
                Spy.matched += m is not None
                return m
        qmoe_client._client._INFER_COUNTS = Spy()
        try:
            got = cl.infer_counts((text % (0, "")).encode())
        finally:
            qmoe_client._client._INFER_COUNTS = real
        assert Spy.matched == 1, "qmoed's answer no longer has the layout the pattern reads"
        assert y.array.tobytes() == ref.tobytes()
        assert len(got) == 5 and all(isinstance(v, int) for v in got)
        # a budget of one expert: misses paged in, as the parse says
        assert got[1] == want.stats["misses"] > 0 and got[0] == want.stats["hits"]
        assert got[2] == want.stats["bytes_paged"] > 0
        # with routing in the answer the pattern does not match: parsed instead
        routed = cl.infer_counts((text % (0, ',"return_routing":true')).encode())
        assert routed[:3] == got[:3]
        try:  # a pattern that never matches: every answer parsed as JSON
            qmoe_client._client._INFER_COUNTS = __import__("re").compile(rb"(\d+)never")
            assert cl.infer_counts((text % (0, "")).encode())[:3] == got[:3]
        finally:
            qmoe_client._client._INFER_COUNTS = real
        with pytest.raises(qmoe_client.QmoeError) as ei:
            cl.infer_counts((text % (99, "")).encode())
        assert ei.value.name == "invalid_params" and ei.value.field == "layer"
        assert dict(zip(names, cl.infer_counts((text % (1, "")).encode())))["misses"] > 0
        cl.close_session(sid)


KILLED_CLIENT = textwrap.dedent("""
    import json, os, signal, socket, sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    import qmoe_client
    cl = qmoe_client.Client(sys.argv[1])
    sid = cl.create_session("small")["session"]
    shm = cl.map(sid, 1 << 20)
    x = shm.alloc((256, 64), "f32")
    x.array[:] = 1.0
    out = shm.alloc((256, 64), "f32")
    req = {"session": sid, "layer": 0, "hidden": x.wire(),
           "output_to": {"map": shm.id, "offset": out.offset}}
    lines = b"".join((json.dumps({"jsonrpc": "2.0", "id": i, "method": "session.infer",
                                  "params": req}) + "\\n").encode() for i in range(200))
    cl._sock.sendall(lines)
    print(sid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_client_killed_while_its_map_is_in_use(daemon):
    c = daemon.client()
    mine = new_session(c)
    shm = Shm(c, mine, 4096)
    shm.put(0, hidden(2).tobytes())
    before = open_fds(daemon.proc.pid)
    p = subprocess.run([sys.executable, "-c", KILLED_CLIENT, daemon.socket, PYCLIENT],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    victim = p.stdout.strip()
    # The daemon and this session carry on while the victim's queue drains.
    for _ in range(5):
        r = c.call("session.infer", {"session": mine, "layer": 0,
                                     "hidden": {"dtype": "f32", "shape": [2, H], "map": shm.id,
                                                "offset": 0}})
        assert r["output"]["shape"] == [2, H]
    # Its session (and map) stay until closed, as sessions do; closing frees all.
    assert any(s["session"] == victim for s in c.call("session.list")["sessions"])
    c.call("session.close", {"session": victim})
    deadline = time.time() + 20
    while time.time() < deadline and mapped_regions(daemon.proc.pid, "qmoe-map"):
        time.sleep(0.05)
    assert mapped_regions(daemon.proc.pid, "qmoe-map") == 0
    assert open_fds(daemon.proc.pid) == before
    c.call("session.close", {"session": mine})
    c.close()


@pytest.mark.parametrize("wdtype", ["f32", "f16", "bf16"])
def test_mapped_engine_routing_equals_base64(daemon, wdtype):
    """topk_ids (i32) and topk_weights in the map: the same bits as base64."""
    c = daemon.client()
    sid = new_session(c)
    shm = Shm(c, sid, 1 << 15)
    T, k = 6, 3
    x = as_bytes(hidden(T, seed=12), "f32")
    ids = np.array([[(t + 3 * j) % E for j in range(k)] for t in range(T)], dtype="<i4")
    ids[2, 1] = -1  # no route
    w = as_bytes(np.random.default_rng(5).random((T, k)), wdtype)
    shm.put(0, x)
    shm.put(4096, ids.tobytes())
    shm.put(8192, w)
    want = c.call("session.infer", {"session": sid, "layer": 1, "hidden": b64(x, "f32", (T, H)),
                                    "topk_ids": b64(ids.tobytes(), "i32", (T, k)),
                                    "topk_weights": b64(w, wdtype, (T, k))})
    got = c.call("session.infer", {
        "session": sid, "layer": 1,
        "hidden": {"dtype": "f32", "shape": [T, H], "map": shm.id, "offset": 0},
        "topk_ids": {"dtype": "i32", "shape": [T, k], "map": shm.id, "offset": 4096},
        "topk_weights": {"dtype": wdtype, "shape": [T, k], "map": shm.id, "offset": 8192},
        "output_to": {"map": shm.id, "offset": 16384}})
    assert shm.get(16384, len(x)) == base64.b64decode(want["output"]["data"])
    assert got["output"]["map"] == shm.id
    # a bad id in the map is refused like a base64 one, naming topk_ids
    bad = ids.copy()
    bad[0, 0] = E
    shm.put(4096, bad.tobytes())
    e = err(c.request("session.infer", {
        "session": sid, "layer": 1,
        "hidden": {"dtype": "f32", "shape": [T, H], "map": shm.id, "offset": 0},
        "topk_ids": {"dtype": "i32", "shape": [T, k], "map": shm.id, "offset": 4096},
        "topk_weights": {"dtype": wdtype, "shape": [T, k], "map": shm.id, "offset": 8192}}))
    assert e["code"] == -32602 and e["data"]["field"] == "topk_ids", e
    c.call("session.close", {"session": sid})
    c.close()


def test_pipelined_maps_each_get_their_own_descriptor(daemon):
    """Several session.map lines sent back to back, each with its own
    descriptor, interleaved with requests that carry none: each map gets
    the memfd sent with its line (told apart by size)."""
    c = daemon.client()
    sid = new_session(c)
    sizes = [4096, 8192, 12288, 16384]
    fds = [memfd(n) for n in sizes]
    for i, (n, fd) in enumerate(zip(sizes, fds)):
        status = (json.dumps({"jsonrpc": "2.0", "id": "s%d" % i, "method": "daemon.status"})
                  + "\n").encode()
        c.sock.sendall(status)
        line = (json.dumps({"jsonrpc": "2.0", "id": i, "method": "session.map",
                            "params": {"session": sid, "bytes": n}}) + "\n").encode()
        socket.send_fds(c.sock, [line], [fd])
    got = {}
    for _ in range(2 * len(sizes)):
        r = json.loads(c.read_line())
        got[r["id"]] = r
    for fd in fds:
        os.close(fd)
    for i, n in enumerate(sizes):
        assert got[i]["result"]["bytes"] == n, got[i]
        # the map is as large as its line asked: a region at its very end fits
        t = {"dtype": "f32", "shape": [1, H], "map": got[i]["result"]["map"],
             "offset": n - H * 4}
        assert "result" in c.request("session.infer", {"session": sid, "layer": 0, "hidden": t})
    c.call("session.close", {"session": sid})
    c.close()
