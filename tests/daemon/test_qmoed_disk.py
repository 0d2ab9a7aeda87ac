"""qmoed over the wire, direct disk paging (paging_source): a paged CPU
session reads its experts from the bank file with O_DIRECT (outputs bitwise
equal to whole_bank, bytes read and stall time in telemetry.get and the
metrics), `paging_source: mmap` keeps the mapping, a bank on tmpfs falls back
with a logged reason, and a disk read error fails that request only. The
I/O engine (io_engine, io_depth): io_uring and the forced pool of threads
have many reads in flight (counted in telemetry, qmoectl shows them), the
serial engine one, all with the same bits; bad values are refused at start.
"""
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from qmoed_harness import BUILD, Daemon, from_tensor, tensor
from qmoed_suite import err, hidden, new_session


def direct_dir():
    """A directory on a filesystem that takes O_DIRECT reads, or None."""
    for d in (os.environ.get("QMOE_TEST_DISK_DIR"), os.getcwd(), "/var/tmp", "/tmp"):
        if not d or not os.path.isdir(d):
            continue
        try:
            fd, path = tempfile.mkstemp(dir=d)
        except OSError:
            continue
        try:
            os.write(fd, b"\0" * 8192)
            os.close(fd)
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            import mmap
            buf = mmap.mmap(-1, 4096)
            ok = os.preadv(dfd, [buf], 0) == 4096
            os.close(dfd)
            if ok and os.statvfs(d).f_bsize and not path.startswith("/dev/shm"):
                return d
        except OSError:
            pass
        finally:
            os.unlink(path)
    return None


@pytest.fixture(scope="module")
def disk_bank(banks):
    d = direct_dir()
    if d is None:
        pytest.skip("no filesystem here takes O_DIRECT")
    tmp = tempfile.mkdtemp(dir=d, prefix="qmoed-disk-")
    path = os.path.join(tmp, "small.bank")
    shutil.copy(banks["small"], path)
    yield path
    shutil.rmtree(tmp, ignore_errors=True)


def run_all(c, sid, inputs):
    return [from_tensor(c.call("session.infer", {"session": sid, "layer": l,
                                                 "hidden": tensor(x)})["output"]).tobytes()
            for l, x in inputs]


INPUTS = [(i % 2, hidden(1 + i % 4, seed=200 + i)) for i in range(24)]


def run_failing_once(c, sid, ref, bank):
    """Runs INPUTS on sid: a request that fails must be internal_error naming
    the bank file and the offset of the read, and succeed when sent again
    (the expert read again); every output equals ref. The requests that
    failed."""
    failed = 0
    for (l, x), want in zip(INPUTS, ref):
        params = {"session": sid, "layer": l, "hidden": tensor(x)}
        r = c.request("session.infer", params)
        if "error" in r:
            e = err(r)
            assert e["code"] == -32603, e
            reason = e["data"]["reason"]
            assert "Input/output error" in reason and bank in reason, e
            assert re.search(r"at offset \d+", reason), e
            failed += 1
            r = c.request("session.infer", params)  # the same request again: served
        assert from_tensor(r["result"]["output"]).tobytes() == want
    return failed


def test_direct_paging_is_bitwise_whole_bank_and_counts_disk_reads(disk_bank):
    dm = Daemon(models={"small": disk_bank})
    try:
        c = dm.client()
        bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
        ref = run_all(c, new_session(c), INPUTS)
        for policy in ("lru", "next_use", "static_hot"):
            sid = new_session(c, policy=policy, budget_bytes=3 * bpe)
            assert run_all(c, sid, INPUTS) == ref, policy
            t = c.call("telemetry.get", {"session": sid})
            assert t["bytes_read_disk"] >= t["bytes_paged_h2d"] > 0, t
            assert t["stall_us"] > 0 and t["resident_bytes"] <= 3 * bpe, t
        log = dm.log_text()
        assert "pages from disk: O_DIRECT reads of %s" % disk_bank in log, log[-2000:]
        text = c.call("telemetry.metrics")["text"]
        for name in ("qmoed_bytes_read_disk_total", "qmoed_stall_us_total",
                     "qmoed_session_bytes_read_disk_total", "qmoed_session_stall_us_total"):
            assert "\n%s" % name in text, name
        # whole_bank sessions keep the mapping: nothing is read.
        assert c.call("telemetry.get", {"session": new_session(c)})["bytes_read_disk"] == 0
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_paging_source_mmap_keeps_the_mapping(disk_bank):
    dm = Daemon(models={"small": disk_bank}, args=["--set", "paging_source=mmap"])
    try:
        c = dm.client()
        bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
        ref = run_all(c, new_session(c), INPUTS)
        sid = new_session(c, policy="lru", budget_bytes=3 * bpe)
        assert run_all(c, sid, INPUTS) == ref
        t = c.call("telemetry.get", {"session": sid})
        assert t["bytes_read_disk"] == 0 and t["bytes_paged_h2d"] > 0, t
        assert "pages from disk" not in dm.log_text()
    finally:
        assert dm.stop() == 0, dm.log_text()
    bad = Daemon(models={"small": disk_bank}, args=["--set", "paging_source=nvme"], wait=False)
    assert bad.proc.wait(30) != 0
    bad.stop()
    assert "paging_source must be auto, mmap or direct" in bad.log_text()


