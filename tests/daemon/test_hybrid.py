"""Hybrid execution over the wire (issue 18 part 1): policy_params.on_miss.

A real qmoed (CPU backend) on a temp socket: sessions with on_miss page,
host and auto under a budget below the model give the whole-bank session's
output bits; `host` runs every miss on the host and copies nothing on
demand; the counters (session.infer stats.host_runs, telemetry.get
expert_host_runs, the Prometheus text, session.plan's "execution") agree; a
bad value is refused naming the field.
"""
import os
import tempfile

import numpy as np
import pytest

from qmoed_harness import Daemon, make_bank, tensor

H = 64


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="qmoed-hybrid-")
    dm = Daemon(models={"small": make_bank(os.path.join(d, "small.bank"))})
    yield dm
    assert dm.stop() == 0, dm.log_text()


def session(c, **params):
    p = {"model": "small"}
    p.update(params)
    return c.call("session.create", p)["session"]


def infer(c, sid, x, layer):
    return c.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x)})


def test_every_on_miss_gives_the_whole_bank_bits_and_counts_where_experts_ran(daemon):
    c = daemon.client()
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    whole = session(c)
    sids = {m: session(c, policy="lru", budget_bytes=3 * bpe,
                       policy_params={"on_miss": m, "prefetch": False})
            for m in ("page", "host", "auto")}
    rng = np.random.default_rng(18)
    totals = {m: {"hits": 0, "misses": 0, "host_runs": 0} for m in sids}
    for n in range(12):
        x = rng.standard_normal((1 + n % 4, H)).astype(np.float32)
        ref = infer(c, whole, x, n % 2)["output"]["data"]
        for m, sid in sids.items():
            r = infer(c, sid, x, n % 2)
            assert r["output"]["data"] == ref, (m, n)
            for key in totals[m]:
                totals[m][key] += r["stats"][key]
    assert totals["page"]["host_runs"] == 0 and totals["page"]["misses"] > 0, totals
    assert totals["host"]["misses"] == 0 and totals["host"]["host_runs"] > 0, totals
    for m, sid in sids.items():
        t = c.call("telemetry.get", {"session": sid})
        assert t["expert_host_runs"] == totals[m]["host_runs"], (m, t)
        assert t["expert_misses"] == totals[m]["misses"], (m, t)
        plan = c.call("session.plan", {"session": sid})
        ex = plan["execution"]
        assert ex["on_miss"] == m, plan
        assert ex["expert_host_runs"] == totals[m]["host_runs"], plan
        assert ex["expert_misses"] == totals[m]["misses"], plan
    # The whole-bank session reports the default.
    assert c.call("session.plan", {"session": whole})["execution"]["on_miss"] == "page"
    text = c.call("telemetry.metrics")["text"]
    assert "# TYPE qmoed_expert_host_runs_total counter" in text
    assert ('qmoed_session_expert_host_runs_total{model="small",session="%s"} %d'
            % (sids["host"], totals["host"]["host_runs"])) in text, text
    for sid in [whole, *sids.values()]:
        c.call("session.close", {"session": sid})


def test_a_bad_on_miss_is_refused_naming_the_field(daemon):
    c = daemon.client()
    for bad in ("gpu", 1, None):
        r = c.request("session.create", {"model": "small", "policy": "lru",
                                         "policy_params": {"on_miss": bad}})
        assert "error" in r, r
        e = r["error"]
        assert e["code"] == -32602 and e["data"]["field"] == "policy_params.on_miss", e
        assert "page" in e["data"]["reason"] and "auto" in e["data"]["reason"], e
