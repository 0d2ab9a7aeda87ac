"""The Python client (clients/python, package qmoe_client) against a real qmoed."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import EXPERTS, HIDDEN, LAYERS, QMOE_BANK, SOURCE, need
from qmoe_client import Client, DaemonNotRunning, QmoeError, Tensor, decode_tensor, encode_tensor


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.socket, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def sid(client):
    return client.create_session("demo", policy="lru", budget_bytes=None)["session"]


def test_tensor_codec_round_trips_and_checks_lengths():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = encode_tensor(x)
    assert t["dtype"] == "f32" and t["shape"] == [3, 4]
    assert np.array_equal(decode_tensor(t), x)
    b = Tensor("bf16", (2,), b"\x80\x3f\x00\x40")  # 1.0, 2.0
    assert decode_tensor(encode_tensor(b), as_numpy=False).data == b.data
    assert b.to_numpy().tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        Tensor("f32", (2,), b"\x00" * 4)
    with pytest.raises(QmoeError) as e:
        decode_tensor({"dtype": "f32", "shape": [2], "data": "AAAAAA=="})
    assert e.value.name == "bad_response"
    with pytest.raises(ValueError):
        encode_tensor(np.zeros(3, dtype=np.float64))


def test_an_unreadable_response_is_reported_with_where_it_broke(tmp_path):
    """A line that is not JSON (a daemon's defect, or a stream out of step)
    fails the call as bad_response naming its length and the bytes where
    the parse stopped, and drops the connection."""
    import socket
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    broken = b'{"jsonrpc":"2.0","id":1,"result":{"a":1"b":2}}'

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(broken + b"\n")
            conn.recv(4096)  # until the client hangs up

    t = threading.Thread(target=serve)
    t.start()
    try:
        c = Client(path, timeout=10, reconnect=0)
        with pytest.raises(QmoeError) as e:
            c.status()
        assert e.value.name == "bad_response"
        assert "%d bytes; at %d" % (len(broken), broken.index(b'"b"')) in e.value.reason, e.value.reason
        assert '"a":1"b":2' in e.value.reason, e.value.reason
        c.close()
    finally:
        t.join(10)
        srv.close()


def test_no_daemon_raises_daemon_not_running(tmp_path):
    with pytest.raises(DaemonNotRunning) as e:
        Client(str(tmp_path / "none.sock"))
    assert e.value.name == "not_running" and "systemctl start qmoed" in e.value.reason


def test_status_and_models(client):
    s = client.status()
    assert s["backend"] == "cpu" and {"name", "total_bytes", "budget_bytes", "used_bytes"} <= set(s["device"])
    m = [m for m in client.models() if m["name"] == "demo"][0]
    assert (m["layers"], m["experts"], m["hidden_size"]) == (LAYERS, EXPERTS, HIDDEN)


def test_load_conflict_and_unload(client, daemon):
    client.load_model("py2", daemon.bank)
    with pytest.raises(QmoeError) as e:
        client.load_model("py2", daemon.bank)
    assert e.value.code == -32008 and e.value.name == "conflict"
    assert client.unload_model("py2") == {}
    with pytest.raises(QmoeError) as e:
        client.unload_model("py2")
    assert e.value.name == "not_found"


def test_session_lifecycle_and_plan(client, sid):
    assert sid in [s["session"] for s in client.sessions()]
    plan = client.plan(sid)
    assert plan["policy"] == "lru" and plan["total"] == LAYERS
    assert plan == client.plan(sid)  # nothing ran in between: the same plan
    with pytest.raises(QmoeError) as e:
        client.create_session("demo", policy="nope")
    assert e.value.name == "invalid_params" and e.value.field == "policy"
    with pytest.raises(QmoeError) as e:
        client.create_session("missing-model")
    assert e.value.name == "not_found"
    fast = client.create_session("demo", precision="fast")["session"]
    client.close_session(fast)
    with pytest.raises(QmoeError) as e:
        client.create_session("demo", precision="int8")
    assert e.value.name == "invalid_params" and e.value.field == "precision"


def test_resize_session(client):
    sid = client.create_session("demo", policy="lru", budget_bytes=1 << 20)["session"]
    r = client.resize_session(sid, 1 << 19)
    assert r["budget_bytes"] == 1 << 19 and r["resident_bytes"] <= 1 << 19
    assert r["plan_summary"]["budget_bytes"] == 1 << 19
    with pytest.raises(QmoeError) as e:
        client.resize_session(sid, 1)
    assert e.value.name == "resource_exhausted" and e.value.field == "budget_bytes"
    client.close_session(sid)


def test_budget_as_a_share_or_auto(client):
    total = next(m for m in client.models() if m["name"] == "demo")["bytes_total"]
    r = client.create_session("demo", policy="lru", budget="25%")
    assert r["budget_bytes"] == total // 4 and "budget_auto" not in r
    a = client.create_session("demo", policy="lru", budget="auto")
    assert a["budget_auto"]["reason"].startswith("budget auto: ")
    assert a["budget_bytes"] == a["budget_auto"]["target_bytes"] <= total
    r = client.resize_session(a["session"], "40%")
    assert r["budget_bytes"] == int(total * 0.4) and "budget_auto" not in r
    r = client.resize_session(a["session"], budget="auto")
    assert "budget_auto" in r and r["budget_auto"]["client_pending_bytes"] == 0
    r = client.resize_session(a["session"], budget="auto", client_pending_bytes=1 << 20)
    assert r["budget_auto"]["client_pending_bytes"] == 1 << 20, r
    with pytest.raises(QmoeError) as e:
        client.resize_session(a["session"], "40%", client_pending_bytes=1 << 20)
    assert e.value.field == "client_pending_bytes" and 'needs budget "auto"' in str(e.value)
    with pytest.raises(QmoeError) as e:
        client.create_session("demo", budget="half")
    assert e.value.field == "budget" and '"auto"' in str(e.value)
    with pytest.raises(TypeError):
        client.create_session("demo", budget=[1])
    client.close_session(a["session"])


def test_infer_matches_qmoe_bank_run(client, sid, daemon):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    r = client.infer(sid, 0, x, return_routing=True)
    assert r.output.shape == x.shape and r.output.dtype == np.float32
    assert len(r.routing) == 4 and all(len(t) == 2 for t in r.routing)
    assert all(0 <= e < EXPERTS for t in r.routing for e, _ in t)
    assert set(r.stats) >= {"hits", "misses", "bytes_paged", "queue_us", "compute_us"}
    xp, zp = os.path.join(daemon.dir, "px.npy"), os.path.join(daemon.dir, "pz.npy")
    np.save(xp, x)
    subprocess.run([need(QMOE_BANK), "run", daemon.bank, "--layer", "0", "--hidden", xp, "--out", zp],
                   check=True, capture_output=True)
    assert r.output.tobytes() == np.load(zp).tobytes()


def test_infer_errors_name_the_field(client, sid):
    with pytest.raises(QmoeError) as e:
        client.infer(sid, 0, np.zeros((1, HIDDEN + 1), dtype=np.float32))
    assert e.value.name == "invalid_params" and e.value.field and e.value.field.startswith("hidden")
    with pytest.raises(QmoeError) as e:
        client.infer(sid, LAYERS, np.zeros((1, HIDDEN), dtype=np.float32))
    assert e.value.field == "layer"


def test_telemetry_counts_inference(client, sid):
    before = client.telemetry(sid)
    client.infer(sid, 1, np.ones((2, HIDDEN), dtype=np.float32))
    after = client.telemetry(sid)
    assert after["requests"] >= before["requests"] + 1
    assert after["tokens"] >= before["tokens"] + 2
    everything = client.telemetry()
    assert "daemon" in everything and sid in [s["session"] for s in everything["sessions"]]


def test_trace_and_metrics(client, sid):
    spans = client.trace(session=sid)
    assert any(s["name"] == "session.residency_plan" for s in spans)
    assert len(client.trace(limit=1)) == 1
    assert "qmoed_" in client.metrics()


def test_unknown_method_and_unknown_param(client):
    with pytest.raises(QmoeError) as e:
        client.call("daemon.nope")
    assert e.value.code == -32601
    with pytest.raises(QmoeError) as e:
        client.call("daemon.status", {"verbose": True})
    assert e.value.code == -32602


def test_one_client_is_safe_across_threads(client):
    errors = []

    def worker():
        try:
            for _ in range(25):
                assert client.status()["backend"] == "cpu"
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_close_session(client):
    s = client.create_session("demo")["session"]
    assert client.close_session(s) == {}
    with pytest.raises(QmoeError) as e:
        client.plan(s)
    assert e.value.name == "not_found"


def test_package_installs_with_pip(tmp_path):
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--target", str(target), os.path.join(SOURCE, "clients", "python")]
    try:  # with the build backend already in the venv, build offline; else pip fetches it
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
        cmd.insert(5, "--no-build-isolation")
    except ImportError:
        pass
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    out = subprocess.run([sys.executable, "-c", "import qmoe_client; print(qmoe_client.__version__)"],
                         env={"PYTHONPATH": str(target), "PATH": os.environ.get("PATH", "")},
                         capture_output=True, text=True, check=True, cwd=str(tmp_path))
    assert out.stdout.strip() == "0.1.0"


def test_infer_with_router_logits_and_bf16(client, sid):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    logits = np.zeros((2, EXPERTS), dtype=np.float32)
    logits[:, [2, 6]] = 5.0
    r = client.infer(sid, 1, x, router_logits=logits, return_routing=True)
    assert all(sorted(e for e, _ in t) == [2, 6] for t in r.routing)
    # bf16 in, bf16 out (as a Tensor: numpy has no bfloat16).
    bits = (x.view(np.uint32) >> 16).astype("<u2")
    rb = client.infer(sid, 1, Tensor("bf16", x.shape, bits.tobytes()))
    assert isinstance(rb.output, Tensor) and rb.output.dtype == "bf16" and rb.output.shape == x.shape
    assert np.all(np.isfinite(rb.output.to_numpy()))


def test_infer_with_engine_routing_is_used_as_given(client, sid):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    own = client.infer(sid, 0, x, return_routing=True)
    ids = np.full((2, 2), -1, np.int32)
    w = np.zeros((2, 2), np.float32)
    for t, row in enumerate(own.routing):
        for j, (e, wt) in enumerate(row):
            ids[t, j], w[t, j] = e, wt
    r = client.infer(sid, 0, x, topk_ids=ids, topk_weights=w, return_routing=True)
    assert r.output.tobytes() == own.output.tobytes()
    assert r.routing == own.routing
    # Plain lists become int32; weights are not renormalised.
    r2 = client.infer(sid, 0, x[:1], topk_ids=[[3]], topk_weights=np.full((1, 1), 0.5, np.float32),
                      return_routing=True)
    assert r2.routing == [[(3, 0.5)]]
    with pytest.raises(ValueError):
        client.infer(sid, 0, x, topk_ids=ids)
    with pytest.raises(QmoeError) as e:
        client.infer(sid, 0, x, topk_ids=np.array([[0, 0], [1, 2]], np.int32), topk_weights=w)
    assert e.value.code == -32602 and e.value.field == "topk_ids"
    assert "names expert 0 twice" in e.value.reason


CHILD = r"""
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "clients", "python"))
import qmoe_client
c = qmoe_client.Client(sys.argv[2])
kept = qmoe_client.Client(sys.argv[2], close_sessions_at_exit=False)
a = c.create_session("demo")["session"]
b = c.create_session("demo", policy="lru", budget_bytes=4096)["session"]
c.close_session(b)
k = kept.create_session("demo")["session"]
shm = c.map(a, 1 << 16)
if os.fork() == 0:  # a child that inherits the client closes nothing of its parent's
    os._exit(0) if sys.argv[3] == "exit" else sys.exit(0)
