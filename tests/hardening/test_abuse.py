"""Protocol abuse against a real qmoed (issue 8, item 2).

One daemon serves the module with small limits from a --config file. A
bystander client stays connected with its own session the whole time; after
every case the daemon must answer daemon.status, the bystander must have
received nothing and still get the same output, the daemon's open fds must
return exactly to the baseline and its RSS to within a small slack.
Cases that need their own limits (idle timeout, output stall) start their
own daemon.
"""
import base64
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from hardening import (H, RSS_SLACK_KB, SLOW, Baseline, Bystander, Daemon, connect, lines,
                       make_bank, read_until_closed, req, tensor, wait_for)

MAX_REQUEST = 1 << 20
MAX_NESTING = 32
MAX_BATCH = 16
MAX_OUTPUT = 256 << 10
LIMITS = {"max_request_bytes": MAX_REQUEST, "max_nesting": MAX_NESTING,
          "max_batch": MAX_BATCH, "max_output_bytes": MAX_OUTPUT}


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    return make_bank(str(tmp_path_factory.mktemp("h8bank") / "small.bank"))


@pytest.fixture(scope="module")
def env(bank):
    dm = Daemon(models={"small": bank}, config=LIMITS)
    by = Bystander(dm)
    base = Baseline(dm)
    yield dm, by, base
    rc = dm.stop()
    assert rc == 0, dm.log_text()[-4000:]


@pytest.fixture
def dm(env):
    """The module daemon; after the test, the invariants of issue 8."""
    d, by, base = env
    yield d
    base.check(by)


def hidden(T, seed=0):
    return np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32)


def session(dm):
    c = dm.client()
    sid = c.call("session.create", {"model": "small"})["session"]
    c.close()
    return sid


def ask(dm, line):
    """Sends one raw line on a fresh connection, then a daemon.status; the
    parsed answer to the line, checked to be strict UTF-8 JSON. The
    connection must stay usable (the status is answered)."""
    s = connect(dm.socket)
    f = s.makefile("rb")
    try:
        s.sendall(line + b"\n" + req("daemon.status", id="after"))
        got = []
        for _ in range(2):
            ln = f.readline()
            assert ln.endswith(b"\n"), "no answer to %r" % line[:80]
            got.append(json.loads(ln.decode("utf-8")))
    finally:
        f.close()
        s.close()
    # Answers of different sessions may overtake each other: match by id.
    after = [r for r in got if isinstance(r, dict) and r.get("id") == "after"]
    assert len(after) == 1 and "result" in after[0], got
    return [r for r in got if r is not after[0]][0]


def code_of(resp):
    assert "error" in resp, resp
    return resp["error"]["code"]


# ---- framing ------------------------------------------------------------------------------


def test_request_split_at_every_byte_gets_the_same_answer(dm):
    sid = session(dm)
    x = tensor(hidden(1))
    # The id holds 2-, 3- and 4-byte UTF-8 sequences, so some cuts fall
    # inside a character.
    rid = "\u00e9\u2713\U0001d11e"
    line = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "session.infer",
                       "params": {"session": sid, "layer": 0, "hidden": x}},
                      ensure_ascii=False).encode() + b"\n"
    s = connect(dm.socket)
    f = s.makefile("rb")
    s.sendall(line)
    want = f.readline()
    assert json.loads(want)["id"] == rid
    for cut in range(1, len(line)):
        s.sendall(line[:cut])
        time.sleep(0.0005)
        s.sendall(line[cut:])
        got = f.readline()
        r = json.loads(got)
        assert r["id"] == rid, cut
        assert r["result"]["output"] == json.loads(want)["result"]["output"], cut
    f.close()
    s.close()


def test_pipelined_requests_sent_one_byte_at_a_time(dm):
    sid = session(dm)
    data = (req("daemon.status", id=1) +
            req("session.infer", {"session": sid, "layer": 1, "hidden": tensor(hidden(2))}, id=2) +
            b"\n  \n" +  # blank lines are ignored
            json.dumps([{"jsonrpc": "2.0", "id": 3, "method": "model.list"},
                        {"jsonrpc": "2.0", "method": "daemon.status"}]).encode() + b"\n")
    s = connect(dm.socket)
    f = s.makefile("rb")
    try:
        for i in range(len(data)):
            s.send(data[i:i + 1])
            if i % 4 == 0:
                time.sleep(0.0002)
        got = [json.loads(f.readline()) for _ in range(3)]
    finally:
        f.close()
        s.close()
    # The inference may be overtaken by the other answers: match by id.
    batch = [r for r in got if isinstance(r, list)]
    single = {r["id"]: r for r in got if isinstance(r, dict)}
    assert len(batch) == 1 and [r["id"] for r in batch[0]] == [3]
    assert "result" in single[1]
    assert single[2]["result"]["output"]["shape"] == [2, H]


