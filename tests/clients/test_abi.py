"""libqmoe-client's ABI is what clients/qmoe_client.abi records
(tools/client_abi.py): a change an engine built against the old header
would misread fails here until SOVERSION moves and the record is written
again. The check itself is tried on small libraries built here, so that it
is seen to tell a struct that grew from a function added."""

import os
import shutil
import subprocess

import pytest

import client_abi
from conftest import BUILD


def need_tools():
    try:
        client_abi.tools()
    except client_abi.ToolMissing as e:
        pytest.skip(str(e))


def test_the_library_matches_its_abi_record():
    need_tools()
    lib = client_abi.library(BUILD)
    assert os.path.exists(lib), "%s is not built" % lib
    verdict, msg = client_abi.check(BUILD)
    assert verdict == "same", msg


HEADER_V1 = """
#include <stdint.h>
typedef struct lib_counters { uint64_t calls, errors; } lib_counters;
int lib_counters_get(lib_counters *out);
"""
SOURCE_V1 = '#include "lib.h"\nint lib_counters_get(lib_counters *out) { out->calls = 1; return 0; }\n'


def build_lib(d, header, source, soname):
    """A shared library of `source` with `header`, built -g, dumped."""
    os.makedirs(d)
    with open(os.path.join(d, "lib.h"), "w") as f:
        f.write(header)
    with open(os.path.join(d, "lib.c"), "w") as f:
        f.write(source)
    so = os.path.join(d, "liblib.so")
    subprocess.run(["cc", "-g", "-shared", "-fPIC", "-Wl,-soname," + soname, "-o", so,
                    os.path.join(d, "lib.c")], check=True)
    return client_abi.dump(so, os.path.join(d, "lib.h"), os.path.join(d, "lib.abi"))


@pytest.fixture
def record(tmp_path):
    need_tools()
    if not shutil.which("cc"):
        pytest.skip("no cc on PATH: cannot build the small libraries")
    return build_lib(str(tmp_path / "v1"), HEADER_V1, SOURCE_V1, "liblib.so.1")


def test_the_same_library_is_same(record, tmp_path):
    again = build_lib(str(tmp_path / "again"), HEADER_V1, SOURCE_V1, "liblib.so.1")
    assert client_abi.compare(record, again)[0] == "same"


def test_a_function_added_is_growth(record, tmp_path):
    header = HEADER_V1 + "int lib_reset(void);\n"
    source = SOURCE_V1 + "int lib_reset(void) { return 0; }\n"
    cur = build_lib(str(tmp_path / "v2"), header, source, "liblib.so.1")
    verdict, report = client_abi.compare(record, cur)
    assert verdict == "grew", report
    assert "lib_reset" in report


def test_a_member_added_to_a_struct_the_library_fills_breaks_it(record, tmp_path):
    header = HEADER_V1.replace("calls, errors;", "calls, errors, parked;")
    cur = build_lib(str(tmp_path / "v2"), header, SOURCE_V1, "liblib.so.1")
    verdict, report = client_abi.compare(record, cur)
    assert verdict == "broke", report
    assert "parked" in report


def test_the_same_break_under_a_new_soname_asks_for_the_record(record, tmp_path):
    header = HEADER_V1.replace("calls, errors;", "calls, errors, parked;")
    cur = build_lib(str(tmp_path / "v2"), header, SOURCE_V1, "liblib.so.2")
    assert client_abi.compare(record, cur)[0] == "new-soname"


def test_a_library_without_debug_information_is_refused(tmp_path):
    need_tools()
    if not shutil.which("cc"):
        pytest.skip("no cc on PATH: cannot build the small library")
    with open(tmp_path / "lib.h", "w") as f:
        f.write(HEADER_V1)
    with open(tmp_path / "lib.c", "w") as f:
        f.write(SOURCE_V1)
    so = str(tmp_path / "liblib.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", so, str(tmp_path / "lib.c")], check=True)
    with pytest.raises(RuntimeError, match="no debug information"):
        client_abi.dump(so, str(tmp_path / "lib.h"), str(tmp_path / "lib.abi"))