def test_a_bank_on_tmpfs_falls_back_with_a_logged_reason(banks):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = os.path.join(tempfile.mkdtemp(dir="/dev/shm", prefix="qmoed-tmpfs-"), "small.bank")
    shutil.copy(banks["small"], path)
    dm = Daemon(models={"small": path}, args=["--set", "paging_source=direct"])
    try:
        c = dm.client()
        bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
        ref = run_all(c, new_session(c), INPUTS)
        sid = new_session(c, policy="lru", budget_bytes=3 * bpe)
        assert run_all(c, sid, INPUTS) == ref
        assert c.call("telemetry.get", {"session": sid})["bytes_read_disk"] == 0
        log = dm.log_text()
        assert ("warning: session %s: direct disk paging unavailable for %s" % (sid, path)) in log
        assert "serving from the mapping" in log
    finally:
        assert dm.stop() == 0, dm.log_text()
        shutil.rmtree(os.path.dirname(path))


def test_io_engines_read_many_at_once_with_the_same_bits(disk_bank):
    ref = None
    for engine in ("auto", "io_uring", "threads", "serial"):
        dm = Daemon(models={"small": disk_bank},
                    args=["--set", "io_engine=" + engine, "--set", "io_depth=16"])
        try:
            c = dm.client()
            bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
            if ref is None:
                ref = run_all(c, new_session(c), INPUTS)
            sid = new_session(c, policy="lru", budget_bytes=4 * bpe,
                              policy_params={"prefetch": engine != "serial"})
            r = c.call("session.infer", {"session": sid, "layer": 0,
                                         "hidden": tensor(hidden(4, seed=5))})
            assert r["stats"]["misses"] >= 2 and r["stats"]["bytes_read_disk"] > 0, r["stats"]
            assert run_all(c, sid, INPUTS) == ref, engine
            t = c.call("telemetry.get", {"session": sid})
            assert t["read_calls"] > 0 and t["disk_busy_us"] > 0, t
            assert t["reads_in_flight_sum"] >= t["read_calls"], t
            m = re.search(r"session %s pages from disk: O_DIRECT reads of .* through (\S+), "
                          r"(\d+) in flight at most" % sid, dm.log_text())
            assert m, dm.log_text()[-2000:]
            if engine == "serial":
                assert m.group(1) == "serial" and m.group(2) == "1", m.group(0)
                assert t["reads_in_flight_peak"] == 1, t
            else:
                # auto and io_uring: io_uring, or the pool with the kernel's reason
                assert m.group(1) in (("threads",) if engine == "threads"
                                      else ("io_uring", "threads")), m.group(0)
                assert m.group(1) != "threads" or engine == "threads" or "io_uring" in m.group(0)
                assert m.group(2) == "16", m.group(0)
                assert 1 < t["reads_in_flight_peak"] <= 16, t
            # qmoectl telemetry adds the disk columns
            env = dict(os.environ, QMOED_SOCKET=dm.socket)
            out = subprocess.run([os.path.join(BUILD, "clients", "qmoectl"), "telemetry", sid],
                                 env=env, capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            for col in ("STALL/CALL", "STALL/TOKEN", "DISK/TOKEN", "IN-FLIGHT", "DISK-RATE",
                        "PARKED"):
                assert col in out.stdout, out.stdout
            # PARKED, the last column, is the session's prefetch_parked
            head, row = out.stdout.splitlines()[:2]
            assert head.split()[-1] == "PARKED" and row.split()[0] == sid, out.stdout
            after = c.call("telemetry.get", {"session": sid})["prefetch_parked"]
            assert row.split()[-1] == str(after), (out.stdout, after)
            text = c.call("telemetry.metrics")["text"]
            for name in ("qmoed_disk_busy_us_total", "qmoed_read_calls_total",
                         "qmoed_reads_in_flight_sum_total", "qmoed_reads_in_flight_peak"):
                assert "\n%s" % name in text, name
        finally:
            assert dm.stop() == 0, dm.log_text()


def test_bad_io_engine_and_depth_are_refused_at_start(disk_bank):
    for arg, want in (("io_engine=nvme", "io_engine must be auto, io_uring, threads or serial"),
                      ("io_depth=0", "io_depth must be in 1..1024"),
                      ("io_depth=5000", "io_depth must be in 1..1024")):
        bad = Daemon(models={"small": disk_bank}, args=["--set", arg], wait=False)
        assert bad.proc.wait(30) != 0
        bad.stop()
        assert want in bad.log_text(), bad.log_text()


def test_a_disk_read_error_fails_that_request_only(disk_bank):
    # QMOED_FAULT_READ=N fails the Nth read of the daemon, among many in
    # flight with a budget of 8 experts, whichever engine reads.
    for engine, experts, nth in (("auto", 2, "3"), ("auto", 8, "5"), ("threads", 8, "5")):
        dm = Daemon(models={"small": disk_bank}, args=["--set", "io_engine=" + engine],
                    env={"QMOED_FAULT_READ": nth})
        try:
            c = dm.client()
            bpe = c.call("model.list")["models"][0]["bytes_per_expert"]
            ref = run_all(c, new_session(c), INPUTS)
            sid = new_session(c, policy="lru", budget_bytes=experts * bpe,
                              policy_params={"prefetch": False, "warm_from_profile": False})
            assert run_failing_once(c, sid, ref, disk_bank) == 1, engine
            t = c.call("telemetry.get", {"session": sid})
            assert t["errors"] == 1 and t["resident_bytes"] <= experts * bpe, t
        finally:
            assert dm.stop() == 0, dm.log_text()