def test_ten_thousand_pipelined_requests_all_answered_once(dm):
    sid = session(dm)
    x = tensor(hidden(1, seed=3))
    n = 10000
    out = []
    infer_ids = []
    for i in range(n):
        if i % 10 == 0:
            out.append(req("session.infer", {"session": sid, "layer": i % 2, "hidden": x}, id=i))
            infer_ids.append(i)
        elif i % 3 == 0:
            out.append(req("model.list", id="s%d" % i))
        else:
            out.append(req("daemon.status", id=i))
        if i % 100 == 0:  # notifications get no answer
            out.append(b'{"jsonrpc":"2.0","method":"daemon.status"}\n')
    payload = b"".join(out)
    s = connect(dm.socket, timeout=60)
    err = []

    def writer():
        try:
            s.sendall(payload)
        except OSError as e:  # pragma: no cover - reported below
            err.append(e)

    t = threading.Thread(target=writer)
    t.start()
    f = s.makefile("rb")
    seen = {}
    order = []
    for _ in range(n):
        r = json.loads(f.readline())
        assert "result" in r, r
        assert r["id"] not in seen, "id %r answered twice" % r["id"]
        seen[r["id"]] = True
        if isinstance(r["id"], int) and r["id"] % 10 == 0:
            order.append(r["id"])
    t.join()
    assert not err
    want = {i if (i % 10 == 0 or i % 3 != 0) else "s%d" % i for i in range(n)}
    assert set(seen) == want
    assert order == infer_ids, "one session's answers must keep their order"
    s.settimeout(0.3)
    with pytest.raises(socket.timeout):
        s.recv(1)  # nothing beyond the 10,000 answers
    f.close()
    s.close()


# ---- size limits ----------------------------------------------------------------------------


def padded(n):
    """A daemon.status request of exactly n bytes (newline not counted)."""
    base = req("daemon.status", id=1)[:-1]
    return base + b" " * (n - len(base))


def test_line_of_exactly_max_request_bytes_is_served_one_more_is_not(dm):
    for n in (MAX_REQUEST - 1, MAX_REQUEST):
        r = ask(dm, padded(n))
        assert "result" in r and r["id"] == 1
    s = connect(dm.socket)
    s.sendall(padded(MAX_REQUEST + 1) + b"\n")
    data = read_until_closed(s, 10)
    s.close()
    (r,) = lines(data)
    assert r["error"]["code"] == -32006 and r["id"] is None


def test_endless_line_gets_32006_and_close_without_buffering_it(dm):
    before = dm.limit_hits("max_request_bytes")
    s = connect(dm.socket)
    chunk = b"x" * 65536
    sent = [0]

    def writer():
        try:
            for _ in range(256):  # 16 MiB, 16x the limit
                s.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass

    t = threading.Thread(target=writer)
    t.start()
    data = read_until_closed(s, 15)
    t.join(15)
    s.close()
    (r,) = lines(data)
    assert r["error"]["code"] == -32006 and "max_request_bytes" in r["error"]["data"]["reason"]
    assert sent[0] < 16 << 20, "the daemon read the whole endless line"
    assert dm.limit_hits("max_request_bytes") == before + 1


