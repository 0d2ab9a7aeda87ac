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


def build_lib(d, header, source, soname, debug=True):
    """A shared library of `source` with `header` in directory `d`:
    (library, header path)."""
    os.makedirs(d)
    with open(os.path.join(d, "lib.h"), "w") as f:
        f.write(header)
    with open(os.path.join(d, "lib.c"), "w") as f:
        f.write(source)
    so = os.path.join(d, "liblib.so")
    subprocess.run(["cc"] + (["-g"] if debug else []) +
                   ["-shared", "-fPIC", "-Wl,-soname," + soname, "-o", so,
                    os.path.join(d, "lib.c")], check=True)
    return so, os.path.join(d, "lib.h")


def dumped(d, header, source, soname):
    so, h = build_lib(d, header, source, soname)
    return client_abi.dump(so, h, os.path.join(d, "lib.abi"))


def need_cc():
    need_tools()
    if not shutil.which("cc"):
        pytest.skip("no cc on PATH: cannot build the small libraries")


@pytest.fixture
def record(tmp_path):
    need_cc()
    return dumped(str(tmp_path / "v1"), HEADER_V1, SOURCE_V1, "liblib.so.1")


def judge(record, tmp_path, header=HEADER_V1, source=SOURCE_V1, soname="liblib.so.1"):
    """(verdict, report) of a second library against the record."""
    return client_abi.compare(record, dumped(str(tmp_path / "v2"), header, source, soname))


GROWN = HEADER_V1.replace("calls, errors;", "calls, errors, parked;")


def test_the_same_library_is_same(record, tmp_path):
    assert judge(record, tmp_path)[0] == "same"


def test_a_function_added_is_growth(record, tmp_path):
    verdict, report = judge(record, tmp_path, HEADER_V1 + "int lib_reset(void);\n",
                            SOURCE_V1 + "int lib_reset(void) { return 0; }\n")
    assert verdict == "grew", report
    assert "lib_reset" in report


def test_a_member_added_to_a_struct_the_library_fills_breaks_it(record, tmp_path):
    verdict, report = judge(record, tmp_path, GROWN)
    assert verdict == "broke", report
    assert "parked" in report


def test_the_same_break_under_a_new_soname_asks_for_the_record(record, tmp_path):
    assert judge(record, tmp_path, GROWN, soname="liblib.so.2")[0] == "new-soname"


def test_a_library_without_debug_information_is_refused(tmp_path):
    need_cc()
    so, h = build_lib(str(tmp_path / "v1"), HEADER_V1, SOURCE_V1, "liblib.so.1", debug=False)
    with pytest.raises(RuntimeError, match="no debug information"):
        client_abi.dump(so, h, str(tmp_path / "lib.abi"))
