"""policy_params over the wire: each policy's knobs reach it as given.

A real qmoed on a temp socket; the policies' parameters are declared by the
policies themselves (residency registry), so a knob given as 0 must arrive
as 0, not as "absent, use the default".
"""
import os
import tempfile

import pytest

from qmoed_harness import Daemon, make_bank, tensor


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="qmoed-params-")
    dm = Daemon(models={"small": make_bank(os.path.join(d, "small.bank"))})
    yield dm
    assert dm.stop() == 0, dm.log_text()


HOT = [{"layer": 0, "experts": [3, 1, 5]}, {"layer": 1, "experts": [2, 0]}]


def plan_of(c, policy_params, policy="static_hot"):
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    sid = c.call("session.create", {"model": "small", "policy": policy, "budget_bytes": 12 * bpe,
                                    "policy_params": policy_params})["session"]
    plan = c.call("session.plan", {"session": sid})
    c.call("session.close", {"session": sid})
    return plan


def refused(c, policy, policy_params):
    r = c.request("session.create", {"model": "small", "policy": policy,
                                     "policy_params": policy_params})
    assert "error" in r, r
    return r["error"]


def test_pin_fraction_zero_pins_nothing(daemon):
    c = daemon.client()
    plan = plan_of(c, {"hot": HOT, "pin_fraction": 0})
    assert plan["policy"] == "static_hot"
    assert [b["decision"] for b in plan["banks"]] == ["per_expert_candidate"] * 2, plan
    assert all(not b.get("pinned") for b in plan["banks"]), plan


def test_pin_fraction_absent_takes_the_default_and_pins(daemon):
    # Default 0.5 of 12 experts' bytes over 2 listed banks: 3 per bank,
    # capped by the lists (3 and 2). The control for the test above.
    c = daemon.client()
    plan = plan_of(c, {"hot": HOT})
    assert [b.get("pinned", []) for b in plan["banks"]] == [[1, 3, 5], [0, 2]], plan


def test_a_knob_of_another_policy_is_refused_naming_it(daemon):
    c = daemon.client()
    e = refused(c, "lru", {"pin_fraction": 0})
    assert e["code"] == -32602 and e["data"]["field"] == "policy_params.pin_fraction", e
    assert "applies to policy static_hot only" in e["data"]["reason"], e
    assert refused(c, "lfu", {"decay": 1.5})["data"]["field"] == "policy_params.decay"
    e = refused(c, "lfu", {"decy": 0.5})
    assert e["data"]["field"] == "policy_params.decy" and "decay" in e["data"]["reason"], e


def test_the_registry_s_new_policies_are_offered_with_their_knobs(daemon):
    c = daemon.client()
    for policy, params in (("arc", {}), ("layered_lru", {}),
                           ("next_use", {"decay": 0.95}), ("next_use", {"decay": 0}),
                           ("next_use", {})):
        plan = plan_of(c, params, policy=policy)
        assert plan["policy"] == policy
        assert [b["decision"] for b in plan["banks"]] == ["per_expert_candidate"] * 2, plan
    for policy in ("arc", "lru"):
        e = refused(c, policy, {"decay": 0.5})
        assert e["data"]["field"] == "policy_params.decay", e
        assert "applies to policies lfu, next_use only" in e["data"]["reason"], e
    assert refused(c, "next_use", {"decay": 2})["data"]["field"] == "policy_params.decay"
    e = refused(c, "fifo", {})
    assert "whole_bank, static_hot, lru, lfu, arc, layered_lru, next_use" in \
        e["data"]["reason"], e


def test_every_new_policy_gives_whole_bank_s_bits_at_small_budgets(daemon):
    np = pytest.importorskip("numpy")
    c = daemon.client()
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    rng = np.random.default_rng(5)
    xs = [tensor(rng.standard_normal((T, 64)).astype(np.float32)) for T in (1, 3, 1, 5, 1, 2)]
    outs = {}
    for policy, budget in (("whole_bank", None), ("arc", 2), ("arc", 5), ("layered_lru", 2),
                           ("layered_lru", 5), ("next_use", 2), ("next_use", 5)):
        p = {"model": "small", "policy": policy}
        if budget:
            p["budget_bytes"] = budget * bpe
        sid = c.call("session.create", p)["session"]
        got = [c.call("session.infer", {"session": sid, "layer": i % 2, "hidden": x})
               ["output"]["data"] for i, x in enumerate(xs)]
        c.call("session.close", {"session": sid})
        outs[(policy, budget)] = got
    ref = outs.pop(("whole_bank", None))
    for key, got in outs.items():
        assert got == ref, key
