"""qmoed over the wire, session.resize: elastic budgets under load with outputs
bitwise equal to whole_bank and resident bytes never above the budget in
force, ordering with the session's inferences, the minimum, the daemon-wide
budget and permissions.
"""
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from qmoed_harness import Client, Daemon, from_tensor, tensor
from qmoed_suite import daemon_open_to_all, err, hidden, new_session, run_as

WORKSPACE = 16 << 20  # the daemon's default session_workspace_bytes


def bpe_of(c):
    return c.call("model.list")["models"][0]["bytes_per_expert"]


def test_shrink_and_grow_under_load_keep_outputs_and_the_budget(daemon):
    c = daemon.client()
    bpe = bpe_of(c)
    inputs = [(i % 2, hidden(1 + i % 3, seed=100 + i)) for i in range(48)]
    ref_sid = new_session(c)
    refs = [from_tensor(c.call("session.infer", {"session": ref_sid, "layer": l,
                                                 "hidden": tensor(x)})["output"])
            for l, x in inputs]
    for policy, params in (("lru", {}), ("next_use", {}),
                           ("static_hot", {"hot": [{"layer": 0, "experts": [1, 3, 5]}],
                                           "pin_fraction": 1.0})):
        sid = new_session(c, policy=policy, budget_bytes=8 * bpe, policy_params=params)
        stop, infer_done = threading.Event(), threading.Event()
        seen = {"resizes": [], "list": 0, "errors": [], "during": 0}

        def resizer():
            # Resizes back to back for as long as the inferences run.
            rc = daemon.client()
            steps = (2, 16, 1, 5, 12, 3, 8, 1, 16)
            try:
                while not infer_done.is_set() or len(seen["resizes"]) % len(steps):
                    b = steps[len(seen["resizes"]) % len(steps)]
                    r = rc.call("session.resize", {"session": sid, "budget_bytes": b * bpe})
                    seen["resizes"].append(r)
                    if not infer_done.is_set():
                        seen["during"] += 1
            except Exception as e:  # reported below
                seen["errors"].append(repr(e))

        def watcher():
            wc = daemon.client()
            while not stop.is_set():
                for s in wc.call("session.list")["sessions"]:
                    if s["session"] == sid:
                        seen["list"] += 1
                        if s["resident_bytes"] > s["budget_bytes"]:
                            seen["errors"].append("list: %r" % s)

        threads = [threading.Thread(target=resizer), threading.Thread(target=watcher)]
        for t in threads:
            t.start()
        # Inferences pipelined on their own connection while the resizes land:
        # six rounds, and more until two resizes landed during them (on a
        # fast machine the rounds may be over before the resizer is going).
        ic = daemon.client()
        try:
            rnd, deadline = 0, time.time() + 120
            while rnd < 6 or seen["during"] < 2:
                assert time.time() < deadline and not seen["errors"], seen
                rnd += 1
                for i, (l, x) in enumerate(inputs):
                    ic.send_raw((json.dumps({"jsonrpc": "2.0", "id": i, "method": "session.infer",
                                             "params": {"session": sid, "layer": l,
                                                        "hidden": tensor(x)}}) + "\n").encode())
                for _ in inputs:
                    r = ic.read()
                    assert "result" in r, r
                    out = from_tensor(r["result"]["output"])
                    assert out.tobytes() == refs[r["id"]].tobytes(), (policy, rnd, r["id"])
        finally:
            infer_done.set()
            threads[0].join()
            stop.set()
            threads[1].join()
        assert not seen["errors"], seen["errors"]
        assert seen["during"] >= 2 and seen["list"] > 0, seen["during"]
        for r in seen["resizes"]:
            assert r["resident_bytes"] <= r["budget_bytes"], r
            assert r["plan_summary"]["budget_bytes"] == r["budget_bytes"]
        if policy == "static_hot":
            # 1 unit cannot hold any pin: all three were released, and the plan says so.
            assert seen["resizes"][2]["plan_summary"]["pins_released"] == 3
            plan = c.call("session.plan", {"session": sid})
            assert plan["banks"][0]["pins_released"] == [1, 3, 5]
        plan = c.call("session.plan", {"session": sid})
        assert plan["budget_bytes"] == 16 * bpe and plan["resident_bytes"] <= 16 * bpe
        c.call("session.close", {"session": sid})
    c.call("session.close", {"session": ref_sid})