os.wait()
assert a in {s["session"] for s in c.sessions()}, "the forked child closed its parent's session"
print(a, b, k, flush=True)
if sys.argv[3] == "raise":
    raise RuntimeError("the engine crashed")
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_sessions_a_process_left_open_are_closed_at_exit(daemon, client, how):
    """A process that creates sessions and exits (normally, or on an
    uncaught exception) without closing them leaves none behind: atexit
    closes them (and their maps); a session of a client made with
    close_sessions_at_exit=False stays, and a forked child closes nothing."""
    r = subprocess.run([sys.executable, "-c", CHILD, SOURCE, daemon.socket, how],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == (0 if how == "exit" else 1), r.stderr
    a, b, k = r.stdout.split()
    live = {s["session"] for s in client.sessions()}
    assert a not in live and b not in live, live
    assert k in live
    client.close_session(k)


def test_a_daemon_that_never_answers_times_out(tmp_path):
    """The kernel's read timeout (SO_RCVTIMEO) bounds a call: a listener that
    accepts and never answers gives a timeout error after about `timeout`
    seconds, and the next call reconnects."""
    import socket
    import time

    path = str(tmp_path / "mute.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    held = []
    t = threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(2)], daemon=True)
    t.start()
    c = Client(path, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(QmoeError) as e:
        c.status()
    dt = time.monotonic() - t0
    assert e.value.name == "timeout" and 0.25 <= dt < 2.0, (e.value.name, dt)
    with pytest.raises(QmoeError) as e:  # a new connection, timed out again
        c.status()
    assert e.value.name == "timeout"
    t.join(5)
    assert len(held) == 2
    c.close()
    srv.close()