def nest(depth):
    """A request whose JSON nests exactly `depth` levels."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return ('{"jsonrpc":"2.0","id":1,"method":"daemon.status","params":{"x":%s}}' % inner).encode()


def test_nesting_at_the_limit_parses_one_more_is_refused(dm):
    before = dm.limit_hits("max_nesting")
    r = ask(dm, nest(MAX_NESTING))
    assert code_of(r) == -32602 and r["error"]["data"]["field"] == "x"
    # An error that only names the limit (an unknown member max_nesting) is
    # not counted as a hit: the daemon reads the decoder's code, not text.
    r = ask(dm, b'{"jsonrpc":"2.0","id":1,"method":"daemon.status","max_nesting":1}')
    assert code_of(r) == -32600 and "max_nesting" in r["error"]["data"]["reason"]
    assert dm.limit_hits("max_nesting") == before
    r = ask(dm, nest(MAX_NESTING + 1))
    assert code_of(r) == -32600 and r["id"] is None
    assert "max_nesting" in r["error"]["data"]["reason"]
    assert dm.limit_hits("max_nesting") == before + 1


def test_deep_nesting_near_the_size_limit_is_refused_quickly(dm):
    t0 = time.time()
    r = ask(dm, b"[" * (MAX_REQUEST - 1))
    assert code_of(r) == -32600
    r = ask(dm, b"{\"a\":" * (MAX_REQUEST // 6))
    assert code_of(r) == -32600
    assert time.time() - t0 < 5 * SLOW


def test_brackets_inside_strings_do_not_count_as_nesting(dm):
    name = '\\"' + "[{" * 40
    line = ('{"jsonrpc":"2.0","id":1,"method":"%s"}' % name).encode()
    assert code_of(ask(dm, line)) == -32601


# ---- encodings --------------------------------------------------------------------------------

UTF8_CASES = [
    # (raw line, acceptable codes)
    (b'{"jsonrpc":"2.0","id":1,"method":"daemon.st\xffatus"}', {-32601, -32600, -32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"daemon.status","params":{"\xff\xfe":1}}',
     {-32602, -32700}),
    (b'{"jsonrpc":"2.0","id":"\xc3","method":"daemon.status"}', {-32600, -32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"session.create","params":{"model":"\xc0\xaf"}}',
     {-32602, -32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"session.create","params":{"model":"\xed\xa0\x80"}}',
     {-32602, -32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"session.create","params":{"model":"\xf4\x90\x80\x80"}}',
     {-32602, -32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"model.load","params":{"name":"a","path":"/tmp/\xff"}}',
     {-32602, -32700}),
    (b'{"jsonrpc":"2.0","id":"\\ud800","method":"daemon.status"}', {-32600, -32700}),
    (b"\xff\xfe\xfd", {-32700}),
    (b"\x00", {-32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"daemon.status"}\x00', {-32700}),
    (b'{"jsonrpc":"2.0","id":1,"method":"daemon.status","par\x00ams":{}}', {-32600, -32700}),
]


@pytest.mark.parametrize("line,codes", UTF8_CASES, ids=range(len(UTF8_CASES)))
def test_invalid_utf8_and_nul_bytes_get_a_clean_error(dm, line, codes):
    r = ask(dm, line)  # ask() decodes the answer as strict UTF-8
    assert code_of(r) in codes, r
    assert len(r["error"]["data"]["reason"]) < 600


@pytest.mark.parametrize("lead", [b"\x00", b"\x01", b"\x1f", b"\x0b\x0c"])
def test_control_bytes_before_a_request_are_a_parse_error(dm, lead):
    """BUGS.md B5 (fixed in cb54dcb): cJSON skips every byte <= 0x20 as whitespace, so NUL and
    other control bytes before a request are ignored (after it they are a
    parse error). JSON whitespace is space, tab, CR and LF only."""
    r = ask(dm, lead + req("daemon.status", id=1)[:-1])
    assert code_of(r) == -32700, r


NUL_ESCAPES = {
    "method": lambda sid: b'{"jsonrpc":"2.0","id":1,"method":"daemon.status\\u0000junk"}',
    "params.model": lambda sid: (b'{"jsonrpc":"2.0","id":1,"method":"session.create",'
                                 b'"params":{"model":"small\\u0000x"}}'),
    "params.session": lambda sid: (b'{"jsonrpc":"2.0","id":1,"method":"session.plan",'
                                   b'"params":{"session":"%s\\u0000x"}}' % sid.encode()),
}


@pytest.mark.parametrize("what", sorted(NUL_ESCAPES))
def test_strings_with_an_escaped_nul_are_refused_not_truncated(dm, what):
    """BUGS.md B1 (fixed in cb54dcb): cJSON turns \\u0000 into a C string terminator, and the
    daemon then acts on the prefix ('small\\u0000x' opens a session on
    'small'; a session id with a NUL suffix reads that session's plan)."""
    sid = session(dm)
    r = ask(dm, NUL_ESCAPES[what](sid))
    if "result" in r and "session" in r["result"]:
        c = dm.client()
        c.call("session.close", {"session": r["result"]["session"]})
        c.close()
    assert "error" in r, "%s with an embedded NUL was acted on: %s" % (what, str(r)[:200])


def test_string_ids_come_back_byte_for_byte(dm):
    """BUGS.md B1 (ids, fixed in cb54dcb): an id with an escaped NUL must be
    echoed whole or refused."""
    r = ask(dm, b'{"jsonrpc":"2.0","id":"a\\u0000b","method":"daemon.status"}')
    assert r["id"] == "a\u0000b" or "error" in r, "id came back as %r" % r["id"]


@pytest.mark.parametrize("rid", [2 ** 53 + 1, 2 ** 63 - 1, -(2 ** 63), 10 ** 30])
def test_large_integer_ids_come_back_exactly_or_are_refused(dm, rid):
    """BUGS.md B2 (fixed in cb54dcb): integer ids past 2^53 are echoed as a rounded double."""
    r = ask(dm, req("daemon.status", id=rid)[:-1])
    assert r["id"] == rid or (r["id"] is None and code_of(r) == -32600), \
        "sent id %d, got %r" % (rid, r["id"])


# ---- values -----------------------------------------------------------------------------------


def infer_line(dm, sid, **over):
    p = {"session": sid, "layer": 0, "hidden": tensor(hidden(1))}
    p.update(over)
    return req("session.infer", p)[:-1]


def test_numbers_out_of_range_are_invalid_params(dm):
    sid = session(dm)
    cases = [
        (infer_line(dm, sid).replace(b'"layer":0', b'"layer":1e400'), "layer"),
        (infer_line(dm, sid, layer=-1), "layer"),
        (infer_line(dm, sid, layer=1.5), "layer"),
        (infer_line(dm, sid, layer=2 ** 32), "layer"),
        (infer_line(dm, sid, layer=2 ** 53 + 2), "layer"),
        (infer_line(dm, sid, layer=99), "layer"),
        (req("session.create", {"model": "small", "budget_bytes": 1e300})[:-1], "budget_bytes"),
        (req("session.create", {"model": "small", "budget_bytes": -5})[:-1], "budget_bytes"),
        (req("session.create", {"model": "small", "budget_bytes": 0})[:-1], "budget_bytes"),
        (req("session.create", {"model": "small", "policy": "lfu",
                                "policy_params": {"decay": 1.0000001}})[:-1],
         "policy_params.decay"),
        (req("session.create", {"model": "small", "policy_params":
                                {"min_split_bytes": 1e19}})[:-1], "policy_params.min_split_bytes"),
        (req("session.create", {"model": "small", "policy": "static_hot", "policy_params":
                                {"hot": [{"layer": 0, "experts": [2 ** 32]}]}})[:-1],
         "policy_params.hot[0].experts[0]"),
        (req("telemetry.trace", {"limit": -1})[:-1], "limit"),
        (req("telemetry.trace", {"limit": 1e400})[:-1].replace(b"Infinity", b"1e400"), "limit"),
    ]
    for line, field in cases:
        r = ask(dm, line)
        assert code_of(r) == -32602, (line[:120], r)
        assert r["error"]["data"].get("field") == field, (line[:120], r)
    for line in (b'{"jsonrpc":"2.0","id":1e400,"method":"daemon.status"}',
                 b'{"jsonrpc":"2.0","id":-1e400,"method":"daemon.status"}'):
        assert code_of(ask(dm, line)) == -32600
    for line in (b'{"jsonrpc":"2.0","id":NaN,"method":"daemon.status"}',
                 b'{"jsonrpc":"2.0","id":Infinity,"method":"daemon.status"}'):
        assert code_of(ask(dm, line)) in (-32700, -32600), line


@pytest.mark.parametrize("num", [b"0x10", b"01", b"-01", b"1.", b".5", b"+1", b"1e", b"0x1p4"])
def test_numbers_that_are_not_json_are_a_parse_error(dm, num):
    """BUGS.md B5 (fixed in cb54dcb): numbers go through strtod, which takes hex, leading zeros
    and other spellings JSON does not have."""
    r = ask(dm, b'{"jsonrpc":"2.0","id":%s,"method":"daemon.status"}' % num)
    assert code_of(r) in (-32700, -32600), "id %s was accepted as %r" % (num.decode(), r["id"])


def test_shape_products_that_overflow_are_refused_without_allocating(dm):
    sid = session(dm)
    rss0 = dm.rss_kb()
    shapes = [[2 ** 32, 2 ** 32], [2 ** 53, 2 ** 53], [2 ** 62, 2], [2 ** 61, H],
              [2 ** 40, H], [1, 2 ** 53], [2 ** 53, 0]]
    for shape in shapes:
        t = {"dtype": "f32", "shape": shape, "data": "AAAA"}
        r = ask(dm, infer_line(dm, sid, hidden=t))
        assert code_of(r) == -32602, (shape, r)
        assert r["error"]["data"]["field"].startswith("hidden"), (shape, r)
        t = {"dtype": "f16", "shape": [1, 2 ** 62], "data": "AAAA"}
        r = ask(dm, infer_line(dm, sid, router_logits=t))
        assert code_of(r) == -32602 and r["error"]["data"]["field"].startswith("router_logits")
    for shape in ([], [1, 2, 3, 4, 5, 6, 7, 8, 9], [-1, H], [1.5, H], ["1", H], [None, H]):
        r = ask(dm, infer_line(dm, sid, hidden={"dtype": "f32", "shape": shape, "data": ""}))
        assert code_of(r) == -32602 and r["error"]["data"]["field"].startswith("hidden.shape")
    assert dm.rss_kb() < rss0 + max(8 * 1024, RSS_SLACK_KB)


def test_base64_garbage_and_wrong_padding_name_the_data_field(dm):
    sid = session(dm)
    good = base64.b64encode(hidden(1).tobytes()).decode()
    assert "result" in ask(dm, infer_line(dm, sid))
    bad = [
        "!" * len(good),
        good[:-4] + "A===",
        good[:-4] + "====",
        good[:-1],                       # length not a multiple of 4
        good[:-4],                       # 3 bytes short
        good + "AAAA",                   # 3 bytes too many
        good.replace("=", ""),
        good[:8] + "==" + good[10:],     # padding in the middle
        good[:8] + " " + good[9:],       # whitespace
        good[:8] + "-_" + good[10:],     # URL-safe alphabet
        good[:8] + "\u00e9" + good[10:],  # non-ASCII
        "",
    ]
    for data in bad:
        t = {"dtype": "f32", "shape": [1, H], "data": data}
        r = ask(dm, infer_line(dm, sid, hidden=t))
        assert code_of(r) == -32602, (data[:20], r)
        assert r["error"]["data"]["field"] == "hidden.data", (data[:20], r)
    for data in (5, None, [good], {"b64": good}):
        r = ask(dm, infer_line(dm, sid, hidden={"dtype": "f32", "shape": [1, H], "data": data}))
        assert code_of(r) == -32602 and r["error"]["data"]["field"] == "hidden.data"
    for dt in ("f64", "F32", "", "int8"):
        r = ask(dm, infer_line(dm, sid, hidden={"dtype": dt, "shape": [1, H], "data": good}))
        assert code_of(r) == -32602 and r["error"]["data"]["field"] == "hidden.dtype"


def test_duplicate_keys_are_refused_at_every_level(dm):
    sid = session(dm)
    x = json.dumps(tensor(hidden(1)))
    cases = [
        ('{"jsonrpc":"2.0","id":7,"id":8,"method":"daemon.status"}', -32600, None),
        ('{"jsonrpc":"2.0","id":7,"method":"daemon.status","method":"model.list"}', -32600, None),
        ('{"jsonrpc":"2.0","jsonrpc":"2.0","id":7,"method":"daemon.status"}', -32600, None),
        ('{"jsonrpc":"2.0","id":7,"method":"session.plan","params":{"session":"%s",'
         '"session":"%s"}}' % (sid, sid), -32602, "session"),
        ('{"jsonrpc":"2.0","id":7,"method":"session.infer","params":{"session":"%s","layer":0,'
         '"layer":1,"hidden":%s}}' % (sid, x), -32602, "layer"),
        ('{"jsonrpc":"2.0","id":7,"method":"session.infer","params":{"session":"%s","layer":0,'
         '"hidden":%s}}' % (sid, x[:-1] + ',"dtype":"f32"}'), -32602, "hidden.dtype"),
        ('{"jsonrpc":"2.0","id":7,"method":"session.create","params":{"model":"small",'
         '"policy":"lfu","policy_params":{"decay":0.5,"decay":0.9}}}', -32602,
         "policy_params.decay"),
        ('{"jsonrpc":"2.0","id":7,"method":"session.create","params":{"model":"small",'
         '"policy":"static_hot","policy_params":{"hot":[{"layer":0,"layer":1,"experts":[1]}]}}}',
         -32602, "policy_params.hot[0].layer"),
    ]
    for line, code, field in cases:
        r = ask(dm, line.encode())
        assert code_of(r) == code, (line[:100], r)
        # The id is echoed when it was read before the duplicate.
        assert r["id"] in (7, 8) or (r["id"] is None and line.index('"id"') > 25), r
        if field:
            assert r["error"]["data"]["field"] == field, (line[:100], r)


def test_long_hot_list_does_not_stall_the_daemon(dm):
    """BUGS.md B9 (fixed in cb54dcb): policy_params.hot is checked for repeats pairwise while
    decoding, on the loop thread: a 0.3 MB session.create (any user) with
    50,000 experts stalls every client for seconds (150,000: 13 s; with the
    default 64 MiB max_request_bytes, hours)."""
    line = req("session.create", {"model": "small", "policy": "static_hot",
                                  "policy_params": {"hot": [{"layer": 0,
                                                             "experts": list(range(50000))}]}})
    assert len(line) < MAX_REQUEST
    s = connect(dm.socket)
    other = connect(dm.socket)
    f = other.makefile("rb")
    try:
        s.sendall(line)
        time.sleep(0.05)
        t0 = time.time()
        other.sendall(req("daemon.status", id=2))
        assert json.loads(f.readline())["id"] == 2
        stalled = time.time() - t0
        r = json.loads(s.makefile("rb").readline())
        assert r["error"]["code"] == -32602
    finally:
        f.close()
        other.close()
        s.close()
    assert stalled < 1.0 * SLOW, "daemon.status waited %.1f s behind one request" % stalled


# ---- batches ----------------------------------------------------------------------------------


def test_batches_at_past_and_below_the_limit(dm):
    mk = lambda n, **kw: json.dumps([dict({"jsonrpc": "2.0", "id": i, "method": "daemon.status"},
                                          **kw) for i in range(n)]).encode()
    r = ask(dm, mk(MAX_BATCH))
    assert isinstance(r, list) and sorted(x["id"] for x in r) == list(range(MAX_BATCH))
    r = ask(dm, mk(MAX_BATCH + 1))
    assert isinstance(r, dict) and code_of(r) == -32600 and r["id"] is None
    assert "max_batch" in r["error"]["data"]["reason"]
    r = ask(dm, b"[" + b"1," * 200000 + b"1]")
    assert isinstance(r, dict) and code_of(r) == -32600
    for empty in (b"[]", b"[ ]", b" [\t] "):
        r = ask(dm, empty)
        assert isinstance(r, dict) and code_of(r) == -32600 and r["id"] is None
    # A batch of notifications only gets no answer at all: the next line's
    # answer comes first.
    s = connect(dm.socket)
    f = s.makefile("rb")
    notes = json.dumps([{"jsonrpc": "2.0", "method": "daemon.status"}] * MAX_BATCH).encode()
    s.sendall(notes + b"\n" + req("model.list", id="next"))
    assert json.loads(f.readline())["id"] == "next"
    # Items that are not requests get their own errors inside the array.
    s.sendall(b'[1, [], {"jsonrpc":"2.0","id":5,"method":"nope"}, '
              b'{"jsonrpc":"2.0","id":6,"method":"daemon.status"}, {}]\n')
    r = json.loads(f.readline())
    assert [x["error"]["code"] if "error" in x else 0 for x in r] == \
        [-32600, -32600, -32601, 0, -32600]
    f.close()
    s.close()


# ---- connection lifecycle -------------------------------------------------------------------


def test_half_close_after_sending_still_gets_every_answer(dm):
    sid = session(dm)
    x = tensor(hidden(4))
    data = b"".join(req("session.infer", {"session": sid, "layer": i % 2, "hidden": x}, id=i)
                    if i % 2 else req("daemon.status", id=i) for i in range(20))
    s = connect(dm.socket)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = lines(read_until_closed(s, 20))
    s.close()
    assert sorted(r["id"] for r in got) == list(range(20))
    assert all("result" in r for r in got)


def test_reset_in_the_middle_of_a_response(dm):
    sid = session(dm)
    big = tensor(hidden(2048, seed=5))  # ~0.7 MB answer
    line = req("session.infer", {"session": sid, "layer": 0, "hidden": big}, id=1)
    for i in range(8):
        s = connect(dm.socket)
        data = line * (1 + i % 3)
        s.setblocking(False)  # the daemon stops reading a peer that does not read
        sent = 0
        t0 = time.time()
        # All of the first request (its answer is awaited below), then what
        # goes within 2 s: a slow daemon (valgrind) may take longer to read it.
        while sent < len(data) and (sent < len(line) or time.time() - t0 < 2):
            assert time.time() - t0 < 30 * SLOW, "the daemon stopped reading the first request"
            try:
                sent += s.send(data[sent:])
            except BlockingIOError:
                time.sleep(0.01)
        s.setblocking(True)
        s.settimeout(10 * SLOW)
        s.recv(1000 * (i + 1))  # part of the first answer, then gone
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    # A connection that goes away before any answer is written.
    for _ in range(8):
        s = connect(dm.socket)
        s.sendall(line)
        s.close()
    c = dm.client()
    # It waits behind what those peers got to run on the session: up to 16
    # inferences of 2048 tokens, seconds each with scalar kernels under ASan.
    c.sock.settimeout(30 * SLOW)
    r = c.call("session.infer", {"session": sid, "layer": 0, "hidden": tensor(hidden(1))})
    assert r["output"]["shape"] == [1, H]
    c.close()


def test_client_that_never_reads_is_paused_and_counted(dm):
    before = dm.limit_hits("max_output_bytes")
    rss0 = dm.rss_kb()
    s = connect(dm.socket)
    s.setblocking(False)
    one = req("model.list", id=1) * 64
    stalled_at = None
    sent = 0
    t0 = time.time()
    while time.time() - t0 < 20 * SLOW:
        try:
            sent += s.send(one)
            stalled_at = None
        except BlockingIOError:
            if stalled_at is None:
                stalled_at = time.time()
            elif time.time() - stalled_at > 0.5 and dm.limit_hits("max_output_bytes") > before:
                break  # the daemon stopped reading us, and said why
            time.sleep(0.05)
    assert stalled_at is not None, "the daemon kept reading a peer that never reads"
    assert dm.limit_hits("max_output_bytes") > before
    # What the daemon holds for this peer is bounded by the output limit
    # plus one wake-up's worth of answers, not by what the peer sent.
    assert dm.rss_kb() < rss0 + max(16 * 1024, RSS_SLACK_KB)
    c = dm.client()
    assert c.call("daemon.status")["connections"] >= 3
    c.close()
    s.close()


# ---- limits that need their own daemon ------------------------------------------------------


@pytest.fixture
def idle_daemon(bank):
    # The bystander's keep-alive (every 0.3 s) keeps a wide margin under
    # idle_timeout_s even on a loaded 2-core machine; frame_timeout_s is
    # the shorter deadline the slow peers below run into.
    dm = Daemon(models={"small": bank},
                config={"idle_timeout_s": 3, "frame_timeout_s": 2, "max_output_bytes": 65536})
    by = Bystander(dm)
    yield dm, by
    assert dm.stop() == 0, dm.log_text()[-3000:]


def keepalive(by, stop):
    while not stop.is_set():
        by.c.call("daemon.status")
        time.sleep(0.3)


def test_partial_frame_then_silence_is_closed(idle_daemon):
    dm, by = idle_daemon
    stop = threading.Event()
    t = threading.Thread(target=keepalive, args=(by, stop))
    t.start()
    try:
        base = Baseline(dm)
        s = connect(dm.socket)
        s.sendall(b'{"jsonrpc":"2.0","id":1,"meth')
        t0 = time.time()
        assert read_until_closed(s, 10) == b""
        assert time.time() - t0 >= 0.9
        s.close()
        # A slow but live client: each part arrives within the timeout, the
        # whole frame in about 0.5 s of the 2 s frame_timeout_s.
        s = connect(dm.socket)
        line = req("daemon.status", id=9)
        for part in (line[:10], line[10:30], line[30:]):
            s.sendall(part)
            time.sleep(0.25)
        assert json.loads(s.makefile("rb").readline())["id"] == 9
        s.close()
    finally:
        stop.set()
        t.join()
    base.check()
    assert dm.limit_hits("frame_timeout_s") + dm.limit_hits("idle_timeout_s") >= 1


def test_slowloris_trickling_one_frame_is_cut_off(idle_daemon):
    """BUGS.md B3 (fixed in cb54dcb): the idle timer restarts on every byte;
    without a frame-completion deadline a peer that sends one byte of a
    never-ending line every 0.5 s held its connection (and a max_connections
    slot) for ever."""
    dm, by = idle_daemon
    stop = threading.Event()
    t = threading.Thread(target=keepalive, args=(by, stop))
    t.start()
    try:
        s = connect(dm.socket)
        s.setblocking(False)
        closed = False
        t0 = time.time()
        while time.time() - t0 < 8 * SLOW:
            try:
                s.send(b"{")
                if s.recv(4096) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.5)
        s.close()
    finally:
        stop.set()
        t.join()
    by.check()
    assert closed, "a peer trickling one frame for %.0f s (frame_timeout_s=2) is still " \
                   "connected" % (time.time() - t0)
    assert dm.limit_hits("frame_timeout_s") >= 1