def test_resize_is_ordered_with_the_sessions_inferences(daemon):
    c = daemon.client()
    bpe = bpe_of(c)
    # 12 of the 16 experts: nothing is preloaded.
    sid = new_session(c, policy="lru", budget_bytes=12 * bpe,
                      policy_params={"prefetch": False, "warm_from_profile": False})
    x = tensor(hidden(4, seed=7))
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "session.infer",
              "params": {"session": sid, "layer": 0, "hidden": x}},
             {"jsonrpc": "2.0", "id": 2, "method": "session.resize",
              "params": {"session": sid, "budget_bytes": bpe}},
             {"jsonrpc": "2.0", "id": 3, "method": "session.infer",
              "params": {"session": sid, "layer": 0, "hidden": x}},
             {"jsonrpc": "2.0", "id": 4, "method": "session.resize",
              "params": {"session": sid, "budget_bytes": 12 * bpe}},
             {"jsonrpc": "2.0", "id": 5, "method": "session.infer",
              "params": {"session": sid, "layer": 0, "hidden": x}},
             {"jsonrpc": "2.0", "id": 6, "method": "session.infer",
              "params": {"session": sid, "layer": 0, "hidden": x}}]
    c.send_raw((json.dumps(batch) + "\n").encode())
    out = {r["id"]: r for r in json.loads(c.read_line())}
    first, shrunk, after = (out[i]["result"] for i in (1, 2, 3))
    # The first inference ran under 12 units (nothing evicted); the resize
    # after it left one unit, so the same routing misses again after it.
    assert first["stats"]["misses"] > 1 and after["stats"]["misses"] == first["stats"]["misses"]
    assert shrunk["budget_bytes"] == bpe and shrunk["resident_bytes"] <= bpe
    assert out[4]["result"]["resident_bytes"] <= bpe  # growing loads nothing
    assert out[6]["result"]["stats"]["misses"] == 0  # grown: the second run hits
    for i in (3, 5, 6):
        assert out[i]["result"]["output"] == first["output"]
    c.call("session.close", {"session": sid})


def test_resize_below_the_minimum_is_refused_like_create(daemon):
    c = daemon.client()
    bpe = bpe_of(c)
    created = err(c.request("session.create", {"model": "small", "policy": "lru",
                                               "budget_bytes": bpe - 1}))
    sid = new_session(c, policy="lru", budget_bytes=4 * bpe)
    e = err(c.request("session.resize", {"session": sid, "budget_bytes": bpe - 1}))
    assert e["code"] == created["code"] == -32003
    assert e["data"]["field"] == created["data"]["field"] == "budget_bytes"
    assert e["data"]["reason"] == created["data"]["reason"], (e, created)
    assert "below the minimum of %d bytes" % bpe in e["data"]["reason"]
    entry = [s for s in c.call("session.list")["sessions"] if s["session"] == sid][0]
    assert entry["budget_bytes"] == 4 * bpe  # unchanged
    # whole_bank: the minimum is the whole model.
    wb = new_session(c)
    total = c.call("model.list")["models"][0]["bytes_total"]
    e = err(c.request("session.resize", {"session": wb, "budget_bytes": total - 1}))
    assert e["code"] == -32003 and "below the minimum of %d" % total in e["data"]["reason"]
    for bad in (0, -1, "1", None):
        assert err(c.request("session.resize", {"session": sid, "budget_bytes": bad}))[
            "code"] == -32602
    assert err(c.request("session.resize", {"session": sid}))["code"] == -32602
    assert err(c.request("session.resize", {"session": "0" * 32, "budget_bytes": bpe}))[
        "code"] == -32001
    for s in (sid, wb):
        c.call("session.close", {"session": s})


