"""qmoe_client.transformers.from_pretrained's memory and its refusals, as
JSON (test_transformers_load.py starts it under the torch environment):

    python hf_load_check.py --socket S --mid DIR --mid-model NAME \
        --other-model NAME --warm FIXTURE WARM_MODEL --qmoed QMOED --bank BANK

- memory: the engine's RSS before and after from_pretrained of the
  mid-size checkpoint DIR (torch, transformers and the model's code already
  imported and warmed on the tiny FIXTURE), its peak during the load
  (VmHWM, reset first), after generating 4 tokens (transformers keeps
  weights it needs no conversion for as views of the checkpoint's mmap:
  their pages count once touched), and the checkpoint's expert and other
  bytes;
- refusals, each with every checkpoint read logged and the sessions listed:
  a model the daemon has not loaded, the bank of another model, a daemon
  that died after the client connected (a private qmoed on BANK, killed);
- client_pending_bytes without budget "auto": refused the same way;
- at the end it loads DIR once more, with budget "auto" and
  client_pending_bytes (its session's budget_auto reported), and exits
  without closing anything: the test checks that no session is left.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "clients", "python"))
sys.path.insert(0, HERE)

import qmoe_client  # noqa: E402
from qmoe_client import transformers as qt  # noqa: E402
from hf_generate_check import logged_reads  # noqa: E402


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def checkpoint_bytes(d):
    """(expert bytes, other bytes) of the safetensors files in d."""
    from safetensors import safe_open

    ex = other = 0
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), framework="pt") as g:
                for k in g.keys():
                    s = g.get_slice(k)
                    n = 2
                    for dim in s.get_shape():
                        n *= dim
                    if ".experts." in k:
                        ex += n
                    else:
                        other += n
    return ex, other


PENDING = 48 << 20  # client_pending_bytes declared with budget "auto"


def refusal(fn, client_for_sessions):
    log = []
    try:
        with logged_reads(log):
            fn()
        err = None
    except Exception as e:  # what from_pretrained raised, reported as is
        err = {"type": type(e).__name__, "message": str(e),
               "qmoe_name": getattr(e, "name", None)}
    sessions = None
    if client_for_sessions is not None:
        sessions = len(client_for_sessions.sessions())
    return {"error": err, "read": len(log), "sessions": sessions}


def private_daemon(qmoed, bank):
    d = tempfile.mkdtemp(prefix="qmoe-gone-")
    sock = os.path.join(d, "qmoed.sock")
    cmd = [qmoed, "--socket", sock, "--backend", "cpu", "--model", "gone=" + bank,
           "--state-dir", os.path.join(d, "state"), "--log-level", "warning"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd)
    for _ in range(500):
        try:
            return proc, qmoe_client.Client(sock, timeout=5)
        except qmoe_client.DaemonNotRunning:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("the private qmoed did not come up")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mid", required=True)
    ap.add_argument("--mid-model", required=True)
    ap.add_argument("--other-model", required=True)
    ap.add_argument("--warm", nargs=2, required=True, metavar=("FIXTURE", "MODEL"))
    ap.add_argument("--qmoed", required=True)
    ap.add_argument("--bank", required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    client = qmoe_client.Client(a.socket)
    out = {}
    # Warm: the model's code imported, transformers' lazy modules loaded.
    warm = qt.from_pretrained(a.warm[0], client, a.warm[1])
    with torch.no_grad():
        warm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
    warm.qmoe_hook.close()
    del warm

    ex, other = checkpoint_bytes(a.mid)
    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    log = []
    with logged_reads(log):
        m = qt.from_pretrained(a.mid, client, a.mid_model)
    after = status_kib("VmRSS")
    peak = status_kib("VmHWM")
    with torch.no_grad():
        ids = m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    out["memory"] = {"expert_bytes": ex, "other_bytes": other, "rss_before": before << 10,
                     "rss_after_load": after << 10, "peak_during_load": peak << 10,
                     "rss_after_generation": status_kib("VmRSS") << 10,
                     "bytes_read": sum(b for _, b in log),
                     "expert_tensors_read": sorted({k for k, _ in log if ".experts." in k}),
                     "generated": ids.shape[1] - 4, "calls": m.qmoe_hook.stats()["calls"]}
    m.qmoe_hook.close()
    del m

    out["no_such_model"] = refusal(lambda: qt.from_pretrained(a.mid, client, "no-such-bank"),
                                   client)
    out["another_model"] = refusal(lambda: qt.from_pretrained(a.mid, client, a.other_model),
                                   client)
    proc, gone = private_daemon(a.qmoed, a.bank)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out["daemon_gone"] = refusal(lambda: qt.from_pretrained(a.mid, gone, "gone"), None)
    gone.close()
    out["pending_without_auto"] = refusal(
        lambda: qt.from_pretrained(a.mid, client, a.mid_model, budget="50%",
                                   client_pending_bytes=PENDING), client)

    # Left open on purpose: exiting must close it. Its budget is auto, with
    # memory this process says it takes next.
    m = qt.from_pretrained(a.mid, client, a.mid_model, budget="auto",
                           client_pending_bytes=PENDING)
    with torch.no_grad():
        m.generate(torch.tensor([[1, 2]]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    out["left_open"] = m.qmoe_hook.session
    out["left_open_budget_auto"] = client.plan(m.qmoe_hook.session).get("budget_auto")
    json.dump(out, sys.stdout)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