def test_client_that_never_reads_is_disconnected(idle_daemon):
    """BUGS.md B4 (fixed in cb54dcb): a peer whose output is over
    max_output_bytes was only paused, and the idle sweep skips connections
    with unsent output, so it was never dropped: each such peer pinned up to
    max_output_bytes (64 MiB by default) and a connection slot for ever."""
    dm, by = idle_daemon
    stop = threading.Event()
    t = threading.Thread(target=keepalive, args=(by, stop))
    t.start()
    try:
        s = connect(dm.socket)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        one = req("model.list", id=1) * 64
        closed = False
        t0 = time.time()
        while time.time() - t0 < 10 * SLOW:
            try:
                s.send(one)
            except BlockingIOError:
                time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            c = dm.client()
            n = c.call("daemon.status")["connections"]
            c.close()
            if n <= 2:  # the bystander and this probe: the daemon dropped us
                closed = True
                break
        s.close()
    finally:
        stop.set()
        t.join()
    assert dm.limit_hits("max_output_bytes") >= 1
    assert closed, "a peer that has not read for 10 s (frame_timeout_s=2) is still connected"
    # Its reads stopped mid-line, so the frame deadline may fire first.
    assert dm.limit_hits("output_stall") + dm.limit_hits("frame_timeout_s") >= 1


