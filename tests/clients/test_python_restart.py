"""The Python client across a daemon restart (docs/ENGINES.md "Across a
daemon restart"): a layer call that finds the daemon gone brings its session
back (same id, its options, warm from its last plan, its maps passed again,
the model loaded again from the bank the client knows) and is retried once,
with the same bits; a daemon that never comes back fails the call with the
error it met once the window passes; reconnect=0 fails at once. A map the
daemon reclaimed while the session lived on (its connection long closed) is
passed again and the call retried."""

import logging
import threading
import time

import numpy as np
import pytest

from conftest import HIDDEN, Daemon
from qmoe_client import Client, QmoeError


def restart(d, workdir, bank, with_model=True):
    d.proc.kill()
    d.proc.wait()
    d.log.close()
    return Daemon(workdir, bank, d.dir.rsplit("/", 1)[1], with_model=with_model)


@pytest.fixture
def engine(fresh_daemon):
    """A paged session with one map holding a token's input, routing and
    output: what an engine's layer call looks like."""
    c = Client(fresh_daemon.socket, reconnect=20, warm_interval=0)
    bpe = c.models()[0]["bytes_per_expert"]
    sid = c.create_session("demo", policy="lru", budget_bytes=4 * bpe,
                           policy_params={"prefetch": False})["session"]
    shm = c.map(sid, 1 << 16)
    x, y = shm.alloc((1, HIDDEN), "f32"), shm.alloc((1, HIDDEN), "f32")
    ids, w = shm.alloc((1, 2), "i32"), shm.alloc((1, 2), "f32")
    x.array[:] = np.random.default_rng(4).standard_normal((1, HIDDEN))
    ids.array[:] = [[1, 6]]
    w.array[:] = [[0.75, 0.25]]

    def call(layer):
        r = c.infer(sid, layer, x, topk_ids=ids, topk_weights=w, output_to=y)
        return r.output.copy(), r.stats

    yield c, sid, shm, call
    c.close()


def test_infer_outlives_a_daemon_restart(engine, fresh_daemon, workdir, bank, caplog):
    c, sid, shm, call = engine
    want = [call(layer)[0] for layer in (0, 1)]
    caplog.set_level(logging.WARNING, logger="qmoe_client")
    d = restart(fresh_daemon, workdir, bank)
    try:
        out, st = call(0)
        assert c.restores == 1
        assert np.array_equal(out, want[0])
        assert st["hits"] == 2 and st["misses"] == 0, st  # warm from the last plan
        assert np.array_equal(call(1)[0], want[1])
        assert shm.id is not None and [s["session"] for s in c.sessions()] == [sid]
        text = caplog.text
        assert "went away" in text and "session %s is back after" % sid in text, text
        assert "4 experts warm" in text, text
        assert c.ring_active(sid)
        # Restarted, and the client reconnected by another call first: the
        # layer call finds a daemon without the session when it opens the
        # ring; the session comes back and its calls take the ring again
        # (they used to stay on the socket for good).
        d = restart(d, workdir, bank)
        with pytest.raises(QmoeError):
            c.models()  # meets the broken connection
        assert c.models()  # reconnects
        assert np.array_equal(call(0)[0], want[0])
        assert c.restores == 2
        assert c.ring_active(sid)
        # Without its model: the client loads the bank it was told of.
        c.set_model_bank("demo", bank)
        d = restart(d, workdir, bank, with_model=False)
        assert np.array_equal(call(1)[0], want[1])
        assert c.restores == 3
        assert "its model loaded again from its bank" in caplog.text
    finally:
        d.stop()
        fresh_daemon.proc = d.proc  # the fixture stops what is left


def test_a_call_noted_after_another_thread_reconnected_is_still_restored(engine, fresh_daemon,
                                                                          workdir, bank):
    """A layer call answered by the old daemon and noted only after another
    thread has reconnected to the new one (the note comes after the answer,
    outside the client's lock): the session's next call must still bring
    it back. The note used to take the new connection for the one that
    answered, so the new daemon's "no such session" looked final and every
    later call failed until the next restart."""
    c, sid, shm, call = engine
    want = call(0)[0]
    d = restart(fresh_daemon, workdir, bank)
    try:
        def other_thread():
            with pytest.raises(QmoeError):
                c.models()  # meets the broken connection
            assert c.models()  # reconnects: the new daemon, without the session
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        c.note_call(sid)  # the late note of the call the old daemon answered
        assert np.array_equal(call(0)[0], want)
        assert c.restores == 1
    finally:
        d.stop()
        fresh_daemon.proc = d.proc


def test_a_daemon_that_stays_away_fails_the_call_after_the_window(engine, fresh_daemon):
    c, sid, shm, call = engine
    call(0)
    c.reconnect = 1.0
    fresh_daemon.proc.kill()
    fresh_daemon.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(QmoeError) as e:
        call(0)
    took = time.monotonic() - t0
    assert e.value.name == "connection_lost", e.value
    assert 0.9 <= took < 5, took
    assert c.restores == 0


