"""Shared residency over the wire (docs/PAGING.md "Shared residency"):
sessions of one model with policy_params.share_residency and the same
policy draw experts from one pool whose budget is the sum of theirs. One
session's misses become the other's hits, the pool never holds more than
its budget, outputs are bitwise those of sessions of their own, each keeps
its own counters, admission counts every member's budget, and what cannot
share is refused naming the member."""
import os
import tempfile

import numpy as np
import pytest

from qmoed_harness import Daemon, from_tensor, make_bank, tensor

H = 64
SHARE = {"share_residency": True, "prefetch": False}


@pytest.fixture(scope="module")
def bank():
    d = tempfile.mkdtemp(prefix="qmoed-share-")
    return make_bank(os.path.join(d, "small.bank"))


@pytest.fixture(scope="module")
def daemon(bank):
    dm = Daemon(models={"small": bank})
    yield dm
    assert dm.stop() == 0, dm.log_text()


def per_expert(c):
    return c.call("model.list")["models"][0]["bytes_per_expert"]


def create(c, budget, share=True, policy="lru"):
    pp = dict(SHARE) if share else {"prefetch": False}
    return c.call("session.create", {"model": "small", "policy": policy, "budget_bytes": budget,
                                     "policy_params": pp})["session"]


def infer(c, sid, layer, x):
    r = c.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x)})
    return from_tensor(r["output"]), r["stats"]


def resident_experts(c, sid):
    plan = c.call("session.plan", {"session": sid})
    return sum(len(b.get("resident_now") or []) for b in plan["banks"])


def inputs():
    rng = np.random.default_rng(7)
    return [rng.standard_normal((6, H)).astype(np.float32) for _ in range(4)]


def test_one_sessions_misses_are_the_others_hits_and_outputs_do_not_change(daemon):
    c = daemon.client()
    bpe = per_expert(c)
    budget = 4 * bpe  # half of a layer's 8 experts each; the pool holds a whole layer
    alone = create(c, budget, share=False)
    want = [infer(c, alone, l % 2, x)[0] for l, x in enumerate(inputs())]
    a, b = create(c, budget), create(c, budget)
    got_a, got_b, b_misses = [], [], 0
    for l, x in enumerate(inputs()):
        out, _ = infer(c, a, l % 2, x)
        got_a.append(out)
        out, st = infer(c, b, l % 2, x)  # the same tokens: a paged its experts in
        got_b.append(out)
        b_misses += st["misses"]
        assert st["misses"] == 0 and st["hits"] > 0, st
        # The pool's bytes: never above the sum of the two budgets.
        assert resident_experts(c, a) * bpe <= 2 * budget
    for w, x, y in zip(want, got_a, got_b):
        assert w.tobytes() == x.tobytes() == y.tobytes()
    ta = c.call("telemetry.get", {"session": a})
    tb = c.call("telemetry.get", {"session": b})
    assert ta["expert_misses"] > 0 and tb["expert_misses"] == 0, (ta, tb)
    assert ta["requests"] == tb["requests"] == 4
    # Each session's resident_bytes is its budget's half of the pool's.
    pool = resident_experts(c, a) * bpe
    assert abs(ta["resident_bytes"] + tb["resident_bytes"] - pool) <= 2, (ta, tb, pool)
    for s in (alone, a, b):
        c.call("session.close", {"session": s})
    c.close()


def test_a_member_that_leaves_takes_its_share_and_resize_moves_the_pool(daemon):
    c = daemon.client()
    bpe = per_expert(c)
    a, b = create(c, 4 * bpe), create(c, 4 * bpe)
    for l, x in enumerate(inputs() * 2):
        infer(c, a, l % 2, x)
    assert resident_experts(c, a) > 4  # the pool took more than one budget
    c.call("session.close", {"session": b})  # nothing of b queued: its share goes now
    assert resident_experts(c, a) <= 4
    r = c.call("session.resize", {"session": a, "budget_bytes": 2 * bpe})
    assert r["budget_bytes"] == 2 * bpe
    assert resident_experts(c, a) <= 2
    t = c.call("telemetry.get", {"session": a})
    assert t["evictions"] > 0, t  # the shrink's evictions are the resizer's
    # Below what a session of its own needs: refused for a member too, even
    # while another member's budget would cover the pool's minimum.
    b = create(c, 4 * bpe)
    e = c.request("session.resize", {"session": a, "budget_bytes": 1})["error"]
    assert e["code"] == -32003 and e["data"]["field"] == "budget_bytes", e
    e = c.request("session.create", {"model": "small", "policy": "lru", "budget_bytes": 1,
                                      "policy_params": SHARE})["error"]
    assert e["code"] == -32003 and "below the minimum" in e["data"]["reason"], e
    c.call("session.close", {"session": b})
    c.call("session.close", {"session": a})
    c.close()


def test_admission_counts_every_members_budget(bank):
    probe = Daemon(models={"small": bank})
    try:
        c = probe.client()
        bpe, ws = per_expert(c), 16 << 20
        c.close()
    finally:
        probe.stop()
    dm = Daemon(models={"small": bank},
                args=["--device-budget", str(2 * (4 * bpe + ws) + bpe)])
    try:
        c = dm.client()
        a, b = create(c, 4 * bpe), create(c, 4 * bpe)
        e = c.request("session.create", {"model": "small", "policy": "lru",
                                          "budget_bytes": 4 * bpe,
                                          "policy_params": SHARE})["error"]
        assert e["code"] == -32003, e
        c.call("session.close", {"session": b})
        c.call("session.close", {"session": create(c, 4 * bpe)})
        c.call("session.close", {"session": a})
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_what_cannot_share_is_refused_naming_the_member(daemon, bank):
    c = daemon.client()
    e = c.request("session.create", {"model": "small", "policy": "static_hot",
                                      "policy_params": {"share_residency": True,
                                                        "hot": [{"layer": 0, "experts": [1]}]}})
    e = e["error"]
    assert e["code"] == -32602 and e["data"]["field"] == "policy_params.share_residency", e
    assert "cannot be combined with policy_params.hot" in e["data"]["reason"], e
    e = c.request("session.create", {"model": "small",
                                      "policy_params": {"share_residency": 1}})["error"]
    assert e["data"]["field"] == "policy_params.share_residency", e
    c.close()
    dm = Daemon(models={"small": bank}, args=["--device", "emu:0,emu:1"])
    try:
        c = dm.client()
        e = c.request("session.create", {"model": "small",
                                          "policy_params": {"share_residency": True}})["error"]
        assert e["data"]["field"] == "policy_params.share_residency", e
        assert "one device of the cpu or emu backend" in e["data"]["reason"], e
        c.close()
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_different_policies_do_not_share(daemon):
    c = daemon.client()
    bpe = per_expert(c)
    a = create(c, 4 * bpe, policy="lru")
    b = create(c, 4 * bpe, policy="lfu")
    x = inputs()[0]
    infer(c, a, 0, x)
    _, st = infer(c, b, 0, x)
    assert st["misses"] > 0, st  # its own pool: nothing of a's
    for s in (a, b):
        c.call("session.close", {"session": s})
    c.close()