def test_peer_that_never_reads_one_large_answer_is_dropped_for_output_stall(idle_daemon):
    """One complete request whose answer (~1.4 MB) exceeds max_output_bytes
    and is never read: no partial frame is pending, so the output-stall
    deadline closes the connection and counts it."""
    dm, by = idle_daemon
    stop = threading.Event()
    t = threading.Thread(target=keepalive, args=(by, stop))
    t.start()
    try:
        before = dm.limit_hits("output_stall")
        c = dm.client()
        sid = c.call("session.create", {"model": "small"})["session"]
        c.close()
        s = connect(dm.socket)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(req("session.infer", {"session": sid, "layer": 0,
                                        "hidden": tensor(hidden(4096))}, id=1))
        closed = wait_for(lambda: dm.limit_hits("output_stall") > before, 10)
        s.close()
    finally:
        stop.set()
        t.join()
    by.check()
    assert closed, "a peer that never read a 1.4 MB answer is still connected after 10 s"


# ---- shared-memory maps (issue 14) ---------------------------------------------------------


def _memfd(n, seals):
    from hardening import harness  # tests/daemon/qmoed_harness.py
    return harness.memfd(n, seals, name="abuse-map")


def _send_fds(s, f, line, fds):
    """One line whose first byte carries fds; the parsed answer."""
    sent = socket.send_fds(s, [line], fds) if fds else 0
    s.sendall(line[sent:])
    return json.loads(f.readline())


