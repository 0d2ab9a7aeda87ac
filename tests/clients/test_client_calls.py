"""What the clients send, against the wire's rows (protocol/qm_wire_schema.h):
libqmoe-client's typed calls (tests/clients/client_calls.c), the Python
client's methods and qmoectl's commands each talk to a fake daemon that
records every request line, and every line must decode with the daemon's
own decoder (tests/protocol/wire_check). A stub whose member drifted from
the rows (renamed, retyped, no longer taken) fails here, named with the
decoder's field and reason."""
import array
import base64
import json
import os
import re
import socket
import subprocess
import threading

import pytest

from conftest import BUILD

WIRE_CHECK = os.path.join(BUILD, "tests", "protocol", "wire_check")
CLIENT_CALLS = os.path.join(BUILD, "tests", "clients", "client_calls")
QMOECTL = os.path.join(BUILD, "clients", "qmoectl")
SID = "0123456789abcdef0123456789abcdef"
MODEL = {"name": "demo", "path": "/tmp/demo.bank", "layers": 2, "experts": 2, "hidden_size": 4,
         "inter_size": 4, "k": 2, "activation": "swiglu", "bits": 4, "block_size": 0,
         "bytes_total": 960, "bytes_per_expert": 120}
SUMMARY = {"policy": "lru", "budget_bytes": 960, "total": 2, "resident": 0, "degraded": 0,
           "per_expert": 2}
STATS = {"hits": 0, "misses": 0, "host_runs": 0, "bytes_paged": 0, "bytes_read_disk": 0,
         "stall_us": 0, "queue_us": 0, "compute_us": 0, "decode_us": 0, "encode_us": 0,
         "wall_us": 0}


def answer(method, params):
    """A result each client's parser takes (its values do not matter)."""
    if method == "daemon.status":
        return {"version": "0", "uptime_s": 0, "backend": "cpu",
                "device": {"name": "cpu", "total_bytes": 1, "budget_bytes": 1, "used_bytes": 0},
                "models": 0, "sessions": 0, "connections": 1}
    if method == "model.load":
        return MODEL
    if method == "model.list":
        return {"models": [MODEL]}
    if method == "session.create":
        return {"session": SID, "plan_summary": SUMMARY, "budget_bytes": 960,
                "resident_bytes": 0, "workspace_bytes": 0}
    if method == "session.resize":
        return {"budget_bytes": 960, "resident_bytes": 0, "plan_summary": SUMMARY}
    if method == "session.list":
        return {"sessions": [{"session": SID, "model": "demo", "policy": "lru", "owner_uid": 0,
                              "budget_bytes": 960, "resident_bytes": 0, "created_at": 0}]}
    if method == "session.plan":
        return {"policy": "lru", "budget_bytes": 960, "total": 0, "resident": 0, "degraded": 0,
                "banks": []}
    if method == "session.infer":
        out = params.get("output_to")
        hidden = params.get("hidden", {})
        if out:
            tensor = {"dtype": hidden.get("dtype", "f32"), "shape": hidden.get("shape", [1, 1]),
                      "map": out["map"], "offset": out["offset"]}
        else:
            tensor = dict(hidden)
        return {"output": tensor, "stats": STATS}
    if method == "session.map":
        return {"map": 1, "bytes": params.get("bytes", 0)}
    if method == "telemetry.get":
        if params.get("session"):
            return {"session": SID, "model": "demo"}
        return {"daemon": {}, "sessions": []}
    if method == "telemetry.trace":
        return {"spans": []}
    if method == "telemetry.metrics":
        return {"text": ""}
    return {}


class FakeDaemon:
    """Records each request line and answers it (session.ring: method not
    found, so a client keeps to the socket)."""

    def __init__(self, path):
        self.path, self.lines = path, []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.connection, args=(conn,), daemon=True).start()

    def connection(self, conn):
        buf = b""
        with conn:
            while True:
                try:
                    data, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
                except OSError:
                    return
                for level, kind, fds in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        for fd in array.array("i", fds[:len(fds) - len(fds) % 4]):
                            os.close(fd)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        conn.sendall(self.reply(line))

    def reply(self, line):
        self.lines.append(line.decode())
        req = json.loads(line)
        method, params = req.get("method"), req.get("params") or {}
        if method == "session.ring":
            body = {"error": {"code": -32601, "message": "method_not_found",
                              "data": {"reason": "no rings here"}}}
        else:
            body = {"result": answer(method, params)}
        return (json.dumps(dict({"jsonrpc": "2.0", "id": req.get("id")}, **body)) + "\n").encode()

    def close(self):
        self.sock.close()


