"""The wire's rows (protocol/qm_wire_schema.h) against what is written from
them: docs/PROTOCOL.md's params tables, and `qmoectl methods` / `qmoectl
call`, which read the rows the daemon decodes with."""
import json
import os
import subprocess
import sys

import pytest

SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
QMOECTL = os.path.join(BUILD, "clients", "qmoectl")
WIRE_CHECK = os.path.join(BUILD, "tests", "protocol", "wire_check")


def need(path):
    if not os.path.exists(path):
        pytest.skip("%s is not built" % path)


def methods():
    need(QMOECTL)
    out = subprocess.run([QMOECTL, "--json", "methods"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_protocol_md_tables_are_the_rows():
    need(QMOECTL)
    r = subprocess.run([sys.executable, os.path.join(SRC, "tools", "protocol_tables.py"),
                        "--check", "--qmoectl", QMOECTL], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_method_is_listed_with_its_members():
    ms = {m["method"]: m for m in methods()}
    assert "session.create" in ms and "session.ring" in ms
    create = {p["member"]: p for p in ms["session.create"]["params"]}
    assert create["model"]["required"] and not create["policy"]["required"]
    assert create["precision"]["names"] == ["exact", "fast"]
    # the residency registry's offered policies, the default first, as the type says
    assert create["policy"]["names"][0] == "whole_bank", create["policy"]
    assert create["policy"]["type"] == "one of " + ", ".join(create["policy"]["names"])
    pp = {p["member"]: p for p in create["policy_params"]["members"]}
    assert pp["on_miss"]["names"] == ["page", "host", "auto"]
    assert create["policy_params"]["knobs"] is True
    assert ms["daemon.status"]["params"] == []


def test_call_types_members_by_their_rows_and_refuses_unknown_ones():
    """`qmoectl call` quotes what the rows type as strings and passes the rest
    as JSON; what it would send decodes (checked offline, before any daemon)."""
    need(QMOECTL)
    bad = subprocess.run([QMOECTL, "call", "session.resize", "sesion=abc"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "takes no member 'sesion'" in bad.stderr, bad.stderr
    unknown = subprocess.run([QMOECTL, "call", "session.frobnicate"], capture_output=True,
                             text=True)
    assert unknown.returncode == 2 and "unknown method" in unknown.stderr


def test_wire_check_decodes_as_the_daemon_does():
    need(WIRE_CHECK)
    lines = ('{"jsonrpc":"2.0","id":1,"method":"session.resize","params":{"session":"s",'
             '"budget_bytes":4096}}\n'
             '{"jsonrpc":"2.0","id":2,"method":"session.resize","params":{"session":"s"}}\n')
    r = subprocess.run([WIRE_CHECK], input=lines, capture_output=True, text=True)
    out = r.stdout.splitlines()
    assert out[0] == "ok session.resize"
    assert out[1].startswith("error -32602 budget_bytes "), out
    assert r.returncode == 1