def _maps_of(dm):
    with open("/proc/%d/maps" % dm.pid) as fh:
        return sum(1 for ln in fh if "memfd:abuse-map" in ln)


def test_bad_maps_get_their_documented_errors_and_leave_nothing(dm):
    import fcntl
    ok = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    sid, other = session(dm), session(dm)
    s = connect(dm.socket)
    f = s.makefile("rb")
    try:
        def map_req(nbytes, fds, who=None, rid=1):
            line = req("session.map", {"session": who or sid, "bytes": nbytes}, id=rid)
            r = _send_fds(s, f, line, fds)
            for fd in fds:
                os.close(fd)
            return r

        for fds, nbytes, why in [
                ([], 4096, "no descriptor"),
                ([_memfd(4096, 0)], 4096, "not sealed"),            # unsealed
                ([_memfd(4096, fcntl.F_SEAL_SEAL)], 4096, "F_SEAL_SHRINK"),
                ([_memfd(4096, ok)], 8192, "too small"),
                ([_memfd(4096, ok), _memfd(4096, ok)], 4096, "2 descriptors"),
                ([_memfd(4096, ok | fcntl.F_SEAL_WRITE)], 4096, "read-write")]:
            r = map_req(nbytes, fds)
            assert r["error"]["code"] == -32602 and r["error"]["data"]["field"] == "fd", r
            assert why in r["error"]["data"]["reason"], r
        # Too many mapped bytes: the default max_mapped_bytes is 1 GiB.
        big = _memfd(1 << 20, 0)
        os.ftruncate(big, (1 << 30) + 4096)
        fcntl.fcntl(big, fcntl.F_ADD_SEALS, ok)
        r = map_req((1 << 30) + 4096, [big])
        assert r["error"]["code"] == -32003, r
        # A good map, truncation refused by the kernel, regions outside it
        # and a map of another session.
        fd = _memfd(4096, ok)
        good = map_req(4096, [os.dup(fd)])["result"]["map"]
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.close(fd)
        theirs_fd = _memfd(4096, ok)
        theirs = map_req(4096, [theirs_fd], who=other)["result"]["map"]
        for hid, code, field in [
                ({"map": good, "offset": 4096 - 64}, -32602, "hidden.offset"),
                ({"map": good, "offset": 96}, -32602, "hidden.offset"),
                ({"map": theirs, "offset": 0}, -32001, "hidden.map")]:
            t = {"dtype": "f32", "shape": [2, H]}
            t.update(hid)
            s.sendall(req("session.infer", {"session": sid, "layer": 0, "hidden": t}))
            r = json.loads(f.readline())
            assert (r["error"]["code"], r["error"]["data"]["field"]) == (code, field), r
        assert _maps_of(dm) == 2
    finally:
        f.close()
        s.close()
    c = dm.client()
    c.call("session.close", {"session": sid})
    c.call("session.close", {"session": other})
    c.close()
    assert wait_for(lambda: _maps_of(dm) == 0, 5)