def test_reconnect_off_fails_at_once(fresh_daemon, workdir, bank):
    c = Client(fresh_daemon.socket, reconnect=0)
    sid = c.create_session("demo")["session"]
    x = np.ones((1, HIDDEN), np.float32)
    c.infer(sid, 0, x)
    d = restart(fresh_daemon, workdir, bank)
    try:
        with pytest.raises(QmoeError) as e:
            c.infer(sid, 0, x)
        assert e.value.name == "connection_lost"
        with pytest.raises(QmoeError) as e:
            c.infer(sid, 0, x)
        assert e.value.name == "not_found" and e.value.field == "session"
    finally:
        c.close()
        d.stop()
        fresh_daemon.proc = d.proc


def test_a_map_the_daemon_reclaimed_is_passed_again(workdir, bank, caplog):
    """The daemon reclaims a map once the connection that last used it has
    been closed for session_orphan_timeout_s while another connection keeps
    its session: here the client's, closed for being idle (its calls on the
    socket: a connection with a call ring open is never idle-closed). The
    next call passes the map again and gives the same bits (without that it
    failed with "hidden.map N is not a map of this session")."""
    d = Daemon(workdir, bank, "map-again", extra=["--set", "idle_timeout_s=1", "--set",
                                                  "session_orphan_timeout_s=1"])
    try:
        c = Client(d.socket, reconnect=20, warm_interval=-1)
        c.ring_mode = "off"
        sid = c.create_session("demo")["session"]
        shm = c.map(sid, 1 << 16)
        x, y = shm.alloc((2, HIDDEN), "f32"), shm.alloc((2, HIDDEN), "f32")
        x.array[:] = np.random.default_rng(8).standard_normal((2, HIDDEN))
        want = c.infer(sid, 0, x, output_to=y).output.copy()
        first = shm.id
        keeper = Client(d.socket, reconnect=0)
        for _ in range(12):  # 3.6 s: past the idle close and the map's reclaim
            keeper.plan(sid)
            time.sleep(0.3)
        assert keeper.call("telemetry.get")["daemon"]["maps_reclaimed"] == 1
        caplog.set_level(logging.WARNING, logger="qmoe_client")
        y.array[:] = 0
        assert np.array_equal(c.infer(sid, 0, x, output_to=y).output, want)
        assert shm.id != first
        assert "no longer held map %d of session %s" % (first, sid) in caplog.text
        keeper.close()
        c.close_session(sid)
        c.close()
    finally:
        d.stop()


def plan_after_restore(c, sid, restores):
    """The plan of `sid` once a call has met the restarted daemon's broken
    connection and the client brought the session back (its restores-th)."""
    with pytest.raises(QmoeError) as gone:
        c.plan(sid)  # meets the broken connection
    assert c.restore(sid, gone.value) and c.restores == restores
    return c.plan(sid)


def test_a_session_brought_back_is_not_given_its_pending_bytes_again(fresh_daemon, workdir, bank):
    """client_pending_bytes is what the client takes after session.create:
    by a restart it has taken them, so the session re-created with its
    options leaves nothing free for them again."""
    c = Client(fresh_daemon.socket, reconnect=20, warm_interval=-1)
    try:
        pending = 1 << 20
        r = c.create_session("demo", policy="lru", budget="auto", client_pending_bytes=pending)
        sid = r["session"]
        assert r["budget_auto"]["client_pending_bytes"] == pending, r
        d = restart(fresh_daemon, workdir, bank)
        try:
            plan = plan_after_restore(c, sid, 1)
            assert plan["budget_auto"]["client_pending_bytes"] == 0, plan["budget_auto"]
        finally:
            d.stop()
            fresh_daemon.proc = d.proc
    finally:
        c.close()


def test_a_resized_session_comes_back_with_its_resize_as_given(fresh_daemon, workdir, bank):
    """A resize sets the budget a restart brings the session back with: a
    resize to "auto" with client_pending_bytes is kept as "auto" (sized
    again on the new daemon), without the bytes; then bytes in place of
    the "auto" (the daemon takes one budget member, not two)."""
    c = Client(fresh_daemon.socket, reconnect=20, warm_interval=-1)
    try:
        bpe = c.models()[0]["bytes_per_expert"]
        sid = c.create_session("demo", policy="lru", budget="50%")["session"]
        r = c.resize_session(sid, budget="auto", client_pending_bytes=1 << 20)
        assert r["budget_auto"]["client_pending_bytes"] == 1 << 20, r
        d = restart(fresh_daemon, workdir, bank)
        try:
            plan = plan_after_restore(c, sid, 1)
            assert plan["budget_auto"]["client_pending_bytes"] == 0, plan["budget_auto"]
            c.resize_session(sid, 5 * bpe)
            d = restart(d, workdir, bank)
            plan = plan_after_restore(c, sid, 2)
            assert plan["budget_bytes"] == 5 * bpe and "budget_auto" not in plan, plan
        finally:
            d.stop()
            fresh_daemon.proc = d.proc
    finally:
        c.close()
