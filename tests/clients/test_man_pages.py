"""The man pages: the committed roff is what md2man.py makes of the Markdown
source, and groff renders it without a warning."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import SOURCE

MAN = os.path.join(SOURCE, "docs", "man")
PAGES = ["qmoectl.1", "qmoed.8"]


@pytest.mark.parametrize("page", PAGES)
def test_roff_is_generated_from_the_markdown(page):
    p = subprocess.run([sys.executable, os.path.join(MAN, "md2man.py"), "--check",
                        os.path.join(MAN, page + ".md"), os.path.join(MAN, page)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("page", PAGES)
def test_groff_renders_without_warnings(page):
    p = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", os.path.join(MAN, page)],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def qmoectl_commands():
    """The commands `qmoectl --help` lists: its own table, walked."""
    qmoectl = os.path.join(os.environ.get("QMOE_BUILD_DIR", "build"), "clients", "qmoectl")
    if not os.path.exists(qmoectl):
        pytest.skip("%s is not built" % qmoectl)
    out = subprocess.run([qmoectl, "--help"], capture_output=True, text=True).stdout
    section = out.split("Commands:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in section.splitlines() if line.strip()]


def test_qmoectl_page_documents_every_subcommand():
    with open(os.path.join(MAN, "qmoectl.1.md")) as f:
        text = f.read()
    cmds = qmoectl_commands()
    assert "create" in cmds and "call" in cmds, cmds
    for cmd in cmds:
        assert "\n`%s`" % cmd in text, cmd


def backquoted_list(text, lead):
    """The names of "`a`, `b` (default) or `c`" right after `lead` in text
    (lines joined)."""
    rest = " ".join(text.split(lead, 1)[1].split())
    item = r"`[^`]+`(?: \(default\))?"
    m = re.match(r"(?:%s, )*%s or %s" % (item, item, item), rest)
    return re.findall(r"`([^`]+)`", m.group(0)) if m else []


def test_the_pages_name_each_registrys_values_as_it_holds_them():
    """The lists of names the pages carry are the registries' own: the
    policies `create` takes (the residency registry's offered ones, as
    session.create's `policy` row lists them) and the config keys naming a
    pager registry's value (paging_source, io_engine: `qmoed --help` prints
    them from it)."""
    qmoectl = os.path.join(os.environ.get("QMOE_BUILD_DIR", "build"), "clients", "qmoectl")
    qmoed = os.path.join(os.environ.get("QMOE_BUILD_DIR", "build"), "daemon", "qmoed")
    for path in (qmoectl, qmoed):
        if not os.path.exists(path):
            pytest.skip("%s is not built" % path)
    rows = json.loads(subprocess.run([qmoectl, "--json", "methods", "session.create"],
                                     capture_output=True, text=True, check=True).stdout)
    policies = next(p for p in rows[0]["params"] if p["member"] == "policy")["names"]
    with open(os.path.join(MAN, "qmoectl.1.md")) as f:
        assert backquoted_list(f.read(), "*P* is ") == policies, policies
    help_text = subprocess.run([qmoed, "--help"], capture_output=True, text=True).stdout
    with open(os.path.join(MAN, "qmoed.8.md")) as f:
        page = f.read().split("# CONFIGURATION", 1)[1]
    for key in ("paging_source", "io_engine"):
        names = re.search(r"\b%s \(([^)]+)\)" % key, help_text).group(1).split("|")
        assert backquoted_list(page, "`%s`\n(" % key) == names, (key, names)