def test_growth_is_admitted_against_the_daemon_wide_budget(banks):
    probe = Daemon(models={"small": banks["small"]})
    bpe = bpe_of(probe.client())
    assert probe.stop() == 0
    dm = Daemon(models={"small": banks["small"]},
                args=["--device-budget", str(WORKSPACE + 10 * bpe)])
    try:
        c = dm.client()
        sid = new_session(c, policy="lru", budget_bytes=4 * bpe)
        assert c.call("daemon.status")["device"]["used_bytes"] == WORKSPACE + 4 * bpe
        e = err(c.request("session.resize", {"session": sid, "budget_bytes": 11 * bpe}))
        assert e["code"] == -32003 and e["data"]["field"] == "budget_bytes"
        assert "needs %d more bytes but only %d bytes" % (7 * bpe, 6 * bpe) in e["data"]["reason"]
        assert c.call("daemon.status")["device"]["used_bytes"] == WORKSPACE + 4 * bpe
        assert c.call("session.resize", {"session": sid,
                                         "budget_bytes": 10 * bpe})["budget_bytes"] == 10 * bpe
        assert c.call("daemon.status")["device"]["used_bytes"] == WORKSPACE + 10 * bpe
        # Grow then shrink pipelined: the growth stays reserved until the
        # shrink behind it is done, then only the final budget is held.
        batch = [{"jsonrpc": "2.0", "id": i, "method": "session.resize",
                  "params": {"session": sid, "budget_bytes": b * bpe}}
                 for i, b in enumerate((3, 9, 2))]
        c.send_raw((json.dumps(batch) + "\n").encode())
        assert all("result" in r for r in json.loads(c.read_line()))
        assert c.call("daemon.status")["device"]["used_bytes"] == WORKSPACE + 2 * bpe
        c.call("session.close", {"session": sid})
        assert c.call("daemon.status")["device"]["used_bytes"] == 0
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_only_the_owner_or_an_admin_may_resize(banks):
    dm = daemon_open_to_all(banks)
    try:
        root = dm.client()
        bpe = bpe_of(root)
        root_sid = new_session(root, policy="lru", budget_bytes=4 * bpe)

        def as_user():
            c = Client(dm.socket)
            out = {"other": c.request("session.resize", {"session": root_sid,
                                                         "budget_bytes": 2 * bpe})}
            sid = c.request("session.create", {"model": "small", "policy": "lru",
                                               "budget_bytes": 4 * bpe})["result"]["session"]
            out["own"] = c.request("session.resize", {"session": sid, "budget_bytes": 2 * bpe})
            out["sid"] = sid
            return out

        out = run_as(65534, as_user)
        assert "exception" not in out, out
        assert out["other"]["error"]["code"] == -32002, out
        assert out["other"]["error"]["data"]["field"] == "session"
        assert out["own"]["result"]["budget_bytes"] == 2 * bpe
        # An admin may resize the user's session.
        assert root.call("session.resize", {"session": out["sid"],
                                            "budget_bytes": 3 * bpe})["budget_bytes"] == 3 * bpe
        entry = [s for s in root.call("session.list")["sessions"] if s["session"] == root_sid][0]
        assert entry["budget_bytes"] == 4 * bpe
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_a_session_over_two_devices_resizes_by_share(banks, daemon):
    """Two emulated devices: the budget split by the placement's rule, growth
    admitted per device (refused naming the device, as session.create is),
    outputs bitwise the CPU daemon's across the resizes."""
    cpu = daemon.client()
    bpe = bpe_of(cpu)
    ref = new_session(cpu)
    budgets = (WORKSPACE + 8 * bpe, WORKSPACE + 6 * bpe)
    dm = Daemon(models={"small": banks["small"]},
                args=["--device", "emu:0,emu:1", "--device-budget", "%d,%d" % budgets])
    try:
        c = dm.client()
        sid = new_session(c, policy="lru", budget_bytes=4 * bpe)
        plan = c.call("session.plan", {"session": sid})
        assert [b["device"] for b in plan["banks"]] == [0, 1]

        def used():
            return [d["used_bytes"] for d in c.call("daemon.status")["devices"]]

        def infer_all(seed):
            for layer in (0, 1, 0, 1):
                x = tensor(hidden(1 + seed % 3, seed=seed))
                seed += 1
                want = cpu.call("session.infer", {"session": ref, "layer": layer, "hidden": x})
                got = c.call("session.infer", {"session": sid, "layer": layer, "hidden": x})
                assert got["output"]["data"] == want["output"]["data"], (seed, layer)

        assert used() == [WORKSPACE + 2 * bpe] * 2
        infer_all(1)
        for n, b in enumerate((8, 12, 2, 5)):
            r = c.call("session.resize", {"session": sid, "budget_bytes": b * bpe})
            assert r["budget_bytes"] == b * bpe and r["resident_bytes"] <= b * bpe
            share = [b * bpe // 2, b * bpe - b * bpe // 2]
            plan = c.call("session.plan", {"session": sid})
            assert [d["budget_bytes"] for d in plan["placement"]["devices"]] == share
            assert used() == [WORKSPACE + s for s in share]
            infer_all(10 * (n + 2))
        # Growth emu:1 cannot hold: refused with session.create's message,
        # nothing changed.
        e = err(c.request("session.resize", {"session": sid, "budget_bytes": 14 * bpe}))
        assert e["code"] == -32003 and e["data"]["field"] == "budget_bytes"
        assert e["data"]["reason"] == (
            "session needs %d bytes on device emu:1 (its share %d of the budget %d + workspace "
            "%d) but only %d bytes of that device's budget %d are free"
            % (WORKSPACE + 7 * bpe, 7 * bpe, 14 * bpe, WORKSPACE, budgets[1], budgets[1]))
        assert used() == [WORKSPACE + 5 * bpe // 2, WORKSPACE + 5 * bpe - 5 * bpe // 2]
        # Below one device's minimum (one expert unit): refused naming it.
        e = err(c.request("session.resize", {"session": sid, "budget_bytes": bpe}))
        assert e["data"]["field"] == "budget_bytes" and "device 0" in e["data"]["reason"], e
        infer_all(99)
        c.call("session.close", {"session": sid})
        assert used() == [0, 0]
    finally:
        assert dm.stop() == 0, dm.log_text()
    cpu.call("session.close", {"session": ref})
