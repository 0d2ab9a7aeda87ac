"""The engine's files call each other in layers, never in a circle.

Reads the built static library with nm: file a calls file b when a's object
uses a symbol b's object defines. docs/ARCHITECTURE.md (engine/) and
engine/pager/qm_pager_impl.h state the layers checked here."""
import collections
import os
import re
import shutil
import subprocess

import pytest

BUILD = os.environ.get("QMOE_BUILD_DIR", "build")
LIB = os.path.join(BUILD, "engine", "libqmoe_engine.a")

# docs/ARCHITECTURE.md's table of the engine's layers, top first: each file
# may call only files after it (the kernels, scratch and clock
# below them all are leaves, checked by the circle test).
LAYERS = ["qm_expert_pool", "qm_placement",
          "qm_pager", "qm_pager_source", "qm_pager_prefetch", "qm_pager_resize", "qm_hybrid",
          "qm_pager_trace", "qm_pager_copy", "qm_pager_slots", "qm_pager_disk",
          "qm_pager_io", "qm_pager_layout",
          "qm_backend_emu", "qm_backend_cpu", "qm_cpu_ffn",
          "qm_moe", "qm_backend", "qm_host_route", "qm_routing"]
# Files that call no other engine file but these (leaves of the graph).
LEAVES = {"qm_pager_layout": {"qm_backend"}, "qm_pager_io": {"qm_clock"},
          "qm_routing": set(),
          "qm_scratch": set(), "qm_clock": set()}


def call_graph():
    nm = os.environ.get("NM") or shutil.which("nm")
    if not nm:
        pytest.skip("no nm on PATH: cannot read the library's symbols")
    if not os.path.exists(LIB):
        pytest.skip(f"{LIB} is not built")
    out = subprocess.run([nm, "-A", LIB], capture_output=True, text=True, check=True).stdout
    defs, uses = {}, collections.defaultdict(set)
    for line in out.splitlines():
        m = re.match(r"^[^:]+:([^:]+)\.c\.o:\s*(?:[0-9a-f]+\s+)?([A-Za-z])\s+(\S+)$", line)
        if not m:
            continue
        obj, kind, sym = m.groups()
        if kind in "TDBR":
            defs[sym] = obj
        elif kind == "U":
            uses[obj].add(sym)
    edges = collections.defaultdict(set)
    for obj, syms in uses.items():
        for sym in syms:
            if sym in defs and defs[sym] != obj:
                edges[obj].add(defs[sym])
    return set(defs.values()) | set(uses), edges


def circles(nodes, edges):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def test_engine_files_form_no_circle():
    nodes, edges = call_graph()
    assert circles(nodes, edges) == []


def test_each_file_calls_only_the_layers_below_it():
    nodes, edges = call_graph()
    missing = [f for f in LAYERS if f not in nodes]
    assert not missing, f"not in the library: {missing}"
    rank = {f: i for i, f in enumerate(LAYERS)}
    upward = [(a, b) for a in LAYERS for b in sorted(edges[a]) if b in rank and rank[b] < rank[a]]
    assert upward == [], f"calls to a file above the caller: {upward}"


def test_leaves_call_nothing_else_of_the_engine():
    nodes, edges = call_graph()
    for leaf, allowed in LEAVES.items():
        assert leaf in nodes, f"{leaf} is not in the library"
        assert edges[leaf] <= allowed, f"{leaf} calls {sorted(edges[leaf] - allowed)}"
