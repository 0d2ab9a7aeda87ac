"""Several devices per daemon over the wire (issue 18 part 2).

A real qmoed with two emulated devices (`--device emu:0,emu:1`: host memory
treated as device memory, every expert copied in, copies landing at their
fence) next to a one-device CPU qmoed: the placement in session.plan and in
`qmoectl plan`/`status`, budgets admitted and refused per device with a
message naming the device, session.infer outputs bitwise equal to the CPU
daemon's for on_miss page, host and auto, what a session over several
devices refuses, and bad device lists refused at start with exit code 2.
"""
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

from qmoed_harness import BUILD, Daemon, make_bank, qmoed_path, tensor

H = 64
LAYERS = 4
EXPERTS = 8
WS = 1 << 20  # session_workspace_bytes of the daemons here
QMOECTL = os.path.join(BUILD, "clients", "qmoectl")


@pytest.fixture(scope="module")
def bank():
    d = tempfile.mkdtemp(prefix="qmoed-devices-")
    return make_bank(os.path.join(d, "four.bank"), layers=LAYERS, experts=EXPERTS)


def start(bank, *args):
    return Daemon(models={"m": bank},
                  args=["--set", "session_workspace_bytes=%d" % WS, *args])


@pytest.fixture(scope="module")
def two(bank):
    """Two emulated devices, the first with twice the budget of the second."""
    dm = start(bank, "--device", "emu:0,emu:1", "--device-budget", "64M,32M")
    yield dm
    assert dm.stop() == 0, dm.log_text()


@pytest.fixture(scope="module")
def cpu(bank):
    dm = start(bank)
    yield dm
    assert dm.stop() == 0, dm.log_text()


def bytes_per_expert(c):
    return c.call("model.list")["models"][0]["bytes_per_expert"]


def create(c, **params):
    p = {"model": "m"}
    p.update(params)
    return c.call("session.create", p)["session"]


