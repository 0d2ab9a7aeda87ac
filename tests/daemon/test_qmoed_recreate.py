"""qmoed over the wire, session.create's members for a session re-created
after a daemon restart (docs/PROTOCOL.md "session.create", docs/ENGINES.md
"Across a daemon restart"): `session`, the old id taken again, and `warm`,
the old session's residency loaded before the answer, so that the new
session's first calls hit; their refusals.
"""
import signal

import numpy as np

from qmoed_harness import Daemon, from_tensor, tensor
from qmoed_suite import err, hidden, new_session

K = 2  # the small bank's top-k


def resident_lists(c, sid):
    """session.plan's resident experts per paged bank, as `warm` takes them."""
    plan = c.call("session.plan", {"session": sid})
    return [{"layer": b["layer"], "experts": b["resident_now"]}
            for b in plan["banks"] if b.get("resident_now")]


def test_a_session_recreated_under_its_id_starts_warm_and_gives_the_same_bits(banks):
    """Daemon A serves a paged session; it is SIGKILLed; daemon B takes the
    session's id and its residency from A's last plan: the answer names the
    same id and the experts warmed, B's plan holds the same experts, and
    B's first calls on the same inputs hit every expert and give A's bits."""
    a = Daemon(models={"small": banks["small"]})
    c = a.client()
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    opts = {"model": "small", "policy": "lru", "budget_bytes": 6 * bpe,
            "policy_params": {"prefetch": False}}
    sid = c.call("session.create", opts)["session"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    ids = np.array([[1, 6]], dtype=np.int32)
    w = np.array([[0.75, 0.25]], dtype=np.float32)

    def call(cl, layer):
        return cl.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x),
                                         "topk_ids": tensor(ids), "topk_weights": tensor(w)})

    want = [from_tensor(call(c, layer)["output"]) for layer in (0, 1)]
    warm = resident_lists(c, sid)
    assert warm == [{"layer": 0, "experts": [1, 6]}, {"layer": 1, "experts": [1, 6]}]
    c.close()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)

    b = Daemon(models={"small": banks["small"]}, workdir=a.dir, socket_path=a.socket)
    try:
        c = b.client()
        r = c.call("session.create", dict(opts, session=sid, warm=warm))
        assert r["session"] == sid
        assert r["warmed"] == 4
        assert r["resident_bytes"] == 4 * bpe
        assert resident_lists(c, sid) == warm
        for layer in (0, 1):
            got = call(c, layer)
            assert got["stats"]["hits"] == K and got["stats"]["misses"] == 0, got["stats"]
            assert np.array_equal(from_tensor(got["output"]), want[layer])
        # Without warm, the same re-creation starts from the model's hotness
        # profile (B's calls above routed 1 and 6 at both layers): it hits.
        c.call("session.close", {"session": sid})
        r = c.call("session.create", dict(opts, session=sid))
        assert r["session"] == sid and "warmed" not in r
        got = call(c, 0)
        assert got["stats"]["hits"] == K and got["stats"]["misses"] == 0, got["stats"]
        assert np.array_equal(from_tensor(got["output"]), want[0])
        # ... and told not to, it starts cold: its first call misses.
        c.call("session.close", {"session": sid})
        cold = dict(opts, session=sid, policy_params={"prefetch": False, "warm_from_profile": False})
        r = c.call("session.create", cold)
        got = call(c, 0)
        assert got["stats"]["misses"] == K
        assert np.array_equal(from_tensor(got["output"]), want[0])
        c.close()
    finally:
        assert b.stop() == 0, b.log_text()
    assert "session %s warmed: 4 experts loaded" % sid in b.log_text()


def test_warm_stops_at_the_budget_and_skips_whole_banks(daemon):
    c = daemon.client()
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    # Three slots: the first three experts listed win, none evicted for a later one.
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget_bytes": 3 * bpe,
                                   "policy_params": {"prefetch": False},
                                   "warm": [{"layer": 1, "experts": [7, 2]},
                                            {"layer": 0, "experts": [5, 0, 3]}]})
    assert r["warmed"] == 3
    assert resident_lists(c, r["session"]) == [{"layer": 0, "experts": [5]},
                                               {"layer": 1, "experts": [2, 7]}]
    # A whole-bank session has nothing to warm.
    r = c.call("session.create", {"model": "small", "warm": [{"layer": 0, "experts": [1]}]})
    assert r["warmed"] == 0
    # An empty list is no list.
    r = c.call("session.create", {"model": "small", "policy": "lru", "budget_bytes": 3 * bpe,
                                  "warm": []})
    assert "warmed" not in r
    c.close()


def test_recreate_refusals_name_the_member(daemon):
    c = daemon.client()
    sid = new_session(c)
    for bad, why in ((sid[:-1], "32 lowercase hex digits"), (sid.upper(), "lowercase hex"),
                     (sid[:-1] + "g", "got '"), (7, "must be a string, got a number"),
                     ("", "must not be empty")):
        e = err(c.request("session.create", {"model": "small", "session": bad}))
        assert e["code"] == -32602 and e["data"]["field"] == "session", e
        assert why in e["data"]["reason"], e
    # The id of a live session: conflict, and nothing is created.
    before = len(c.call("session.list")["sessions"])
    e = err(c.request("session.create", {"model": "small", "session": sid}))
    assert e["code"] == -32008 and e["data"]["field"] == "session", e
    assert "session %s exists" % sid in e["data"]["reason"]
    assert len(c.call("session.list")["sessions"]) == before
    for warm, field, why in (
            ({"layer": 0}, "warm", "must be an array"),
            ([{"layer": 2, "experts": [0]}], "warm[0].layer", "layer 2 is out of range"),
            ([{"layer": 0, "experts": [0, 8]}], "warm[0].experts[1]", "expert 8 is out of range"),
            ([{"layer": 0, "experts": [3, 3]}], "warm[0].experts[1]", "repeats expert 3"),
            ([{"layer": 1, "experts": []}, {"layer": 1, "experts": [0]}], "warm[1]",
             "repeats layer 1"),
            ([{"layer": 0, "experts": [0], "hot": 1}], "warm[0].hot", "unknown member"),
            ([{"layer": 0, "experts": [-1]}], "warm[0].experts[0]", "")):
        e = err(c.request("session.create", {"model": "small", "policy": "lru",
                                             "budget_bytes": 1 << 20, "warm": warm}))
        assert e["code"] == -32602 and e["data"]["field"] == field, (warm, e)
        assert why in e["data"]["reason"], (warm, e)
    assert len(c.call("session.list")["sessions"]) == before
    c.close()


def test_a_recreated_id_is_an_ordinary_session(daemon):
    """Closed and re-created, an id is a session like any other: infer,
    list and close work."""
    c = daemon.client()
    sid = new_session(c)
    c.call("session.close", {"session": sid})
    r = c.call("session.create", {"model": "small", "session": sid})
    assert r["session"] == sid
    out = c.call("session.infer", {"session": sid, "layer": 0, "hidden": tensor(hidden(2))})
    assert from_tensor(out["output"]).shape == (2, 64)
    assert any(s["session"] == sid for s in c.call("session.list")["sessions"])
    c.call("session.close", {"session": sid})
    assert not any(s["session"] == sid for s in c.call("session.list")["sessions"])
    c.close()
