"""qmoe_client.transformers.from_pretrained on a mid-size checkpoint made here
(bench/e2e/checkpoints.py's Qwen3-30B-A3B shape, narrowed: 201 MB of bf16
experts, 27 MB of everything else): the engine's RSS after the load, at its
peak during the load and after generating 4 tokens grows by at most 1.2 x
the non-expert bytes + 32 MiB (a full load grows by ~390 MB), and exactly
the non-expert bytes are read; and its refusals, each before one tensor is read and with no
session left: a model the daemon has not loaded, a bank of another model, a
daemon that died after the client connected, client_pending_bytes without
budget "auto"; and with budget "auto" the declared client_pending_bytes
reach the session's plan. The helper (hf_load_check.py,
in the torch environment) exits with a model it never closed: no session is
left behind.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, os.path.join(SRC, "tests", "daemon"))
sys.path.insert(0, os.path.join(SRC, "bench", "e2e"))
from qmoed_harness import Daemon, qmoe_bank_path, qmoed_path  # noqa: E402
import checkpoints  # noqa: E402

FIXTURES = os.path.join(SRC, "tests", "import", "fixtures")
MID = dict(hidden_size=1024, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=2048)
MID_LAYERS, MID_VOCAB = 2, 4096
SLACK = 32 << 20


def import_hf(src, out, bits):
    r = subprocess.run([qmoe_bank_path(), "import", "hf", src, "--out", out, "--bits", str(bits),
                        "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def served(torchpy, tmp_path_factory):
    d = tmp_path_factory.mktemp("hfload")
    cfg = checkpoints.shape_config("qwen3-30b-a3b", MID_LAYERS, vocab=MID_VOCAB, overrides=MID)
    mid = checkpoints.build_config(cfg, str(d / "mid"), tokenizer=False)
    banks = {"mid": import_hf(mid, str(d / "mid.bank"), 4),
             "olmoe": import_hf(os.path.join(FIXTURES, "olmoe"), str(d / "olmoe.bank"), 8),
             "qwen3_moe": import_hf(os.path.join(FIXTURES, "qwen3_moe"), str(d / "q3.bank"), 8)}
    dm = Daemon(models=banks)
    yield dm, mid, banks
    assert dm.stop() == 0, dm.log_text()[-3000:]


@pytest.fixture(scope="module")
def report(torchpy, served):
    dm, mid, banks = served
    r = subprocess.run([torchpy, os.path.join(HERE, "hf_load_check.py"), "--socket", dm.socket,
                        "--mid", mid, "--mid-model", "mid", "--other-model", "olmoe",
                        "--warm", os.path.join(FIXTURES, "qwen3_moe"), "qwen3_moe",
                        "--qmoed", qmoed_path(), "--bank", banks["olmoe"]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def test_engine_rss_after_load_stays_under_the_bound(report):
    m = report["memory"]
    assert m["expert_bytes"] >= 200e6 and m["other_bytes"] < 30e6, m
    bound = 1.2 * m["other_bytes"] + SLACK
    for when in ("rss_after_load", "peak_during_load", "rss_after_generation"):
        grew = m[when] - m["rss_before"]
        print("%s: RSS +%.1f MB (bound %.1f MB)" % (when, grew / 1e6, bound / 1e6))
        assert grew <= bound, "%s: RSS grew by %.1f MB, bound %.1f MB (%s)" % (
            when, grew / 1e6, bound / 1e6, m)
    # what was read: every byte that is not an expert's, nothing else
    assert m["expert_tensors_read"] == [] and m["bytes_read"] == m["other_bytes"], m
    assert m["generated"] == 4 and m["calls"] == 4 * MID_LAYERS, m


def refused_with_value_error(r, *says):
    """A refusal: ValueError saying each of `says`, nothing read, no session."""
    assert r["error"]["type"] == "ValueError", r
    for s in says:
        assert s in r["error"]["message"], (s, r["error"]["message"])
    assert r["read"] == 0 and r["sessions"] == 0, r


def test_a_model_the_daemon_has_not_loaded_is_refused_before_reading(report):
    refused_with_value_error(report["no_such_model"], "no model 'no-such-bank' loaded", "mid")


def test_a_bank_of_another_model_is_refused_before_reading(report):
    refused_with_value_error(report["another_model"], "model.layers.0.mlp.experts",
                             "imported from another model", "'olmoe'")


def test_a_daemon_that_is_gone_is_refused_before_reading(report):
    r = report["daemon_gone"]
    assert r["error"] is not None and r["error"]["qmoe_name"] in ("connection_lost",
                                                                  "not_running"), r
    assert r["read"] == 0, r


def test_client_pending_bytes_without_budget_auto_is_refused_before_reading(report):
    refused_with_value_error(report["pending_without_auto"],
                             "client_pending_bytes needs budget=\"auto\"", "'50%'")


def test_from_pretrained_declares_client_pending_bytes_to_an_auto_budget(report):
    """The pending bytes reach session.create: the plan's budget_auto carries
    them and its reason subtracts them."""
    ba = report["left_open_budget_auto"]
    assert ba is not None and ba["client_pending_bytes"] == 48 << 20, ba
    assert "the client's pending 50.3 MB" in ba["reason"], ba["reason"]


def test_a_model_left_open_leaves_no_session_at_exit(report, served):
    dm, _, _ = served
    assert len(report["left_open"]) == 32
    c = dm.client()
    sessions = c.call("session.list")["sessions"]
    c.close()
    assert sessions == [], sessions
    with open("/proc/%d/maps" % dm.proc.pid) as f:
        assert not any("memfd:qmoe-map" in ln for ln in f)
