"""session.infer with routing supplied by the engine (topk_ids + topk_weights,
PROTOCOL.md "Routing supplied by the engine"), and banks that carry a routing
rule (BANK_FORMAT.md "Banks imported from real models"), over the wire of a
real qmoed.
"""
import base64
import os
import tempfile

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from qmoed_harness import Daemon, from_tensor, make_bank, tensor

H, E, K = 64, 8, 2


@pytest.fixture(scope="module")
def banks():
    d = tempfile.mkdtemp(prefix="qmoed-topk-")
    small = make_bank(os.path.join(d, "small.bank"))
    # The same experts with DeepSeek-V3's rule: sigmoid, correction bias,
    # 4 groups of 2 scored by their top-2 sum, 2 kept, renormalised, x 2.5.
    tensors = load_file(small)
    with safe_open(small, "np") as f:
        meta = dict(f.metadata())
    meta.update({"qmoe.routing.score": "sigmoid", "qmoe.routing.normalize": "1",
                 "qmoe.routing.scale": "2.5", "qmoe.routing.groups": "4",
                 "qmoe.routing.topk_groups": "2", "qmoe.routing.group_score": "top2_sum",
                 "qmoe.layer_map": "[1, 3]",
                 "qmoe.source": '{"format":"synthetic","exact":true}'})
    rng = np.random.default_rng(5)
    bias = {}
    for layer in (0, 1):
        bias[layer] = (0.2 * rng.standard_normal(E)).astype(np.float32)
        tensors["layers.%d.router.correction_bias" % layer] = bias[layer]
    v3 = os.path.join(d, "v3.bank")
    save_file(tensors, v3, metadata=meta)
    return {"small": small, "v3": v3, "tensors": tensors, "bias": bias}


@pytest.fixture(scope="module")
def daemon(banks):
    dm = Daemon(models={"small": banks["small"], "v3": banks["v3"]})
    yield dm
    assert dm.stop() == 0, dm.log_text()


def hidden(T, seed=0):
    return np.random.default_rng(seed).standard_normal((T, H)).astype(np.float32)


