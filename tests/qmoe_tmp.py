"""qmoe_tmp - a pytest plugin (`-p qmoe_tmp`, tests/ on PYTHONPATH) that
gives one test session one temp root and removes it when the session
passes.

Every pytest file of the suite runs with it (tests/CMakeLists.txt
qm_add_py_test, and scripts/test.sh's valgrind slice). At configure time it
makes `qmoe-t-XXXXXXXX` in the temp dir the session was started with and
points both tempfile (this process) and TMPDIR (every program a test starts:
qmoed, qmoe-bank, the C clients) at it, so the suites' own
`tempfile.mkdtemp` directories (the daemon harness's socket and log, the
generated banks, the checkpoints) land inside it. When the session ends
with every test passed (or none collected) the root goes; otherwise it
stays and its path is printed, to read the daemons' logs. Before this,
every run left its few hundred directories (and a 32 MB set of banks per
daemon module) behind in /tmp. scripts/test.sh checks after the whole run
that nothing of ours is left in the temp dir.
"""
import os
import shutil
import sys
import tempfile

_KEY = "_qmoe_tmp"


def pytest_configure(config):
    root = tempfile.mkdtemp(prefix="qmoe-t-")
    # Traversable by all, as /tmp is: the permission tests run a client as
    # another uid that must reach a socket below (each directory in it is
    # still 0700 unless a test opens it).
    os.chmod(root, 0o755)
    setattr(config, _KEY, {"root": root, "tmpdir": os.environ.get("TMPDIR"),
                           "tempdir": tempfile.tempdir, "status": None})
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root


def pytest_sessionfinish(session, exitstatus):
    st = getattr(session.config, _KEY, None)
    if st is not None:
        st["status"] = int(exitstatus)


def pytest_unconfigure(config):
    st = getattr(config, _KEY, None)
    if st is None:
        return
    tempfile.tempdir = st["tempdir"]
    if st["tmpdir"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = st["tmpdir"]
    # 0: all passed; 5: nothing collected (a file whose tests all deselected)
    if st["status"] in (0, 5):
        shutil.rmtree(st["root"], ignore_errors=True)
    else:
        sys.stderr.write("qmoe_tmp: this session's temp files are kept in %s\n" % st["root"])
