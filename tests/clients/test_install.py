"""`cmake --install` into a scratch root: the client pieces land under the
usual prefixes, installed qmoectl runs from there, and a program built with
`pkg-config qmoe-client` (shared and static) links and talks to a daemon."""

import os
import shutil
import subprocess

import pytest

from conftest import BUILD



def cache(key):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    raise AssertionError("%s not in CMakeCache.txt" % key)


# The prefix the build was configured with: unit files and the config path
# are fixed at configure time, so the scratch install uses the same prefix.
PREFIX = cache("CMAKE_INSTALL_PREFIX")
SYSCONF = "/etc" if PREFIX == "/usr" else PREFIX + "/etc"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("root")
    # Install only what this build has; other components are other tests' business.
    p = subprocess.run(["cmake", "-P", os.path.join(BUILD, "clients", "cmake_install.cmake")],
                       env=dict(os.environ, DESTDIR=str(r)), capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return r


def under(root, path):
    return root / path.lstrip("/")


def libdir(root):
    return under(root, PREFIX + "/" + cache("CMAKE_INSTALL_LIBDIR"))


def test_files_land_under_the_usual_prefixes(root):
    ld, p = libdir(root), under(root, PREFIX)
    expected = [p / "bin/qmoectl", p / "include/qmoe_client.h", ld / "libqmoe-client.a",
                ld / "libqmoe-client.so", ld / "libqmoe-client.so.1", ld / "pkgconfig/qmoe-client.pc",
                p / "share/man/man1/qmoectl.1", p / "share/man/man8/qmoed.8",
                p / "lib/systemd/system/qmoed.service", p / "lib/systemd/system/qmoed.socket",
                p / "lib/sysusers.d/qmoed.conf", p / "lib/tmpfiles.d/qmoed.conf",
                under(root, SYSCONF) / "qmoed/qmoed.json"]
    missing = [str(x) for x in expected if not x.exists()]
    assert not missing, missing
    unit = (p / "lib/systemd/system/qmoed.service").read_text()
    assert "ExecStart=%s/sbin/qmoed --config %s/qmoed/qmoed.json" % (PREFIX, SYSCONF) in unit


def test_installed_qmoectl_runs_from_the_scratch_root(root):
    exe = str(under(root, PREFIX) / "bin/qmoectl")
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and "Usage: qmoectl" in p.stdout, p.stderr
    ldd = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
    loaded = [l.split("=>")[1].split("(")[0].strip() for l in ldd.splitlines() if "libqmoe-client" in l]
    assert loaded and os.path.realpath(loaded[0]).startswith(os.path.realpath(str(libdir(root)))), \
        "qmoectl does not load the installed library:\n" + ldd


def test_shared_library_exports_only_the_public_api(root):
    out = subprocess.run(["nm", "-D", "--defined-only", str(libdir(root) / "libqmoe-client.so")],
                         capture_output=True, text=True, check=True).stdout
    names = [l.split()[-1].split("@")[0] for l in out.splitlines() if l.split()[-2:-1] == ["T"]]
    assert names and all(n.startswith("qm_client_") for n in names), names
    assert "qm_client_session_infer" in names and "qm_malloc" not in names


PROGRAM = r"""
#include <qmoe_client.h>
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv)
{
    qm_client *c = NULL;
    qm_client_error err;
    int rc = qm_client_open(&c, argv[1], 2000, &err);
    if (argc > 2) { /* a live daemon: ask its status */
        qm_client_status s;
        if (rc == 0) rc = qm_client_daemon_status(c, &s, &err);
        if (rc == 0) { printf("backend=%s\n", s.backend); qm_client_status_free(&s); }
    } else {
        printf("%s %s\n", err.name, strcmp(qm_client_error_name(rc), err.name) == 0 ? "ok" : "mismatch");
    }
    qm_client_close(c);
    return rc == 0 || argc == 2 ? 0 : 1;
}
"""


@pytest.mark.skipif(shutil.which("pkg-config") is None or shutil.which("cc") is None,
                    reason="needs pkg-config and a C compiler")
@pytest.mark.parametrize("link", ["shared", "static"])
def test_pkg_config_builds_a_client_program(root, tmp_path, link, daemon):
    ld = libdir(root)
    env = dict(os.environ, PKG_CONFIG_PATH=str(ld / "pkgconfig"))
    flags = ["--cflags", "--libs"] + (["--static"] if link == "static" else [])
    pc = subprocess.run(["pkg-config"] + flags + ["qmoe-client"], env=env, capture_output=True, text=True)
    assert pc.returncode == 0, pc.stderr
    src = tmp_path / "prog.c"
    src.write_text(PROGRAM)
    exe = tmp_path / ("prog-" + link)
    args = pc.stdout.split()
    if link == "static":  # the .a beside the .so: ask the linker for the archive
        args = [a if a != "-lqmoe-client" else "-l:libqmoe-client.a" for a in args]
    subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)] + args +
                   ["-Wl,-rpath," + str(ld)], check=True)
    p = subprocess.run([str(exe), "/nonexistent/qmoed.sock"], capture_output=True, text=True)
    assert p.stdout.strip() == "not_running ok", p.stdout + p.stderr
    p = subprocess.run([str(exe), daemon.socket, "live"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "backend=cpu", p.stdout + p.stderr
