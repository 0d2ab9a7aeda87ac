"""libqmoe-client.so exports exactly the functions qmoe_client.h declares:
no codec or allocator symbol leaks out, and no declared call is missing."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import BUILD

SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def declared():
    with open(os.path.join(SRC, "clients", "qmoe_client.h")) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments name calls too
    text = re.sub(r"//[^\n]*", "", text)
    names = set(re.findall(r"\b(qm_client_\w+)\s*\(", text))
    # A function-pointer typedef is a type, not an export.
    return names - set(re.findall(r"\(\s*\*\s*(qm_client_\w+)\s*\)", text))


def exported():
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("no nm on PATH: cannot read the library's dynamic symbols")
    lib = os.path.join(BUILD, "clients", "libqmoe-client.so")
    out = subprocess.run([nm, "-D", "--defined-only", lib], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines()
            if len(line.split()) >= 3 and line.split()[1] in "TWi"}


def test_the_library_exports_exactly_the_header():
    d, e = declared(), exported()
    assert d, "no qm_client_* declarations found in qmoe_client.h"
    assert e - d == set(), "exported but not declared: %s" % sorted(e - d)
    assert d - e == set(), "declared but not exported: %s" % sorted(d - e)