def qmoectl(dm, *args):
    p = subprocess.run([QMOECTL, "--socket", dm.socket, *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return p.stdout


def test_status_lists_every_device_and_keeps_the_device_object(two, cpu):
    st = two.client().call("daemon.status")
    assert st["backend"] == "emu"
    assert [(d["name"], d["kind"], d["budget_bytes"]) for d in st["devices"]] == \
        [("emu:0", "emu", 64 << 20), ("emu:1", "emu", 32 << 20)]
    for d in st["devices"]:
        assert d["description"].startswith(d["name"] + " (emulated") and d["total_bytes"] > 0
    # The compatible object sums the devices.
    assert set(st["device"]) == {"name", "total_bytes", "budget_bytes", "used_bytes"}
    assert st["device"]["budget_bytes"] == 96 << 20
    # One device: the list has the backend's one device, the object as before.
    one = cpu.client().call("daemon.status")
    assert [d["name"] for d in one["devices"]] == ["cpu"]
    assert one["devices"][0]["budget_bytes"] == one["device"]["budget_bytes"]
    out = qmoectl(two, "status")
    assert re.search(r"^device\s+emu:0: budget 64\.0 MiB, used .*, emu$", out, re.M), out
    assert re.search(r"^device\s+emu:1: budget 32\.0 MiB", out, re.M), out
    assert not re.search(r"^device ", qmoectl(cpu, "status"), re.M)


def test_placement_follows_the_free_budgets_in_the_plan_and_in_qmoectl(two):
    c = two.client()
    bpe = bytes_per_expert(c)
    sid = create(c, policy="lru", budget_bytes=12 * bpe)
    plan = c.call("session.plan", {"session": sid})
    pl = plan["placement"]
    assert pl["rule"] == "layers_contiguous"
    assert [d["name"] for d in pl["devices"]] == ["emu:0", "emu:1"]
    # Weights 63M : 31M (free beyond a workspace), equal layers: the middles
    # of layers 0..2 fall in the first two thirds, layer 3 on emu:1; the
    # budget split by the bytes placed.
    assert [b["device"] for b in plan["banks"]] == [0, 0, 0, 1]
    assert pl["devices"][0]["budget_bytes"] == 12 * bpe * 3 // 4
    assert sum(d["budget_bytes"] for d in pl["devices"]) == 12 * bpe
    # Each device was charged its share plus a workspace.
    used = [d["used_bytes"] for d in c.call("daemon.status")["devices"]]
    assert used == [d["budget_bytes"] + WS for d in pl["devices"]]
    out = qmoectl(two, "plan", sid)
    assert "placement layers_contiguous: emu:0 budget" in out, out
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("BANK"))
    assert lines[head].split()[:3] == ["BANK", "LAYER", "DEVICE"]
    rows = [l.split() for l in lines[head + 1:head + 1 + LAYERS]]
    assert [(r[1], r[2]) for r in rows] == [("0", "emu:0"), ("1", "emu:0"), ("2", "emu:0"),
                                           ("3", "emu:1")], out
    c.call("session.close", {"session": sid})
    assert [d["used_bytes"] for d in c.call("daemon.status")["devices"]] == [0, 0]


def test_one_device_plans_carry_no_placement(cpu):
    c = cpu.client()
    sid = create(c, policy="lru", budget_bytes=4 * bytes_per_expert(c))
    plan = c.call("session.plan", {"session": sid})
    assert "placement" not in plan and all("device" not in b for b in plan["banks"])
    assert "DEVICE" not in qmoectl(cpu, "plan", sid)
    c.call("session.close", {"session": sid})


def test_budgets_are_admitted_and_refused_per_device(bank):
    # Weights are what each device has free beyond a workspace: 200000 on
    # emu:1 against WS + 200000 on emu:0, so emu:1 gets the last of 4 layers.
    budgets = (2 * WS + 200000, WS + 200000)
    dm = start(bank, "--device", "emu:0,emu:1", "--device-budget", "%d,%d" % budgets)
    try:
        c = dm.client()
        bpe = bytes_per_expert(c)
        total = LAYERS * EXPERTS * bpe
        # The whole model's budget: the last layer's share on emu:1.
        a = create(c)
        plan = c.call("session.plan", {"session": a})
        on1 = plan["placement"]["devices"][1]["budget_bytes"]
        assert [b["device"] for b in plan["banks"]] == [0, 0, 0, 1] and on1 == total // 4
        st = c.call("daemon.status")["devices"]
        assert st[1]["used_bytes"] == on1 + WS
        # emu:1 now has less than a workspace free: it gets no layers.
        b = create(c, policy="lru", budget_bytes=4 * bpe)
        plan = c.call("session.plan", {"session": b})
        assert [b_["device"] for b_ in plan["banks"]] == [0] * LAYERS
        assert plan["placement"]["devices"][1]["budget_bytes"] == 0
        # Neither has a workspace free now (equal weights, then): refused
        # naming the first device that cannot take its share, the field and
        # both sides of the rule.
        r = c.request("session.create", {"model": "m", "budget_bytes": 3 * total})
        err = r["error"]
        assert err["message"] == "resource_exhausted" and err["data"]["field"] == "budget_bytes"
        assert re.fullmatch(
            r"session needs \d+ bytes on device emu:0 \(its share \d+ of the budget %d "
            r"\+ workspace %d\) but only \d+ bytes of that device's budget %d are free"
            % (3 * total, WS, budgets[0]), err["data"]["reason"]), err
        for sid in (a, b):
            c.call("session.close", {"session": sid})
        assert [d["used_bytes"] for d in c.call("daemon.status")["devices"]] == [0, 0]
        # Nothing held: the same session is admitted again.
        c.call("session.close", {"session": create(c)})
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_outputs_are_the_cpu_daemons_bits_for_every_on_miss(two, cpu):
    c2, c1 = two.client(), cpu.client()
    bpe = bytes_per_expert(c2)
    ref = create(c1)
    sids = {"whole": create(c2)}
    for m in ("page", "host", "auto"):
        sids[m] = create(c2, policy="lru", budget_bytes=6 * bpe,
                         policy_params={"on_miss": m, "prefetch": m == "page"})
    rng = np.random.default_rng(18)
    seen = {m: {"misses": 0, "host_runs": 0} for m in sids}
    for n in range(16):
        layer = n % LAYERS
        x = rng.standard_normal((1 + n % 5, H)).astype(np.float32)
        want = c1.call("session.infer", {"session": ref, "layer": layer,
                                         "hidden": tensor(x)})["output"]["data"]
        for m, sid in sids.items():
            r = c2.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x)})
            assert r["output"]["data"] == want, (m, n, layer)
            for k in seen[m]:
                seen[m][k] += r["stats"][k]
    # Both devices did work; on_miss still decides where a miss runs.
    assert seen["page"]["misses"] > 0 and seen["page"]["host_runs"] == 0, seen
    assert seen["host"]["host_runs"] > 0 and seen["host"]["misses"] == 0, seen
    for m in ("page", "host", "auto"):
        plan = c2.call("session.plan", {"session": sids[m]})
        assert plan["execution"]["on_miss"] == m
        assert plan["execution"]["expert_misses"] == seen[m]["misses"], plan
        assert {b["device"] for b in plan["banks"]} == {0, 1}
    for sid in sids.values():
        c2.call("session.close", {"session": sid})
    c1.call("session.close", {"session": ref})


