#!/usr/bin/env python3
"""libqmoe-client's ABI against the record of it in clients/qmoe_client.abi.

An engine links libqmoe-client.so.N and lays out the structs of
qmoe_client.h as its own build saw them; a member added to a struct the
library fills (qm_client_counters, say) moves every field after it and
the stride of the arrays the library hands out. Such a change must come
with a new SOVERSION. This tool reads the built library's public types
from its debug information (libabigail's abidw, Debian's abigail-tools;
clients/CMakeLists.txt builds the library with -g), compares them with
the committed record (abidiff) and says which of these it is:

  same        the record describes the library
  grew        functions added, nothing existing changed: compatible, but
              the record must be written again so the next change is
              judged against them
  broke       an existing function or a type it reaches changed under the
              same soname: bump SOVERSION (clients/CMakeLists.txt), then
              write the record again
  new-soname  the soname moved since the record: write the record again

  tools/client_abi.py --build build            # check, exit 1 unless same
  tools/client_abi.py --build build --write    # write clients/qmoe_client.abi

tests/clients/test_abi.py runs the check in the test suite.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

SOURCE = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RECORD = os.path.join(SOURCE, "clients", "qmoe_client.abi")
HEADER = os.path.join(SOURCE, "clients", "qmoe_client.h")


class ToolMissing(Exception):
    pass


def tools():
    abidw, abidiff = shutil.which("abidw"), shutil.which("abidiff")
    if not abidw or not abidiff:
        raise ToolMissing("abidw/abidiff not on PATH (Debian: abigail-tools; scripts/setup.sh "
                          "installs it)")
    return abidw, abidiff


def dump(lib, header, out):
    """Write the public ABI of `lib`: what `header` declares. A struct the
    header leaves opaque (qm_client) stays opaque; no path of this machine
    is written (file names only)."""
    abidw, _ = tools()
    r = subprocess.run([abidw, "--header-file", header, "--drop-private-types",
                        "--no-corpus-path", "--no-comp-dir-path", "--short-locs",
                        "--out-file", out, lib],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("abidw %s failed (%d): %s" % (lib, r.returncode, r.stderr.strip()))
    with open(out) as f:
        text = f.read()
    # A library without debug information gives a corpus of symbols only:
    # every type change would go unseen, so it is refused, not passed.
    if "<type-decl" not in text and "<class-decl" not in text:
        raise RuntimeError("%s has no debug information (build it with -g): abidw saw no types"
                           % lib)
    return out


def soname(abi_path):
    with open(abi_path) as f:
        head = f.read(4096)
    m = re.search(r"soname='([^']*)'", head)
    return m.group(1) if m else ""


def compare(record, current):
    """(verdict, report): verdict one of same, grew, broke, new-soname."""
    _, abidiff = tools()
    full = subprocess.run([abidiff, record, current], capture_output=True, text=True)
    if full.returncode & 3:  # 1: abidiff's own error, 2: usage
        raise RuntimeError("abidiff failed (%d): %s" % (full.returncode, full.stderr.strip()))
    if full.returncode == 0:
        return "same", ""
    if soname(record) != soname(current):
        return "new-soname", full.stdout
    old_only = subprocess.run([abidiff, "--no-added-syms", record, current],
                              capture_output=True, text=True)
    if old_only.returncode & 3:
        raise RuntimeError("abidiff failed (%d): %s" % (old_only.returncode,
                                                        old_only.stderr.strip()))
    return ("broke" if old_only.returncode else "grew"), full.stdout


ADVICE = {
    "grew": "libqmoe-client gained functions and changed nothing it had: write the record "
            "again (tools/client_abi.py --build BUILD --write) so that the next change is "
            "judged against them",
    "broke": "libqmoe-client's ABI changed under the same soname (%s): an engine built "
             "against the old header would read the wrong fields; bump SOVERSION in "
             "clients/CMakeLists.txt, then write the record again "
             "(tools/client_abi.py --build BUILD --write)",
    "new-soname": "the library's soname moved (%s -> %s): write the record again "
                  "(tools/client_abi.py --build BUILD --write)",
}


def library(build):
    return os.path.join(build, "clients", "libqmoe-client.so")


def check(build, record=RECORD):
    """(verdict, message) for the built library against the record."""
    with tempfile.TemporaryDirectory(prefix="qmoe-abi-") as d:
        cur = dump(library(build), HEADER, os.path.join(d, "cur.abi"))
        verdict, report = compare(record, cur)
        if verdict == "same":
            return verdict, "libqmoe-client's ABI matches %s (%s)" % (
                os.path.relpath(record, SOURCE), soname(cur))
        advice = ADVICE[verdict]
        if verdict == "broke":
            advice = advice % soname(cur)
        elif verdict == "new-soname":
            advice = advice % (soname(record), soname(cur))
        return verdict, advice + "\n\n" + report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="the build tree holding clients/libqmoe-client.so")
    ap.add_argument("--write", action="store_true", help="write the record from the built library")
    a = ap.parse_args()
    try:
        if a.write:
            dump(library(a.build), HEADER, RECORD)
            print("wrote %s (%s)" % (os.path.relpath(RECORD, SOURCE), soname(RECORD)))
            return 0
        verdict, msg = check(a.build)
    except (ToolMissing, RuntimeError) as e:
        print("client_abi: %s" % e, file=sys.stderr)
        return 2
    print(msg)
    return 0 if verdict == "same" else 1


if __name__ == "__main__":
    sys.exit(main())