KILLED = r"""
import json, os, socket, sys, fcntl, mmap
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rb")
def call(m, p, fds=()):
    line = (json.dumps({"jsonrpc": "2.0", "id": 1, "method": m, "params": p}) + "\n").encode()
    n = socket.send_fds(s, [line], list(fds)) if fds else 0
    s.sendall(line[n:]); return json.loads(f.readline())["result"]
sid = call("session.create", {"model": "small"})["session"]
fd = os.memfd_create("abuse-map", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 1 << 20)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
m = call("session.map", {"session": sid, "bytes": 1 << 20}, [fd])["map"]
p = {"session": sid, "layer": 0, "hidden": {"dtype": "f32", "shape": [512, 64], "map": m,
     "offset": 0}, "output_to": {"map": m, "offset": 512 * 64 * 4}}
one = (json.dumps({"jsonrpc": "2.0", "id": 2, "method": "session.infer", "params": p}) + "\n")
s.sendall(one.encode() * 100)
print(sid, flush=True)
os.kill(os.getpid(), 9)
"""


def test_client_killed_while_its_map_is_in_use_harms_nobody(dm):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", KILLED, dm.socket], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    sid = p.stdout.strip()
    c = dm.client()
    # The bystander (checked by the fixture) and the daemon are untouched;
    # the victim's session keeps its map until it is closed.
    assert any(x["session"] == sid for x in c.call("session.list")["sessions"])
    c.call("session.close", {"session": sid})
    c.close()
    assert wait_for(lambda: _maps_of(dm) == 0, 10)
