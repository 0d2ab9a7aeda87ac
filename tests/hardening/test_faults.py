"""Allocation failures injected in the engine and paging paths (issue 8,
item 3), through the real daemon.

QMOED_FAULT_ALLOC=N (daemon/qm_worker.c, a test hook) makes the Nth
allocation made while a worker runs a job fail, once: those are the
session build (pager, slots, layers) and the inference (engine buffers,
demand paging, prefetch). A first daemon with N=0 counts the allocations
of the script below; then one daemon per N walks through them. Every time
the client must get either the right answer or a clean JSON-RPC error with
a reason, the daemon must keep serving (a retry gives the bit-identical
output), and it must exit 0 (under ASan, LeakSanitizer makes a leak a
non-zero exit).
"""
import re

import numpy as np
import pytest

from hardening import Daemon, make_bank, tensor

# A budget of a few experts per session makes inference page on demand.
SESSIONS = ({"model": "small"},
            {"model": "small", "policy": "lru", "budget_bytes": 20000})
CLEAN_CODES = {-32603, -32003}
MAX_POINTS = 40  # daemons started for the walk; spread over the count


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    return make_bank(str(tmp_path_factory.mktemp("h8faults") / "small.bank"))


def x():
    rng = np.random.default_rng(3)
    return tensor(rng.standard_normal((4, 64)).astype(np.float32))


def call_or_error(c, method, params):
    r = c.request(method, params)
    if "error" in r:
        e = r["error"]
        assert e["code"] in CLEAN_CODES, r
        assert isinstance(e.get("message"), str) and e["message"], r
        return None, e
    return r["result"], None


def script(dm):
    """Creates each kind of session and runs two inferences on it, retrying
    what failed. Returns the outputs and the errors seen."""
    outs, errors = [], []
    c = dm.client()
    try:
        for params in SESSIONS:
            sid = None
            for _ in range(3):
                res, e = call_or_error(c, "session.create", params)
                if e:
                    errors.append(("session.create", e))
                    continue
                sid = res["session"]
                break
            assert sid, "session.create kept failing: %r" % errors
            for layer in (0, 1):
                out = None
                for _ in range(3):
                    res, e = call_or_error(c, "session.infer",
                                           {"session": sid, "layer": layer, "hidden": x()})
                    if e:
                        errors.append(("session.infer", e))
                        continue
                    out = res["output"]
                    break
                assert out is not None, "session.infer kept failing: %r" % errors
                outs.append(out)
            assert c.call("session.close", {"session": sid}) is not None
        assert c.call("daemon.status")["version"]
    finally:
        c.close()
    return outs, errors


def run(bank, n):
    dm = Daemon(models={"small": bank}, env={"QMOED_FAULT_ALLOC": str(n)})
    try:
        outs, errors = script(dm)
    finally:
        rc = dm.stop()
    log = dm.log_text()
    assert rc == 0, "qmoed exited %d with QMOED_FAULT_ALLOC=%d:\n%s" % (rc, n, log[-3000:])
    m = re.search(r"QMOED_FAULT_ALLOC: (\d+) worker allocations", log)
    assert m, "the fault hook did not report (not installed?):\n" + log[-2000:]
    return outs, errors, int(m.group(1))


def test_allocation_failures_in_engine_and_pager_give_clean_errors(bank):
    expect, errors, count = run(bank, 0)
    assert not errors and count > 0
    if count <= MAX_POINTS:
        points = range(1, count + 1)
    else:
        points = sorted({1 + i * (count - 1) // (MAX_POINTS - 1) for i in range(MAX_POINTS)})
    failed = {"session.create": 0, "session.infer": 0}
    absorbed = 0
    for n in points:
        outs, errors, _ = run(bank, n)
        # Whatever failed, the retried requests give exactly the answers
        # of the fault-free daemon.
        assert outs == expect, "output changed after fault #%d" % n
        for method, _ in errors:
            failed[method] += 1
        absorbed += not errors
    print("worker allocations %d, points %d, errors %s, absorbed %d"
          % (count, len(points), failed, absorbed))
    # The walk must really reach both paths, not only succeed around them.
    assert failed["session.create"] > 0 and failed["session.infer"] > 0, failed
