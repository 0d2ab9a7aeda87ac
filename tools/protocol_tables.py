#!/usr/bin/env python3
"""docs/PROTOCOL.md's params tables, generated from the wire's rows.

Each method's section ("### METHOD (...)") carries one block:

    <!-- params METHOD: generated from protocol/qm_wire_schema.h by tools/protocol_tables.py -->
    | member | type | required | meaning |
    ...
    <!-- /params -->

written by `qmoectl methods --markdown METHOD` (the rows the daemon decodes
with). Usage:

    tools/protocol_tables.py [--qmoectl PATH] [--doc PATH]          rewrite the blocks
    tools/protocol_tables.py --check [--qmoectl PATH] [--doc PATH]  exit 1 on drift

--check is tests/protocol's test_protocol_docs: a method whose rows changed
without its table fails there."""
import argparse
import difflib
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN = "<!-- params %s: generated from protocol/qm_wire_schema.h by tools/protocol_tables.py -->"
END = "<!-- /params -->"


def tables(qmoectl):
    methods = json.loads(subprocess.run([qmoectl, "--json", "methods"], capture_output=True,
                                        text=True, check=True).stdout)
    out = {}
    for m in methods:
        name = m["method"]
        md = subprocess.run([qmoectl, "methods", "--markdown", name], capture_output=True,
                            text=True, check=True).stdout
        out[name] = md.rstrip("\n")
    return out


def rewrite(text, generated):
    """The doc with every method's block in place; ValueError naming a
    method whose section is missing."""
    for name, table in generated.items():
        block = BEGIN % name + "\n" + table + "\n" + END
        pattern = re.compile(re.escape(BEGIN % name) + r"\n.*?\n" + re.escape(END), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _m: block, text, count=1)
            continue
        heading = re.compile(r"^### " + re.escape(name) + r"\b.*$", re.M)
        h = heading.search(text)
        if not h:
            raise ValueError("docs have no section '### %s'" % name)
        text = text[:h.end()] + "\n" + block + "\n" + text[h.end():]
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the doc differs")
    ap.add_argument("--qmoectl", default=os.path.join(
        os.environ.get("QMOE_BUILD_DIR", os.path.join(ROOT, "build")), "clients", "qmoectl"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "PROTOCOL.md"))
    args = ap.parse_args()
    with open(args.doc, encoding="utf-8") as f:
        old = f.read()
    try:
        new = rewrite(old, tables(args.qmoectl))
    except ValueError as e:
        print("protocol_tables: %s" % e, file=sys.stderr)
        return 1
    if args.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), args.doc, "from the rows"))
            print("protocol_tables: %s drifted from the wire's rows; run tools/protocol_tables.py"
                  % args.doc, file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(args.doc, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
