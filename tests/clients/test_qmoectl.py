"""qmoectl against a real qmoed: every subcommand's human output (structure,
not whitespace) and --json output (the raw result), exit codes, error paths."""

import json
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import (BANK_ARGS, EXPERTS, HIDDEN, LAYERS, QMOE_BANK, QMOECTL, need,
                      run_as_nobody_preexec)

COMMANDS = ["status", "models", "load", "unload", "sessions", "create", "close", "resize", "plan",
            "telemetry", "trace", "metrics", "infer", "shutdown"]


def ctl(daemon, *args, json_out=False, check_rc=0, preexec=None, timeout=60):
    cmd = [need(QMOECTL)]
    if daemon is not None:
        cmd += ["--socket", daemon.socket if hasattr(daemon, "socket") else daemon]
    if json_out:
        cmd.append("--json")
    cmd += [str(a) for a in args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)
    if check_rc is not None:
        assert p.returncode == check_rc, "%s -> %d (want %d)\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(cmd), p.returncode, check_rc, p.stdout, p.stderr)
    if json_out and p.returncode == 0:
        return json.loads(p.stdout)
    return p


def table(text, first_header):
    """Rows of the table that starts at the line whose first cell is `first_header`."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.split() and l.split()[0] == first_header)
    rows = []
    for l in lines[start:]:
        if not l.strip():
            break
        rows.append(re.split(r"\s{2,}", l.strip()))
    return rows[0], rows[1:]


@pytest.fixture(scope="module")
def session(daemon):
    p = ctl(daemon, "create", "demo", "--policy", "lru", "--budget", "50%")
    sid = p.stdout.splitlines()[0]
    assert re.fullmatch(r"[0-9a-f]{16,64}", sid), p.stdout
    return sid


# ---- usage, help, no daemon ----

def test_help_lists_every_subcommand():
    p = ctl(None, "--help")
    for c in COMMANDS:
        assert re.search(r"^  %s\s" % c, p.stdout, re.M), c


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_subcommand_has_help(cmd):
    p = ctl(None, cmd, "--help")
    assert p.stdout.startswith("Usage: qmoectl [global options] %s" % cmd)


@pytest.mark.parametrize("args", [["bogus"], ["plan"], ["load", "x"], ["status", "--bogus"],
                                  ["--timeout", "abc", "status"], ["create", "m", "--budget", "lots"],
                                  ["create", "m", "--budget", "auto%"], ["create", "m", "--budget", "0%"],
                                  ["infer", "s", "--layer", "0"], [], ["trace", "--limit", "-1"]])
def test_usage_errors_exit_2_with_a_qmoectl_message(args):
    p = ctl("/nonexistent/qmoed.sock", *args, check_rc=2)
    assert p.stderr.startswith("qmoectl: ") or p.stderr.startswith("Usage:"), p.stderr


def test_no_daemon_says_so_and_how_to_start_it():
    p = ctl("/nonexistent/qmoed.sock", "status", check_rc=1)
    assert p.stderr.startswith("qmoectl: qmoed is not running")
    assert "systemctl start qmoed" in p.stderr and "`qmoed`" in p.stderr


# ---- status, models, load, unload ----

def test_status_human_and_json(daemon):
    p = ctl(daemon, "status")
    assert p.stdout.startswith("qmoed ")
    assert re.search(r"^backend\s+cpu", p.stdout, re.M), p.stdout
    assert re.search(r"^models\s+1\b", p.stdout, re.M), p.stdout
    r = ctl(daemon, "status", json_out=True)
    for k in ("version", "uptime_s", "backend", "device", "models", "sessions", "connections"):
        assert k in r, k
    assert r["backend"] == "cpu"
    assert set(r["device"]) >= {"name", "total_bytes", "budget_bytes", "used_bytes"}
    # The kernels' self-check: its line names what daemon.status verified.
    k = r["kernels"]
    assert set(k) >= {"cpu", "flags", "check_ms", "cached", "verified", "refused", "unavailable"}
    line = re.search(r"^kernels\s+verified (.*) \(self-check on (.*), [0-9.]+ ms", p.stdout, re.M)
    assert line and line.group(2) == k["cpu"], p.stdout
    for v in k["verified"]:
        assert v["name"] in line.group(1), (v, p.stdout)
    assert "refused" not in p.stdout or k["refused"], p.stdout


def test_models_human_and_json(daemon):
    head, rows = table(ctl(daemon, "models").stdout, "NAME")
    assert head[:3] == ["NAME", "LAYERS", "EXPERTS"]
    demo = [r for r in rows if r[0] == "demo"]
    assert demo and demo[0][1] == str(LAYERS) and demo[0][2] == str(EXPERTS)
    r = ctl(daemon, "models", json_out=True)
    m = [x for x in r["models"] if x["name"] == "demo"][0]
    for k in ("name", "path", "layers", "experts", "hidden_size", "inter_size", "k", "activation",
              "bits", "block_size", "bytes_total", "bytes_per_expert"):
        assert k in m, k
    assert m["layers"] == LAYERS and m["experts"] == EXPERTS and m["hidden_size"] == HIDDEN


def test_models_names_a_code_book_after_its_bits(daemon, workdir):
    """A bank that reads its 4-bit codes through the e2m1 code book (an
    MXFP4 import's default) shows "4/32 e2m1" where a plain int4 bank shows
    "4/32"; --json carries it as quantisation.codebook."""
    path = os.path.join(workdir, "mx.qmoe")
    subprocess.run([need(QMOE_BANK), "create", "--out", path, "--quiet", "--codebook", "e2m1"]
                   + BANK_ARGS, check=True, stdout=subprocess.DEVNULL)
    os.chmod(path, 0o644)
    ctl(daemon, "load", "mx", path)
    try:
        head, rows = table(ctl(daemon, "models").stdout, "NAME")
        bits = head.index("BITS")
        by_name = {r[0]: r for r in rows}
        assert by_name["mx"][bits] == "4/32 e2m1", rows
        assert by_name["demo"][bits] == "4/32", rows
        m = {x["name"]: x for x in ctl(daemon, "models", json_out=True)["models"]}
        assert m["mx"]["quantisation"]["codebook"] == "e2m1", m["mx"]
    finally:
        ctl(daemon, "unload", "mx")


def test_load_unload_and_conflict(daemon):
    p = ctl(daemon, "load", "second", daemon.bank)
    assert p.stdout.startswith("loaded second: %d layers x %d experts" % (LAYERS, EXPERTS))
    p = ctl(daemon, "load", "second", daemon.bank, check_rc=1)
    assert p.stderr.startswith("qmoectl: ") and "[conflict" in p.stderr
    assert "second" in [m["name"] for m in ctl(daemon, "models", json_out=True)["models"]]
    assert ctl(daemon, "unload", "second").stdout.strip() == "unloaded second"
    p = ctl(daemon, "unload", "second", check_rc=1)
    assert "[not_found" in p.stderr


def test_load_relative_path_is_made_absolute(daemon):
    rel = os.path.relpath(daemon.bank)
    r = ctl(daemon, "load", "rel", rel, json_out=True)
    assert os.path.isabs(r["path"]) and os.path.samefile(r["path"], daemon.bank)
    assert ctl(daemon, "unload", "rel", json_out=True) == {}


def test_load_of_a_missing_file_is_invalid_model(daemon):
    p = ctl(daemon, "load", "ghost", "/nonexistent/bank.qmoe", check_rc=1)
    assert "[invalid_model" in p.stderr


# ---- sessions, create, plan ----

def test_create_prints_the_id_then_a_summary(daemon, session):
    head, rows = table(ctl(daemon, "sessions").stdout, "SESSION")
    assert head == ["SESSION", "MODEL", "POLICY", "OWNER", "BUDGET", "RESIDENT", "USE", "AGE",
                    "STATE", "RECLAIM-IN"]
    mine = [r for r in rows if r[0] == session]
    assert mine and mine[0][1] == "demo" and mine[0][2] == "lru"
    # `qmoectl create` has exited: no open connection holds the session, so
    # it is orphaned and counts down from the default 300 s.
    assert mine[0][8] == "orphaned" and re.fullmatch(r"[45]m \d+s|\d+s", mine[0][9]), mine
    r = ctl(daemon, "sessions", json_out=True)
    s = [x for x in r["sessions"] if x["session"] == session][0]
    for k in ("session", "model", "policy", "owner_uid", "budget_bytes", "resident_bytes", "created_at",
              "orphaned_since", "reclaim_in_s"):
        assert k in s, k
    assert s["orphaned_since"] >= s["created_at"] and 0 <= s["reclaim_in_s"] <= 300, s
    total = [m for m in ctl(daemon, "models", json_out=True)["models"] if m["name"] == "demo"][0]["bytes_total"]
    assert s["budget_bytes"] == total // 2


def test_create_json_with_params(daemon):
    r = ctl(daemon, "create", "demo", "--policy", "static_hot", "--budget", "1MiB",
            "--param", "pin_fraction=0.25", "--param", "prefetch=false",
            "--param", 'hot=[{"layer":0,"experts":[3,1]}]', json_out=True)
    assert isinstance(r["session"], str) and "plan_summary" in r
    plan = ctl(daemon, "plan", r["session"], json_out=True)
    assert plan["policy"] == "static_hot" and plan["budget_bytes"] == 1 << 20
    ctl(daemon, "close", r["session"])


def test_resize_by_percent_and_bytes(daemon):
    sid = ctl(daemon, "create", "demo", "--policy", "lru", "--budget", "50%").stdout.split()[0]
    total = [m for m in ctl(daemon, "models", json_out=True)["models"]
             if m["name"] == "demo"][0]["bytes_total"]
    p = ctl(daemon, "resize", sid, "40%")
    assert p.stdout.startswith("resized %s: budget " % sid), p.stdout
    s = [x for x in ctl(daemon, "sessions", json_out=True)["sessions"] if x["session"] == sid][0]
    assert s["budget_bytes"] == int(total * 0.4) and s["resident_bytes"] <= s["budget_bytes"]
    r = ctl(daemon, "resize", sid, "1MiB", json_out=True)
    assert r["budget_bytes"] == 1 << 20 and r["plan_summary"]["budget_bytes"] == 1 << 20
    assert r["resident_bytes"] <= r["budget_bytes"]
    p = ctl(daemon, "resize", sid, "1", check_rc=1)
    assert "resource_exhausted" in p.stderr and "below the minimum" in p.stderr, p.stderr
    p = ctl(daemon, "resize", "0" * 32, "40%", check_rc=1)
    assert "no session" in p.stderr
    ctl(daemon, "resize", sid, "lots", check_rc=2)
    ctl(daemon, "close", sid)


def test_budget_auto_create_plan_and_resize(daemon):
    # The daemon says what auto came to and why; qmoectl prints its sentence.
    p = ctl(daemon, "create", "demo", "--policy", "lru", "--budget", "auto")
    sid = p.stdout.split()[0]
    assert re.search(r"^budget auto: .* = ", p.stdout, re.M), p.stdout
    plan = ctl(daemon, "plan", sid)
    assert re.search(r"^budget auto: \S+ \S+ = ", plan.stdout, re.M), plan.stdout
    j = ctl(daemon, "plan", sid, json_out=True)
    assert j["budget_auto"]["target_bytes"] == j["budget_bytes"]
    assert j["budget_auto"]["reason"] in plan.stdout
    # To bytes ends auto; back to auto sizes it again.
    p = ctl(daemon, "resize", sid, "30%")
    assert "budget auto" not in p.stdout
    assert "budget_auto" not in ctl(daemon, "plan", sid, json_out=True)
    p = ctl(daemon, "resize", sid, "auto")
    assert re.search(r"^budget auto: ", p.stdout, re.M), p.stdout
    r = ctl(daemon, "resize", sid, "auto", json_out=True)
    assert r["budget_auto"]["reason"].startswith("budget auto: ")
    for bad in ("Auto", "0%", "150%", "1.5"):
        p = ctl(daemon, "resize", sid, bad, check_rc=2)
        assert "auto" in p.stderr and "percentage" in p.stderr, p.stderr
    ctl(daemon, "close", sid)


def test_create_with_pending_bytes_beside_budget_auto(daemon):
    # --pending is session.create's client_pending_bytes: the daemon keeps
    # it free and says so in the reason; the JSON result carries the bytes.
    p = ctl(daemon, "create", "demo", "--policy", "lru", "--budget", "auto", "--pending", "3MiB")
    assert re.search(r"^budget auto: .* - the client's pending 3\.1 MB - ", p.stdout, re.M), p.stdout
    ctl(daemon, "close", p.stdout.split()[0])
    r = ctl(daemon, "create", "demo", "--budget", "auto", "--pending", "0", json_out=True)
    assert r["budget_auto"]["client_pending_bytes"] == 0, r
    ctl(daemon, "close", r["session"])
    r = ctl(daemon, "create", "demo", "--budget", "auto", "--pending", "4096", json_out=True)
    assert r["budget_auto"]["client_pending_bytes"] == 4096, r
    ctl(daemon, "close", r["session"])
    # Refused before the wire: without auto, or not a size.
    for args in (("--pending", "1M"), ("--budget", "50%", "--pending", "1M"),
                 ("--budget", "auto", "--pending", "lots"), ("--budget", "auto", "--pending", "-1")):
        p = ctl(daemon, "create", "demo", *args, check_rc=2)
        assert "--pending" in p.stderr, (args, p.stderr)
    assert "needs --budget auto" in ctl(daemon, "create", "demo", "--pending", "1M",
                                        check_rc=2).stderr


def test_resize_with_pending_bytes_to_budget_auto(daemon):
    # resize's --pending is session.resize's client_pending_bytes, as create's.
    sid = ctl(daemon, "create", "demo", "--policy", "lru", "--budget", "auto").stdout.split()[0]
    p = ctl(daemon, "resize", sid, "auto", "--pending", "3MiB")
    assert p.stdout.startswith("resized %s: budget " % sid), p.stdout
    # (last: no workspace after it, as at a creation; the session has one)
    assert re.search(r"^budget auto: .* - the client's pending 3\.1 MB(\)| \(|$)", p.stdout, re.M), p.stdout
    assert ctl(daemon, "plan", sid, json_out=True)["budget_auto"]["client_pending_bytes"] == 3 << 20
    r = ctl(daemon, "resize", sid, "auto", "--pending", "4096", json_out=True)
    assert r["budget_auto"]["client_pending_bytes"] == 4096, r
    # Refused before the wire: beside a budget that is not auto, or not a size.
    for args in (("40%", "--pending", "1M"), ("1MiB", "--pending", "1M"),
                 ("auto", "--pending", "lots"), ("auto", "--pending", "-1")):
        p = ctl(daemon, "resize", sid, *args, check_rc=2)
        assert "--pending" in p.stderr, (args, p.stderr)
    assert "needs the budget auto" in ctl(daemon, "resize", sid, "40%", "--pending", "1M",
                                          check_rc=2).stderr
    assert ctl(daemon, "plan", sid, json_out=True)["budget_auto"]["client_pending_bytes"] == 4096
    ctl(daemon, "close", sid)


def test_create_with_an_unknown_policy_fails_naming_the_field(daemon):
    p = ctl(daemon, "create", "demo", "--policy", "mru", check_rc=1)
    assert p.stderr.startswith("qmoectl: ") and "invalid_params" in p.stderr and "policy" in p.stderr


def test_create_help_lists_the_policies_the_daemon_offers(daemon):
    """The help's list comes from the residency registry, as does the
    daemon's: the two name the same policies in the same order."""
    helped = re.findall(r"^  ([a-z_]+)  ", ctl(None, "create", "--help").stdout.split(
        "\nPolicies:\n")[1], re.M)
    err = ctl(daemon, "create", "demo", "--policy", "mru", check_rc=1).stderr
    offered = err.split("supported: ")[1].split(" [")[0].strip().split(", ")
    assert helped == offered and "next_use" in helped, (helped, err)


def test_create_with_precision(daemon):
    r = ctl(daemon, "create", "demo", "--precision", "fast", json_out=True)
    assert isinstance(r["session"], str)
    ctl(daemon, "close", r["session"])
    out = ctl(daemon, "create", "demo", "--precision", "exact").stdout
    ctl(daemon, "close", out.splitlines()[0])
    p = ctl(daemon, "create", "demo", "--precision", "int8", check_rc=2)
    assert "--precision" in p.stderr


def test_create_with_an_unknown_param_fails(daemon):
    p = ctl(daemon, "create", "demo", "--param", "prefech=true", check_rc=1)
    assert "invalid_params" in p.stderr


def test_plan_table_has_a_row_per_bank_and_totals(daemon, session):
    p = ctl(daemon, "plan", session)
    assert p.stdout.startswith("session %s  policy lru" % session)
    head, rows = table(p.stdout, "BANK")
    assert head == ["BANK", "LAYER", "DECISION", "REASON", "CAND", "CAND-SIZE", "PINNED",
                    "PIN-SIZE", "RES-NOW", "RES-SIZE"]
    banks, total = rows[:-1], rows[-1]
    assert len(banks) == LAYERS and total[0] == "total"
    for i, r in enumerate(banks):
        assert r[0] == str(i) and r[2] in ("whole-bank", "per-expert")
        # The daemon reports resident_now per paged bank: a count, never "?".
        assert r[8].isdigit() or r[8].startswith("all"), r
    assert total[-2].isdigit() and "?" not in p.stdout
    assert "of budget" in p.stdout
    assert "on a miss: page; experts " in p.stdout and " run on the host" in p.stdout


def test_plan_json_is_the_documented_plan(daemon, session):
    r = ctl(daemon, "plan", session, json_out=True)
    for k in ("policy", "budget_bytes", "total", "resident", "degraded", "banks"):
        assert k in r, k
    assert r["total"] == LAYERS == len(r["banks"])
    assert [b["bank"] for b in r["banks"]] == sorted(b["bank"] for b in r["banks"])
    for b in r["banks"]:
        assert b["decision"] in ("whole_bank_resident", "per_expert_candidate")
        if b["decision"] == "per_expert_candidate":
            assert b["experts"] == list(range(EXPERTS)) and b["bytes_per_expert"] > 0


def test_plan_of_an_unknown_session_is_not_found(daemon):
    p = ctl(daemon, "plan", "0" * 32, check_rc=1)
    assert p.stderr.startswith("qmoectl: ") and "[not_found" in p.stderr


def test_unload_in_use_explains_force(daemon, session):
    p = ctl(daemon, "unload", "demo", check_rc=1)
    assert "[in_use" in p.stderr and "--force" in p.stderr


# ---- infer ----

def test_infer_matches_qmoe_bank_run_bit_for_bit(daemon, session, workdir):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    xp, yp, zp = (os.path.join(daemon.dir, n) for n in ("x.npy", "y.npy", "z.npy"))
    np.save(xp, x)
    p = ctl(daemon, "infer", session, "--layer", "1", "--hidden", xp, "--out", yp, "--routing")
    assert p.stdout.startswith("wrote %s: f32 [3,%d]" % (yp, HIDDEN))
    assert re.search(r"^experts \d+ hits, \d+ misses; paged ", p.stdout, re.M)
    assert len(re.findall(r"^token \d+:", p.stdout, re.M)) == 3
    subprocess.run([need(QMOE_BANK), "run", daemon.bank, "--layer", "1", "--hidden", xp, "--out", zp],
                   check=True, capture_output=True)
    y, z = np.load(yp), np.load(zp)
    assert y.shape == x.shape and y.dtype == np.float32
    assert y.tobytes() == z.tobytes()


def test_infer_json_reports_stats_and_routing(daemon, session):
    xp, yp = os.path.join(daemon.dir, "x16.npy"), os.path.join(daemon.dir, "y16.npy")
    np.save(xp, np.ones((2, HIDDEN), dtype=np.float16))
    r = ctl(daemon, "infer", session, "--layer", "0", "--hidden", xp, "--out", yp, "--routing",
            json_out=True)
    assert r["output"]["dtype"] == "f16" and r["output"]["shape"] == [2, HIDDEN]
    assert set(r["stats"]) == {"hits", "misses", "bytes_paged", "queue_us", "compute_us"}
    assert len(r["routing"]) == 2 and all(len(t) == 2 for t in r["routing"])
    assert np.load(yp).dtype == np.float16


def test_infer_with_a_bad_layer_names_the_field(daemon, session):
    xp = os.path.join(daemon.dir, "x.npy")
    np.save(xp, np.zeros((1, HIDDEN), dtype=np.float32))
    p = ctl(daemon, "infer", session, "--layer", "99", "--hidden", xp, "--out",
            os.path.join(daemon.dir, "never.npy"), check_rc=1)
    assert "invalid_params" in p.stderr and "layer" in p.stderr


def test_infer_with_an_unreadable_npy_fails_before_sending(daemon, session):
    bad = os.path.join(daemon.dir, "bad.npy")
    with open(bad, "wb") as f:
        f.write(b"not numpy")
    p = ctl(daemon, "infer", session, "--layer", "0", "--hidden", bad, "--out", bad + ".out", check_rc=1)
    assert p.stderr.startswith("qmoectl: %s" % bad)


# ---- telemetry, trace, metrics ----

def test_telemetry_human_and_json(daemon, session):
    head, rows = table(ctl(daemon, "telemetry").stdout, "SESSION")
    assert head[:6] == ["SESSION", "MODEL", "REQUESTS", "ERRORS", "TOKENS", "HIT-RATE"]
    assert "P50" in head and "P99" in head and rows[0][0] == "(daemon)"
    assert head[6:8] == ["MISSES", "ON-HOST"]
    r = ctl(daemon, "telemetry", json_out=True)
    counters = ("requests", "errors", "tokens", "expert_hits", "expert_misses", "bytes_paged_h2d",
                "evictions", "prefetch_issued", "prefetch_useful", "resident_bytes", "p50_us", "p99_us")
    assert all(k in r["daemon"] for k in counters)
    assert session in [s["session"] for s in r["sessions"]]
    one = ctl(daemon, "telemetry", session, json_out=True)
    assert one["session"] == session and one["model"] == "demo"
    assert all(k in one for k in counters)


def test_telemetry_watch_refreshes(daemon, session):
    p = ctl(daemon, "telemetry", session, "--watch", "0.2", "--count", "2")
    assert len(re.findall(r"^qmoed telemetry at \d\d:\d\d:\d\d, every 0.2s", p.stdout, re.M)) == 2
    # once per refresh in the counters (beside its model), and in the
    # prediction table below them for each predictor that predicted
    assert len(re.findall(r"^%s +demo " % session, p.stdout, re.M)) == 2
    # (a session that has run inferences with prefetch has predictor rows)
    preds = re.findall(r"^%s +(router|history|lookahead) " % session, p.stdout, re.M)
    assert len(preds) % 2 == 0, p.stdout
    assert bool(preds) == ("PREDICTOR" in p.stdout) == ("RECALL" in p.stdout), p.stdout
    p = ctl(daemon, "--json", "telemetry", "--watch", "0.1", "--count", "2")
    dec, text, docs = json.JSONDecoder(), p.stdout.strip(), []
    while text:
        obj, end = dec.raw_decode(text)
        docs.append(obj)
        text = text[end:].strip()
    assert len(docs) == 2 and all("daemon" in d for d in docs)


def test_trace_shows_the_plan_span(daemon, session):
    p = ctl(daemon, "trace")
    head, rows = table(p.stdout, "AT")
    assert head == ["AT", "DURATION", "NAME", "SESSION", "ARGS"]
    assert any(r[2] == "session.residency_plan" and r[3] == session for r in rows)
    r = ctl(daemon, "trace", "--limit", "1", json_out=True)
    assert len(r["spans"]) == 1
    r = ctl(daemon, "trace", "--session", session, json_out=True)
    plan = [s for s in r["spans"] if s["name"] == "session.residency_plan"]
    assert plan and set(plan[0]["args"]) >= {"policy", "resident", "degraded", "total"}


def test_metrics_are_prometheus_text(daemon):
    p = ctl(daemon, "metrics")
    assert re.search(r"^# TYPE qmoed_\w+ (counter|gauge|histogram|summary)$", p.stdout, re.M)
    r = ctl(daemon, "metrics", json_out=True)
    # The raw result carries the same exposition (counters move between the two calls).
    names = lambda t: [l for l in t.splitlines() if l.startswith("# TYPE")]
    assert names(r["text"]) == names(p.stdout)


# ---- roles ----

@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_non_admin_gets_permission_denied(daemon, session):
    os.chmod(daemon.socket, 0o666)
    p = ctl(daemon, "load", "x", daemon.bank, check_rc=1, preexec=run_as_nobody_preexec)
    assert p.stderr.startswith("qmoectl: ") and "[permission_denied" in p.stderr
    assert "admin" in p.stderr
    p = ctl(daemon, "plan", session, check_rc=1, preexec=run_as_nobody_preexec)
    assert "permission_denied" in p.stderr or "not_found" in p.stderr
    r = ctl(daemon, "sessions", json_out=True, preexec=run_as_nobody_preexec)
    assert r["sessions"] == []


# ---- close, shutdown ----

def test_close_then_plan_is_not_found(daemon):
    sid = ctl(daemon, "create", "demo").stdout.splitlines()[0]
    assert ctl(daemon, "close", sid).stdout.strip() == "closed %s" % sid
    assert "[not_found" in ctl(daemon, "plan", sid, check_rc=1).stderr
    assert "[not_found" in ctl(daemon, "close", sid, check_rc=1).stderr


def test_shutdown_drains_and_the_daemon_exits_0(fresh_daemon):
    p = ctl(fresh_daemon, "shutdown")
    assert "draining" in p.stdout
    assert fresh_daemon.proc.wait(20) == 0
    p = ctl(fresh_daemon, "status", check_rc=1)
    assert "qmoed is not running" in p.stderr


def test_infer_with_router_logits_matches_qmoe_bank_run(daemon, session):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    logits = rng.standard_normal((2, EXPERTS)).astype(np.float32)
    xp, rp, yp, zp = (os.path.join(daemon.dir, n) for n in ("lx.npy", "lr.npy", "ly.npy", "lz.npy"))
    np.save(xp, x)
    np.save(rp, logits)
    r = ctl(daemon, "infer", session, "--layer", "0", "--hidden", xp, "--logits", rp, "--out", yp,
            "--routing", json_out=True)
    # The experts chosen are the two largest logits of each token.
    for t, pairs in enumerate(r["routing"]):
        assert sorted(e for e, _ in pairs) == sorted(np.argsort(-logits[t])[:2].tolist())
    subprocess.run([need(QMOE_BANK), "run", daemon.bank, "--layer", "0", "--hidden", xp, "--logits", rp,
                    "--out", zp], check=True, capture_output=True)
    assert np.load(yp).tobytes() == np.load(zp).tobytes()


def test_infer_with_topk_ids_and_weights_is_used_as_given(daemon, session):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    ids = np.array([[1, -1, 3], [0, 2, -1]], np.int32)
    w = np.array([[0.25, 9.0, 1.5], [2.0, -1.0, 0.0]], np.float32)
    xp, ip, wp, yp = (os.path.join(daemon.dir, n) for n in ("tx.npy", "ti.npy", "tw.npy", "ty.npy"))
    np.save(xp, x)
    np.save(ip, ids)
    np.save(wp, w)
    r = ctl(daemon, "infer", session, "--layer", "1", "--hidden", xp, "--topk-ids", ip,
            "--topk-weights", wp, "--out", yp, "--routing", json_out=True)
    assert r["routing"] == [[[1, 0.25], [3, 1.5]], [[0, 2.0], [2, -1.0]]]
    assert np.load(yp).shape == (2, HIDDEN)
    p = ctl(daemon, "infer", session, "--layer", "1", "--hidden", xp, "--topk-ids", ip, "--out", yp,
            check_rc=2)
    assert "--topk-ids and --topk-weights go together" in p.stderr
    p = ctl(daemon, "infer", session, "--layer", "1", "--hidden", xp, "--topk-ids", wp,
            "--topk-weights", wp, "--out", yp, check_rc=2)
    assert "--topk-ids takes an int32 array" in p.stderr
    bad = np.array([[1, 1, 3], [0, 2, -1]], np.int32)
    np.save(ip, bad)
    p = ctl(daemon, "infer", session, "--layer", "1", "--hidden", xp, "--topk-ids", ip,
            "--topk-weights", wp, "--out", yp, check_rc=1)
    assert "topk_ids" in p.stderr and "twice" in p.stderr