def i32(a):
    a = np.ascontiguousarray(a, dtype="<i4")
    return {"dtype": "i32", "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def bf16(a):
    bits = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    return {"dtype": "bf16", "shape": list(a.shape),
            "data": base64.b64encode(bits.tobytes()).decode()}


def session(c, model="small", **params):
    p = {"model": model}
    p.update(params)
    return c.call("session.create", p)["session"]


def infer(c, sid, x, layer=0, **extra):
    p = {"session": sid, "layer": layer, "hidden": tensor(x)}
    p.update(extra)
    return c.call("session.infer", p)


def routes_to_ids(routing, kk):
    ids = np.full((len(routing), kk), -1, np.int32)
    w = np.zeros((len(routing), kk), np.float32)
    for t, row in enumerate(routing):
        for j, (e, wt) in enumerate(row):
            ids[t, j] = e
            w[t, j] = wt
    return ids, w


def test_supplied_routing_equal_to_own_routing_gives_the_same_bits(daemon):
    c = daemon.client()
    sid = session(c)
    x = hidden(6, seed=1)
    own = infer(c, sid, x, return_routing=True)
    ids, w = routes_to_ids(own["routing"], K)
    # The wire's f32 weights are the engine's, so the combine is the same.
    got = infer(c, sid, x, topk_ids=i32(ids), topk_weights=tensor(w), return_routing=True)
    assert got["output"]["data"] == own["output"]["data"]
    assert got["routing"] == own["routing"]


def test_supplied_weights_are_used_exactly_as_given(daemon):
    c = daemon.client()
    sid = session(c)
    x = hidden(3, seed=2)
    ids = np.array([[7, 0, 3], [-1, 5, -1], [2, -1, 6]], np.int32)
    w = np.array([[0.9, 1.7, -0.4], [3.0, 0.25, 9.0], [1e-12, 2.0, -1.5]], np.float32)
    out = from_tensor(infer(c, sid, x, topk_ids=i32(ids), topk_weights=tensor(w))["output"])
    ref = np.zeros((3, H))
    for t in range(3):
        for j in range(3):
            if ids[t, j] < 0:
                continue
            y = from_tensor(infer(c, sid, x[t:t + 1], topk_ids=i32([[ids[t, j]]]),
                                  topk_weights=tensor(np.ones((1, 1), np.float32)))["output"])
            ref[t] += float(w[t, j]) * y[0].astype(np.float64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-6, err
    # k' may be anything in 1..E, wider than the bank's k = 2.
    all_ids = np.tile(np.arange(E, dtype=np.int32), (1, 1))
    r = infer(c, sid, x[:1], topk_ids=i32(all_ids),
              topk_weights=tensor(np.full((1, E), 0.125, np.float32)), return_routing=True)
    assert [e for e, _ in r["routing"][0]] == list(range(E))


def test_f16_and_bf16_weights_are_widened_exactly(daemon):
    c = daemon.client()
    sid = session(c)
    x = hidden(2, seed=3)
    ids = np.array([[1, 4], [6, 2]], np.int32)
    w = np.array([[0.75, 0.5], [1.25, -0.375]], np.float32)  # exact in f16 and bf16
    a = infer(c, sid, x, topk_ids=i32(ids), topk_weights=tensor(w))["output"]["data"]
    b = infer(c, sid, x, topk_ids=i32(ids), topk_weights=tensor(w.astype(np.float16)))
    d = infer(c, sid, x, topk_ids=i32(ids), topk_weights=bf16(w))
    assert b["output"]["data"] == a and d["output"]["data"] == a


def bad(c, sid, x, field, needle, **extra):
    p = {"session": sid, "layer": 0, "hidden": tensor(x)}
    p.update(extra)
    r = c.request("session.infer", p)
    assert "error" in r, r
    e = r["error"]
    assert e["code"] == -32602, e
    assert e["data"]["field"] == field, e
    assert needle in e["data"]["reason"], e


def test_every_bad_supplied_routing_is_32602_naming_the_field(daemon):
    c = daemon.client()
    sid = session(c)
    x = hidden(2, seed=4)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = tensor(np.ones((2, 2), np.float32))
    bad(c, sid, x, "topk_weights", "topk_weights is required with topk_ids", topk_ids=i32(ids))
    bad(c, sid, x, "topk_ids", "topk_ids is required with topk_weights", topk_weights=w)
    bad(c, sid, x, "router_logits", "router_logits must be absent", topk_ids=i32(ids),
        topk_weights=w, router_logits=tensor(np.zeros((2, E), np.float32)))
    bad(c, sid, x, "topk_ids", "topk_ids[1][0] = 8 but it must be in [-1, 8)",
        topk_ids=i32([[0, 1], [8, 3]]), topk_weights=w)
    bad(c, sid, x, "topk_ids", "topk_ids[0][1] = -2", topk_ids=i32([[0, -2], [2, 3]]),
        topk_weights=w)
    bad(c, sid, x, "topk_ids", "topk_ids[1] names expert 3 twice",
        topk_ids=i32([[0, 1], [3, 3]]), topk_weights=w)
    bad(c, sid, x, "topk_ids", "topk_ids has 9 columns but the model has 8 experts",
        topk_ids=i32(np.zeros((2, 9))), topk_weights=tensor(np.ones((2, 9), np.float32)))
    bad(c, sid, x, "topk_ids.shape", "topk_ids.shape[0] is 1 but hidden has 2 tokens",
        topk_ids=i32([[0, 1]]), topk_weights=tensor(np.ones((1, 2), np.float32)))
    bad(c, sid, x, "topk_ids.shape", "topk_ids.shape[1] is 0",
        topk_ids=i32(np.zeros((2, 0))), topk_weights=tensor(np.ones((2, 0), np.float32)))
    bad(c, sid, x, "topk_weights.shape", "topk_weights.shape is [2, 1]", topk_ids=i32(ids),
        topk_weights=tensor(np.ones((2, 1), np.float32)))
    bad(c, sid, x, "topk_ids.dtype", "is not one of i32", topk_ids=tensor(ids.astype(np.float32)),
        topk_weights=w)
    bad(c, sid, x, "topk_weights.dtype", "is not one of f32, f16, bf16", topk_ids=i32(ids),
        topk_weights=i32(ids))
    bad(c, sid, x, "topk_ids.data", "holds 4 bytes but shape x i32 needs 16", topk_ids=dict(i32(ids), data="AAAAAA=="),
        topk_weights=w)
    # The session still serves after all that.
    infer(c, sid, x, topk_ids=i32(ids), topk_weights=w)


def test_paging_sees_the_supplied_experts_and_keeps_the_bits(daemon):
    c = daemon.client()
    bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
    whole = session(c)
    paged = session(c, policy="lru", budget_bytes=3 * bpe,
                    policy_params={"prefetch": False, "warm_from_profile": False})
    x = hidden(4, seed=6)
    calls = [np.array([[5, 1], [5, -1], [1, 5], [-1, -1]], np.int32),
             np.array([[6, 7], [0, 7], [6, 0], [2, 7]], np.int32),
             np.array([[5, 1], [5, -1], [1, 5], [-1, -1]], np.int32)]
    w = np.array([[0.6, 0.4], [1.0, 0.0], [0.3, 0.7], [0.0, 0.0]], np.float32)
    for n, ids in enumerate(calls):
        a = infer(c, whole, x, topk_ids=i32(ids), topk_weights=tensor(w))
        b = infer(c, paged, x, topk_ids=i32(ids), topk_weights=tensor(w))
        assert a["output"]["data"] == b["output"]["data"]
        if n == 0:
            # Experts 1 and 5, both missed, and resident afterwards.
            assert b["stats"]["misses"] == 2 and b["stats"]["hits"] == 0, b["stats"]
            plan = c.call("session.plan", {"session": paged})
            assert plan["banks"][0]["resident_now"] == [1, 5], plan["banks"][0]
    assert b["stats"]["misses"] + b["stats"]["hits"] == 2, b["stats"]
    c.call("session.close", {"session": whole})
    c.call("session.close", {"session": paged})


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def v3_reference(logits, bias, k=K, groups=4, topk_groups=2, scale=2.5):
    """transformers' DeepseekV3TopkRouter in float64."""
    s = sigmoid(logits.astype(np.float64))
    choice = s + bias
    per = E // groups
    g = np.sort(choice.reshape(groups, per), axis=1)[:, -2:].sum(axis=1)
    keep = np.argsort(-g, kind="stable")[:topk_groups]
    mask = np.zeros(E, bool)
    for gi in keep:
        mask[gi * per:(gi + 1) * per] = True
    choice = np.where(mask, choice, 0.0)
    sel = np.argsort(-choice, kind="stable")[:k]
    w = s[sel] / (s[sel].sum() + 1e-20) * scale
    return sel, w


def test_bank_routing_rule_chooses_as_the_family_does(daemon, banks):
    c = daemon.client()
    info = [m for m in c.call("model.list")["models"] if m["name"] == "v3"]
    assert info, c.call("model.list")
    sid = session(c, "v3")
    x = hidden(16, seed=7)
    for layer in (0, 1):
        wr = banks["tensors"]["layers.%d.router.weight" % layer].astype(np.float64)
        logits = x.astype(np.float64) @ wr.T
        if "layers.%d.router.bias" % layer in banks["tensors"]:
            logits += banks["tensors"]["layers.%d.router.bias" % layer]
        r = infer(c, sid, x, layer=layer, return_routing=True)
        for t in range(16):
            sel, w = v3_reference(logits[t].astype(np.float32), banks["bias"][layer])
            got = r["routing"][t]
            assert [e for e, _ in got] == list(sel), (layer, t, got, sel)
            assert np.allclose([wt for _, wt in got], w, rtol=1e-6, atol=1e-6), (got, w)
        # The rule's routes supplied back give the same bits.
        ids, w = routes_to_ids(r["routing"], K)
        again = infer(c, sid, x, layer=layer, topk_ids=i32(ids), topk_weights=tensor(w))
        assert again["output"]["data"] == r["output"]["data"]