def test_resize_works_over_several_devices(two):
    # tests/daemon/test_qmoed_resize.py has it in full.
    c = two.client()
    sid = create(c, policy="lru", budget_bytes=8 * bytes_per_expert(c))
    c.call("session.resize", {"session": sid, "budget_bytes": 4 * bytes_per_expert(c)})
    c.call("session.close", {"session": sid})


def test_a_two_device_session_records_the_one_device_trace(bank):
    # The same requests on a session over two devices and on a one-device
    # session write the same .qmtr file, byte for byte.
    d = tempfile.mkdtemp(prefix="qmoed-devtrace-")
    states = [os.path.join(d, n) for n in ("two", "one")]
    for s in states:
        os.mkdir(s)
    dms = [start(bank, "--device", "emu:0,emu:1", "--state-dir", states[0]),
           start(bank, "--state-dir", states[1])]
    try:
        for dm in dms:
            c = dm.client()
            sid = create(c, policy="lru", budget_bytes=6 * bytes_per_expert(c),
                         policy_params={"record_trace": "t.qmtr"})
            if dm is dms[0]:
                plan = c.call("session.plan", {"session": sid})
                assert {b["device"] for b in plan["banks"]} == {0, 1}, plan
            rng = np.random.default_rng(7)
            for step in range(5):  # a decoder's order: every layer per step
                x = rng.standard_normal((1 + step % 3, H)).astype(np.float32)
                for layer in range(LAYERS):
                    c.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x)})
            c.call("session.close", {"session": sid})
        traces = []
        for s in states:
            with open(os.path.join(s, "t.qmtr"), "rb") as f:
                traces.append(f.read())
        assert len(traces[0]) > 40 and traces[0] == traces[1]
    finally:
        for dm in dms:
            assert dm.stop() == 0, dm.log_text()


def test_the_mapping_is_registered_with_every_device(bank):
    # Each device may hold layers of the model (a session's placement): the
    # mapping is registered with each at load and unregistered at unload, so
    # loading it again registers it again without an overlap refused.
    dm = start(bank, "--device", "emu:0,emu:1")
    try:
        c = dm.client()
        c.call("model.unload", {"name": "m"})
        c.call("model.load", {"name": "m", "path": bank})
        log = dm.log_text()
        for dev in ("emu:0", "emu:1"):
            assert len(re.findall(r"model m: \d+ mapped bytes registered with %s\b" % dev,
                                  log)) == 2, log
        assert "cannot register" not in log and "cannot unregister" not in log, log
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_one_listed_device_behaves_as_one_device(bank):
    dm = start(bank, "--device", "emu:0", "--set", "emu_copy_mbps=2000")
    try:
        c = dm.client()
        st = c.call("daemon.status")
        assert st["backend"] == "emu" and [d["name"] for d in st["devices"]] == ["emu:0"]
        assert "copies at 2 GB/s" in st["devices"][0]["description"], st  # the modelled copy
        sid = create(c, policy="lru", budget_bytes=4 * bytes_per_expert(c))
        assert "placement" not in c.call("session.plan", {"session": sid})
        # session.resize works as on any one-device daemon.
        c.call("session.resize", {"session": sid, "budget_bytes": 6 * bytes_per_expert(c)})
        c.call("session.close", {"session": sid})
    finally:
        assert dm.stop() == 0, dm.log_text()


@pytest.mark.parametrize("args, says", [
    (["--device", "cuda:x"], "device 'cuda:x': the index must be a number 0..255"),
    (["--device", "emu:"], "device 'emu:': the index must be a number"),
    (["--device", "emu:0,emu:0"], "device 'emu:0' is listed twice"),
    (["--device", ""], "device list is empty"),
    (["--device", "emu:0,,emu:1"], "entry 2 is empty"),
    (["--device", ",".join("emu:%d" % i for i in range(17))], "more than 16 devices"),
    (["--device", "tpu:0"], "device 'tpu:0': unknown kind 'tpu'"),
    (["--device", "emu:0,cuda:1"], "the list mixes kinds (emu and cuda)"),
    (["--backend", "cpu", "--device", "emu:0"], "needs backend emu"),
    (["--device", "emu:0,emu:1", "--device-budget", "1G,1G,1G"],
     "device_budget has 3 values for 2 devices"),
    (["--device-budget", "1G,x"], "value 2 must be a positive number of bytes"),
])
def test_bad_device_lists_are_refused_at_start(args, says):
    d = tempfile.mkdtemp(prefix="qmoed-baddev-")
    cmd = [qmoed_path(), "--socket", os.path.join(d, "s.sock"), *args]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert says in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "s.sock"))
