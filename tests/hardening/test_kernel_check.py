"""The CPU kernels prove themselves before they serve (issue 40, items 3 and
4's last clause), through the real daemon.

qmoed runs the self-check at start (engine/kernels/qm_kernel_check.h):

- a daemon logs the check (CPU, flags, kernels verified and refused, its
  cost) and daemon.status lists the verdicts;
- QMOED_FAULT_KERNEL=fast:NAME:LANE (a test hook) breaks one lane of the
  kernel the measured choice serves decode with: the check refuses it, the
  log says so, daemon.status lists it refused, and a fast session's outputs
  are bitwise those of a daemon without the hook (it never serves);
- QMOE_KERNEL forcing that refused kernel: the daemon does not start, and
  says why;
- the kernel cache in the state dir (kernels.cache): a second start reads
  the verdicts from it; a file truncated, garbage, or written by another
  version is ignored, rebuilt whole, and never trusted.
"""
import os
import re
import shutil
import tempfile

import numpy as np
import pytest

from hardening import Daemon, from_tensor, make_bank, tensor

H = 64


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    return make_bank(str(tmp_path_factory.mktemp("kc") / "small.safetensors"), hidden=H,
                     inter=32, experts=8, k=2, block=32)


def status_kernels(d):
    c = d.client()
    try:
        return c.call("daemon.status")
    finally:
        c.close()


def fast_outputs(d, T=(1, 3, 9)):
    """A fast whole-bank session's outputs for fixed inputs, per T."""
    c = d.client()
    try:
        sid = c.call("session.create", {"model": "small", "precision": "fast"})["session"]
        out = []
        for t in T:
            x = np.random.default_rng(t).standard_normal((t, H)).astype(np.float32)
            r = c.call("session.infer", {"session": sid, "layer": 1, "hidden": tensor(x)})
            out.append(from_tensor(r["output"]).tobytes())
        c.call("session.close", {"session": sid})
        return out
    finally:
        c.close()


def decode_kernel(status):
    """The fast kernel the measured choice serves 4-bit decode with."""
    m = re.search(r"fast measured[^:]*: q4 ([a-z0-9]+)", status["device"]["name"])
    return m.group(1) if m else None


def names(kernels, key):
    return {(k["precision"], k["name"]) for k in kernels[key]}


@pytest.fixture(scope="module")
def reference(bank):
    d = Daemon(models={"small": bank})
    try:
        st = status_kernels(d)
        log = d.log_text()
        return {"status": st, "outputs": fast_outputs(d), "log": log}
    finally:
        assert d.stop() == 0


def test_status_and_log_report_the_check(reference):
    k = reference["status"]["kernels"]
    assert k["cpu"] and isinstance(k["check_ms"], float) and k["check_ms"] >= 0
    assert ("exact", "scalar") not in names(k, "verified")  # the specification is no candidate
    assert k["refused"] == []
    line = [ln for ln in reference["log"].splitlines() if "kernel self-check on" in ln]
    assert len(line) == 1, reference["log"]
    assert k["cpu"] in line[0] and "verified" in line[0] and "refused none" in line[0]
    if decode_kernel(reference["status"]):
        assert ("fast", decode_kernel(reference["status"])) in names(k, "verified")
    for u in k["unavailable"]:
        assert u["reason"], u


def test_broken_lane_is_refused_and_never_serves(bank, reference):
    name = decode_kernel(reference["status"])
    if not name:
        pytest.skip("this CPU's fast decode runs the scalar kernel: no SIMD kernel to break")
    d = Daemon(models={"small": bank}, env={"QMOED_FAULT_KERNEL": "fast:%s:3" % name})
    try:
        st = status_kernels(d)
        k = st["kernels"]
        refused = [r for r in k["refused"] if r["name"] == name and r["precision"] == "fast"]
        assert refused and "output [0][3]" in refused[0]["reason"], k
        assert decode_kernel(st) != name, st["device"]["name"]
        assert fast_outputs(d) == reference["outputs"]  # the same bits: it never served
        log = d.log_text()
        assert re.search(r"kernel self-check: fast kernel %s refused, never used, on " % name, log)
        assert "QMOED_FAULT_KERNEL" in log
    finally:
        assert d.stop() == 0


def test_forcing_a_refused_kernel_refuses_to_start(bank, reference):
    name = decode_kernel(reference["status"])
    if not name:
        pytest.skip("this CPU's fast decode runs the scalar kernel: no SIMD kernel to break")
    d = Daemon(models={"small": bank}, wait=False,
               env={"QMOED_FAULT_KERNEL": "fast:%s" % name, "QMOE_KERNEL": name})
    rc = d.proc.wait(30)
    d.log.close()
    log = d.log_text()
    assert rc != 0, log
    assert re.search(r"QMOE_KERNEL=%s: the fast kernel %s was refused by the self-check on .*"
                     r"not starting" % (name, name), log), log


def start_with_cache(bank, state, text=None):
    """A daemon on state dir `state`, its kernels.cache first written with
    `text` (None: left as it is); its status's kernels, its log, and the
    cache's text after it started."""
    path = os.path.join(state, "kernels.cache")
    if text is not None:
        with open(path, "wb") as f:
            f.write(text)
    d = Daemon(models={"small": bank}, args=["--state-dir", state])
    try:
        k = status_kernels(d)["kernels"]
        log = d.log_text()
    finally:
        assert d.stop() == 0
    with open(path, "rb") as f:
        return k, log, f.read()


def test_kernel_cache_faults_are_never_trusted(bank):
    state = tempfile.mkdtemp(prefix="qmoed-kc-")
    try:
        k, _, good = start_with_cache(bank, state)
        assert not k["cached"] and good.startswith(b"qmoe-kernel-check 6|"), good
        k, _, again = start_with_cache(bank, state)
        assert k["cached"] and again == good
        first = good.split(b"\n")[0] + b"\n"
        other_version = first.replace(b"qmoe-kernel-check 6|", b"qmoe-kernel-check 5|", 1)
        cases = {"truncated": good[: len(first) // 2],
                 "truncated at the line's end": first[:-1],
                 "garbage": b"\x00\x01not a cache\xff\n" * 3,
                 "another version": other_version + good[len(first):]}
        for what, text in cases.items():
            k, log, after = start_with_cache(bank, state, text)
            assert not k["cached"], what
            assert "kernel cache" in log and "ignored" in log, (what, log)
            assert after.startswith(first), (what, after)  # rebuilt whole
            assert k["refused"] == [], what
    finally:
        shutil.rmtree(state, ignore_errors=True)