@pytest.fixture
def fake(tmp_path):
    d = FakeDaemon(str(tmp_path / "fake.sock"))
    yield d
    d.close()


def decode_all(lines):
    """Each line through the daemon's decoder: [(line, verdict)]."""
    if not os.path.exists(WIRE_CHECK):
        pytest.skip("%s is not built" % WIRE_CHECK)
    r = subprocess.run([WIRE_CHECK], input="\n".join(lines) + "\n", capture_output=True,
                       text=True)
    verdicts = r.stdout.splitlines()
    assert len(verdicts) == len(lines), r.stdout + r.stderr
    return list(zip(lines, verdicts))


def assert_all_decode(lines, want_methods):
    bad = [(l, v) for l, v in decode_all(lines) if not v.startswith("ok ")]
    assert not bad, "requests the daemon would refuse:\n" + "\n".join(
        "%s\n  -> %s" % (l[:300], v) for l, v in bad)
    sent = {json.loads(l)["method"] for l in lines}
    assert want_methods <= sent, sorted(want_methods - sent)


def test_libqmoe_client_sends_what_the_rows_take(fake):
    if not os.path.exists(CLIENT_CALLS):
        pytest.skip("%s is not built" % CLIENT_CALLS)
    r = subprocess.run([CLIENT_CALLS, fake.path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert_all_decode(fake.lines, {
        "daemon.status", "model.load", "model.list", "model.unload", "session.create",
        "session.resize", "session.list", "session.plan", "session.infer", "session.map",
        "session.unmap", "session.ring", "telemetry.get", "telemetry.trace",
        "telemetry.metrics", "session.close", "daemon.shutdown"})


def test_python_client_sends_what_the_rows_take(fake):
    np = pytest.importorskip("numpy")
    import qmoe_client
    c = qmoe_client.Client(fake.path, timeout=5, close_sessions_at_exit=False)
    c.ring_mode = "off"
    c.status()
    c.load_model("demo", "/tmp/demo.bank")
    c.models()
    c.unload_model("demo", force=True)
    sid = c.create_session("demo", policy="next_use", budget_bytes=1 << 20,
                           policy_params={"prefetch": False, "decay": 0.5}, precision="fast")["session"]
    c.sessions()
    c.plan(sid)
    c.resize_session(sid, 1 << 19)
    h = np.zeros((2, 4), np.float32)
    c.infer(sid, 1, h, router_logits=np.zeros((2, 2), np.float32), return_routing=True)
    c.infer(sid, 1, h, topk_ids=np.zeros((2, 2), np.int32),
            topk_weights=np.ones((2, 2), np.float32))
    shm = c.map(sid, 4096)
    c.infer(sid, 1, shm.tensor(0, (2, 4), "f32"), output_to=shm.tensor(64, (2, 4), "f32"))
    c.unmap(shm)
    c.telemetry(sid)
    c.telemetry()
    c.trace(sid, limit=10)
    c.metrics()
    c.close_session(sid)
    c.shutdown()
    c.close()
    assert_all_decode(fake.lines, {
        "daemon.status", "model.load", "model.list", "model.unload", "session.create",
        "session.list", "session.plan", "session.resize", "session.infer", "session.map",
        "session.unmap", "telemetry.get", "telemetry.trace", "telemetry.metrics",
        "session.close", "daemon.shutdown"})


def test_qmoectl_sends_what_the_rows_take(fake, tmp_path):
    np = pytest.importorskip("numpy")
    if not os.path.exists(QMOECTL):
        pytest.skip("%s is not built" % QMOECTL)
    h = tmp_path / "h.npy"
    np.save(h, np.zeros((2, 4), np.float32))
    np.save(tmp_path / "r.npy", np.zeros((2, 2), np.float32))
    np.save(tmp_path / "i.npy", np.zeros((2, 2), np.int32))
    np.save(tmp_path / "w.npy", np.ones((2, 2), np.float32))
    commands = [
        ["status"], ["models"], ["load", "demo", "/tmp/demo.bank"], ["unload", "demo", "--force"],
        ["sessions"],
        ["create", "demo", "--policy", "next_use", "--budget", "1MiB", "--param", "prefetch=false",
         "--param", "decay=0.5", "--precision", "fast"],
        ["create", "demo", "--budget", "auto"], ["create", "demo", "--budget", "12.5%"],
        ["resize", SID, "512KiB"], ["resize", SID, "auto"], ["resize", SID, "40%"],
        ["plan", SID], ["telemetry", SID], ["telemetry"],
        ["trace", "--limit", "10", "--session", SID], ["metrics"],
        ["infer", SID, "--layer", "1", "--hidden", str(h), "--logits", str(tmp_path / "r.npy"),
         "--out", str(tmp_path / "y.npy"), "--routing"],
        ["infer", SID, "--layer", "1", "--hidden", str(h), "--topk-ids", str(tmp_path / "i.npy"),
         "--topk-weights", str(tmp_path / "w.npy"), "--out", str(tmp_path / "y.npy")],
        ["call", "session.resize", "session=" + SID, "budget_bytes=4096"],
        ["close", SID], ["shutdown"],
    ]
    for args in commands:
        for json_flag in ([], ["--json"]):
            subprocess.run([QMOECTL, "--socket", fake.path, "--timeout", "5"] + json_flag + args,
                           capture_output=True, text=True, timeout=30)
    assert_all_decode(fake.lines, {
        "daemon.status", "model.list", "model.load", "model.unload", "session.list",
        "session.create", "session.resize", "session.plan", "telemetry.get", "telemetry.trace",
        "telemetry.metrics", "session.infer", "session.close", "daemon.shutdown"})


def test_a_drifted_request_is_caught(fake):
    """The check itself: a member the rows do not take is named."""
    verdicts = decode_all(['{"jsonrpc":"2.0","id":1,"method":"session.resize",'
                           '"params":{"session":"s","budget_kb":4096}}'])
    assert verdicts[0][1].startswith("error -32602 budget_kb "), verdicts


def test_the_llama_cpp_options_name_what_the_registries_hold():
    """llama.cpp checks --qmoed-on-miss and --qmoed-precision and lists the
    policies in --help before any daemon answers: those lists, in
    clients/llama.cpp/llama.cpp.patch (each option's metavar, the values it
    accepts and its error), are walked against the wire's rows (the pager's
    on_miss registry, precision, the residency registry's offered
    policies)."""
    if not os.path.exists(QMOECTL):
        pytest.skip("%s is not built" % QMOECTL)
    src = os.environ.get("QMOE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
    with open(os.path.join(src, "clients", "llama.cpp", "llama.cpp.patch")) as f:
        patch = f.read()
    rows = {m["method"]: m for m in json.loads(subprocess.run(
        [QMOECTL, "--json", "methods"], capture_output=True, text=True, check=True).stdout)}
    create = {p["member"]: p for p in rows["session.create"]["params"]}
    on_miss = next(p for p in create["policy_params"]["members"] if p["member"] == "on_miss")
    for option, names in (("--qmoed-on-miss", on_miss["names"]),
                          ("--qmoed-precision", create["precision"]["names"])):
        body = patch.split('{"%s"}' % option, 1)[1].split("add_opt(", 1)[0]
        assert '"{%s}"' % ",".join(names) in body, (option, names)
        accepted = re.findall(r'value != "([^"]+)"', body)
        assert accepted == names, (option, accepted, names)
        words = re.search(r'"%s takes ([^"]+)"' % option, body).group(1)
        assert re.split(r", | or ", words) == names, (option, words, names)
    offered = create["policy"]["names"]
    listed = patch.split("qmoed residency policy: ", 1)[1].split("\\n", 1)[0].split(", ")
    assert sorted(listed) == sorted(offered), (listed, offered)
