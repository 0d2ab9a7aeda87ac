"""The .deb: cpack builds it from this build tree, its control data declares
what the binaries need, every installed piece is in it under /usr (config
under /etc, a conffile), and once extracted into a scratch root (dpkg -x)
its qmoed, qmoectl and qmoe-bank run from there. Then dpkg itself installs,
removes and purges it in a second scratch root (dpkg --root, maintainer
scripts chrootless with DPKG_ROOT); the maintainer scripts also run against
stub systemd tools and never fail.

Never done: a plain `dpkg -i` on this machine (users, /usr/bin, systemd).
"""

import functools
import glob
import os
import re
import shutil
import stat
import subprocess

import pytest

SOURCE = os.environ.get("QMOE_SOURCE_DIR",
                        os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SOURCE, "build"))
CPACK = os.environ.get("QMOE_CPACK") or shutil.which("cpack")
HAVE_CUDA = os.environ.get("QMOE_HAVE_CUDA", "OFF").upper() in ("ON", "1", "TRUE", "YES")

pytestmark = pytest.mark.skipif(not shutil.which("dpkg-deb") or not CPACK,
                                reason="dpkg-deb or cpack not installed")


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def cache(key):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    raise AssertionError("%s not in CMakeCache.txt" % key)


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        m = re.search(r"project\(qmoed VERSION (\S+)", f.read())
    assert m, "no project(qmoed VERSION ...) in CMakeLists.txt"
    return m.group(1)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """Build the package; return (deb path, extracted root, control dir)."""
    out = tmp_path_factory.mktemp("cpack")
    p = run([CPACK, "--config", os.path.join(BUILD, "CPackConfig.cmake"), "-G", "DEB", "-B", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    debs = glob.glob(str(out / "*.deb"))
    assert len(debs) == 1, (debs, p.stdout)
    root = tmp_path_factory.mktemp("root")
    p = run(["dpkg", "-x", debs[0], str(root)])
    assert p.returncode == 0, p.stderr
    ctl = tmp_path_factory.mktemp("control")
    p = run(["dpkg-deb", "-e", debs[0], str(ctl)])
    assert p.returncode == 0, p.stderr
    return debs[0], root, ctl


def field(deb, name):
    p = run(["dpkg-deb", "-f", deb, name])
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def depends(deb):
    """Package names in Depends (every alternative, versions dropped)."""
    names = set()
    for clause in field(deb, "Depends").split(","):
        for alt in clause.split("|"):
            if alt.strip():
                names.add(alt.split("(")[0].strip().split(":")[0])
    return names


def libdir():
    d = cache("CMAKE_INSTALL_LIBDIR")
    return d.lstrip("/") if os.path.isabs(d) else "usr/" + d


def elf_files(root):
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    yield path


@functools.lru_cache(maxsize=None)
def owner(path):
    """The installed package owning `path`, trying the merged-/usr aliases."""
    cands = [path, os.path.realpath(path)]
    for c in list(cands):
        cands.append(c[4:] if c.startswith("/usr/") else "/usr" + c)
    for c in cands:
        p = run(["dpkg-query", "-S", c])
        if p.returncode == 0:
            return p.stdout.split(":")[0].strip()
    return None


def test_control_fields(pkg):
    deb, _, _ = pkg
    assert field(deb, "Package") == "qmoed"
    assert field(deb, "Version") == project_version() + "-1"
    assert field(deb, "Architecture") == run(["dpkg", "--print-architecture"]).stdout.strip()
    assert "@" in field(deb, "Maintainer")
    assert field(deb, "Section")
    desc = field(deb, "Description")
    if HAVE_CUDA:
        assert "includes the CUDA backend" in desc, desc
    else:
        assert "CPU backend only" in desc, desc
    assert {"libc6", "libuv1", "libcjson1"} <= depends(deb), field(deb, "Depends")


def needed(exe):
    """DT_NEEDED sonames: what the file links directly (what Depends covers;
    libraries those pull in are their own packages' business)."""
    p = run(["readelf", "-d", exe])
    assert p.returncode == 0, p.stderr
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", p.stdout))


def test_every_shared_library_the_binaries_link_is_a_declared_dependency(pkg):
    deb, root, _ = pkg
    declared, missing, checked = depends(deb), [], 0
    for exe in elf_files(str(root)):
        direct = needed(exe)
        p = run(["ldd", exe])
        assert p.returncode == 0, (exe, p.stdout + p.stderr)
        for line in p.stdout.splitlines():
            m = re.match(r"\s*(?:(\S+) => )?(/\S+) \(0x", line)
            if not m:
                continue  # vdso
            soname, path = m.group(1) or os.path.basename(m.group(2)), m.group(2)
            if soname not in direct or path.startswith(str(root)):
                continue  # pulled in by another library, or shipped in this package
            checked += 1
            pkgname = owner(path)
            if pkgname not in declared:
                missing.append("%s needs %s (package %s)" % (os.path.relpath(exe, root), path, pkgname))
    assert checked, "no system library resolved: is ldd working?"
    assert not missing, "undeclared dependencies (Depends: %s):\n%s" % (
        field(deb, "Depends"), "\n".join(missing))


def test_every_installed_piece_is_in_the_package(pkg):
    deb, root, _ = pkg
    p = run(["dpkg-deb", "--contents", deb])
    assert p.returncode == 0, p.stderr
    listed = {l.split()[-1] if " -> " not in l else l.split(" -> ")[0].split()[-1]
              for l in p.stdout.splitlines()}
    ld = libdir()
    expected = ["usr/sbin/qmoed", "usr/bin/qmoectl", "usr/bin/qmoe-bank",
                ld + "/libqmoe-client.so", ld + "/libqmoe-client.so.1", ld + "/libqmoe-client.a",
                ld + "/pkgconfig/qmoe-client.pc", "usr/include/qmoe_client.h",
                "usr/lib/systemd/system/qmoed.service", "usr/lib/systemd/system/qmoed.socket",
                "usr/lib/sysusers.d/qmoed.conf", "usr/lib/tmpfiles.d/qmoed.conf",
                "etc/qmoed/qmoed.json"]
    missing = [e for e in expected if "./" + e not in listed]
    assert not missing, "not in the package: %s\n%s" % (missing, p.stdout)
    for page in ("usr/share/man/man8/qmoed.8", "usr/share/man/man1/qmoectl.1"):
        assert "./" + page in listed or "./" + page + ".gz" in listed, page
    # Everything under /usr or /etc: nothing from the build's own prefix.
    stray = [x for x in listed if not re.match(r"\./(usr|etc)(/|$)|\./$", x)
             or x.startswith(("./usr/local", "./usr/etc"))]
    assert not stray, stray
    for exe in ("usr/sbin/qmoed", "usr/bin/qmoectl", "usr/bin/qmoe-bank"):
        assert os.stat(root / exe).st_mode & stat.S_IXOTH, exe


def test_maintainer_data(pkg):
    _, _, ctl = pkg
    assert (ctl / "conffiles").read_text().split() == ["/etc/qmoed/qmoed.json"]
    for script in ("postinst", "prerm", "postrm"):
        assert os.access(ctl / script, os.X_OK), script
        assert run(["sh", "-n", str(ctl / script)]).returncode == 0, script
    assert "activate-noawait ldconfig" in (ctl / "triggers").read_text()
    assert re.search(r"^libqmoe-client 1 qmoed \(>= ", (ctl / "shlibs").read_text(), re.M)


def test_unit_points_into_the_package(pkg):
    _, root, _ = pkg
    unit = (root / "usr/lib/systemd/system/qmoed.service").read_text()
    m = re.search(r"^ExecStart=(\S+) --config (\S+)$", unit, re.M)
    assert m, unit
    assert m.group(1) == "/usr/sbin/qmoed" and (root / m.group(1).lstrip("/")).is_file()
    assert (root / m.group(2).lstrip("/")).is_file(), m.group(2)


def test_no_build_tree_paths_in_the_binaries(pkg):
    _, root, _ = pkg
    for exe in elf_files(str(root)):
        d = run(["readelf", "-d", exe]).stdout
        for line in d.splitlines():
            if "RPATH" in line or "RUNPATH" in line:
                assert BUILD not in line and "$ORIGIN" in line, (exe, line)


def test_extracted_binaries_run(pkg):
    _, root, _ = pkg
    env = {"PATH": "/usr/bin:/bin"}  # no LD_LIBRARY_PATH: the run path must do
    p = run([str(root / "usr/sbin/qmoed"), "--version"], env=env)
    assert p.returncode == 0 and p.stdout.strip() == "qmoed " + project_version(), p.stdout + p.stderr
    p = run([str(root / "usr/bin/qmoectl"), "--help"], env=env)
    assert p.returncode == 0 and "Usage: qmoectl" in p.stdout, p.stdout + p.stderr
    p = run(["ldd", str(root / "usr/bin/qmoectl")])
    lib = [l for l in p.stdout.splitlines() if "libqmoe-client" in l]
    assert lib and str(root) in lib[0], "qmoectl loads a libqmoe-client outside the package:\n" + p.stdout
    p = run([str(root / "usr/bin/qmoe-bank"), "--help"], env=env)
    assert "usage: qmoe-bank" in (p.stdout + p.stderr), p.stdout + p.stderr


def test_shipped_sysusers_snippet_creates_the_accounts_in_a_scratch_root(pkg, tmp_path):
    if not shutil.which("systemd-sysusers"):
        pytest.skip("systemd-sysusers not installed")
    _, root, _ = pkg
    scratch = tmp_path / "sys"
    (scratch / "etc").mkdir(parents=True)
    p = run(["systemd-sysusers", "--root", str(scratch), str(root / "usr/lib/sysusers.d/qmoed.conf")])
    assert p.returncode == 0, p.stderr
    users = [l.split(":")[0] for l in (scratch / "etc/passwd").read_text().splitlines()]
    groups = [l.split(":")[0] for l in (scratch / "etc/group").read_text().splitlines()]
    assert "qmoed" in users and {"qmoed", "qmoe", "qmoe-admin"} <= set(groups), (users, groups)


STUB = "#!/bin/sh\necho \"${0##*/} $*\" >> \"%s\"\nexit %d\n"


def run_script(ctl, script, args, stubdir, log, status=0, tools=("systemd-sysusers", "systemd-tmpfiles", "systemctl")):
    stubdir.mkdir(exist_ok=True)
    for t in tools:
        (stubdir / t).write_text(STUB % (log, status))
        (stubdir / t).chmod(0o755)
    return run(["/bin/sh", str(ctl / script)] + args, env={"PATH": str(stubdir)})


def test_postinst_applies_the_snippets_and_reloads_systemd(pkg, tmp_path):
    _, _, ctl = pkg
    log = tmp_path / "log"
    p = run_script(ctl, "postinst", ["configure", ""], tmp_path / "bin", log)
    assert p.returncode == 0, p.stderr
    calls = log.read_text().splitlines()
    assert calls[:2] == ["systemd-sysusers qmoed.conf", "systemd-tmpfiles --create qmoed.conf"], calls
    if os.path.isdir("/run/systemd/system"):
        assert calls[2:] == ["systemctl daemon-reload"], calls
    else:
        assert calls[2:] == [], "no running systemd here, yet postinst called systemctl: %s" % calls


def test_postinst_upgrade_restarts_only_a_running_daemon(pkg, tmp_path):
    if not os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd is not running here (no /run/systemd/system): postinst skips systemctl")
    _, _, ctl = pkg
    log = tmp_path / "log"
    assert run_script(ctl, "postinst", ["configure", "0.0.9-1"], tmp_path / "bin", log).returncode == 0
    assert "systemctl try-restart qmoed.service" in log.read_text().splitlines()


def test_maintainer_scripts_never_fail(pkg, tmp_path):
    _, _, ctl = pkg
    log = tmp_path / "log"
    # The tools fail ...
    p = run_script(ctl, "postinst", ["configure", ""], tmp_path / "failing", log, status=1)
    assert p.returncode == 0 and "systemd-sysusers qmoed.conf failed" in p.stderr, p.stderr
    # ... or are not there at all (a container without systemd).
    empty = tmp_path / "empty"
    for script, args in (("postinst", ["configure", ""]), ("prerm", ["remove"]),
                         ("postrm", ["remove"]), ("postrm", ["purge"]), ("prerm", ["upgrade", "0.1.0-1"])):
        p = run_script(ctl, script, args, empty, log, tools=())
        assert p.returncode == 0, (script, args, p.stderr)
    p = run_script(ctl, "postinst", ["configure", ""], empty, log, tools=())
    assert "systemd-sysusers not found" in p.stderr, p.stderr


GUARD = """#!/bin/sh
# Pass through only when aimed at the scratch root: a maintainer script that
# ignored DPKG_ROOT must not touch this machine's users or systemd.
case "$*" in
*--root=%(root)s*) exec %(real)s "$@" ;;
esac
echo "guard: refused: ${0##*/} $*" >&2
exit 99
"""


def test_dpkg_installs_into_a_scratch_root_and_removes_cleanly(pkg, tmp_path):
    """dpkg --root with chrootless maintainer scripts: the real postinst
    runs, with DPKG_ROOT, against the scratch root only."""
    if os.geteuid() != 0:
        pytest.skip("dpkg --root unpacks files owned by root: run as root")
    deb, _, _ = pkg
    root = tmp_path / "sysroot"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "etc"):
        (root / d).mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text("")
    guards = tmp_path / "guards"
    guards.mkdir()
    for tool in ("systemd-sysusers", "systemd-tmpfiles", "systemctl"):
        real = shutil.which(tool) or "/bin/false"
        (guards / tool).write_text(GUARD % {"root": root, "real": real})
        (guards / tool).chmod(0o755)
    env = dict(os.environ, PATH="%s:/usr/sbin:/usr/bin:/sbin:/bin" % guards)
    dpkg = ["dpkg", "--root=%s" % root, "--force-script-chrootless", "--force-depends",
            "--log=/dev/null"]

    p = run(dpkg + ["-i", deb], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "guard: refused" not in p.stderr, p.stderr
    status = run(["dpkg-query", "--admindir=%s/var/lib/dpkg" % root, "-W", "-f=${Status} ${Version}", "qmoed"])
    assert status.stdout == "install ok installed %s-1" % project_version(), status.stdout + status.stderr
    exe = root / "usr/sbin/qmoed"
    v = run([str(exe), "--version"], env={"PATH": "/usr/bin:/bin"})
    assert v.returncode == 0 and v.stdout.strip() == "qmoed " + project_version(), v.stdout + v.stderr
    h = run([str(root / "usr/bin/qmoectl"), "--help"], env={"PATH": "/usr/bin:/bin"})
    assert h.returncode == 0 and "Usage: qmoectl" in h.stdout, h.stdout + h.stderr
    if shutil.which("systemd-sysusers"):
        assert any(l.startswith("qmoed:") for l in (root / "etc/passwd").read_text().splitlines()), \
            "postinst did not create the qmoed user in the scratch root:\n" + p.stderr
    if shutil.which("systemd-tmpfiles"):
        assert (root / "var/lib/qmoed").is_dir(), "postinst did not create /var/lib/qmoed:\n" + p.stderr

    # A locally edited conffile survives removal and goes on purge.
    conf = root / "etc/qmoed/qmoed.json"
    conf.write_text(conf.read_text().replace('"log_level": "info"', '"log_level": "debug"'))
    p = run(dpkg + ["-r", "qmoed"], env=env)
    assert p.returncode == 0 and "guard: refused" not in p.stderr, p.stdout + p.stderr
    assert not exe.exists() and not (root / "usr/bin/qmoectl").exists()
    assert '"log_level": "debug"' in conf.read_text()
    p = run(dpkg + ["--purge", "qmoed"], env=env)
    assert p.returncode == 0 and "guard: refused" not in p.stderr, p.stdout + p.stderr
    assert not conf.exists()
