"""Faults at the seams (issue 40, item 4): qmoed SIGKILLed at random moments
and restarted by a supervisor as systemd would (tests/hardening/restart.py:
through the socket unit's inherited fd, LISTEN_FDS, or binding the path
itself), under engines that must end with the tokens of an undisturbed run.

- a transformers generation (restart_generate.py in the torch environment,
  from_pretrained on a tiny fixture, a paged session): killed at a random
  token-layer, restarted with its model (the config's), without it (the
  client loads the bank again), and without socket activation;
- a session being resized: killed between and during resizes, the session
  comes back with the last budget the daemon confirmed and the same bits;
- a paged session reading experts from disk (O_DIRECT): killed during its
  reads, again and again; every output equals the undisturbed pass;
- a bank import (qmoe-bank import/create) killed at random points: the bank
  is absent or whole (byte-identical to an undisturbed import), its
  .partial never loads, --resume finishes it; a daemon killed while it
  loads a bank loads it whole after the restart.

llama-completion under the same kills is tests/llama/test_llama_cpp.py's
test_llama_completion_survives_random_sigkills (it needs the llama.cpp
build). bench/restart/run.py runs the issue's target (20 runs per engine)
and prints its figures.
"""
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hardening import HERE, make_bank
from restart import Killer, Supervisor

SRC = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "clients", "python"))
sys.path.insert(0, os.path.join(SRC, "tests", "clients"))
import qmoe_client  # noqa: E402
from conftest import torch_python  # noqa: E402
from qmoed_harness import qmoe_bank_path  # noqa: E402

FIXTURE = os.path.join(SRC, "tests", "import", "fixtures", "mixtral")
TOKENS = 24
SEED = int(os.environ.get("QMOE_RESTART_SEED", "40"))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def import_hf(out, extra=()):
    return subprocess.run([qmoe_bank_path(), "import", "hf", FIXTURE, "--out", out, "--bits", "8",
                           "--quiet"] + list(extra), capture_output=True, text=True)


@pytest.fixture(scope="module")
def hf_bank(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("restart") / "mixtral.bank")
    r = import_hf(out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def supervisors():
    """Supervisor(...) for a test, stopped at its end if the test did not
    get as far (a failing test leaves no daemon behind)."""
    made = []

    def make(*args, **kw):
        made.append(Supervisor(*args, **kw))
        return made[-1]

    yield make
    for sup in made:
        if sup.proc is not None and sup.proc.poll() is None:
            sup.stop()


# ---- a transformers generation ----

def generate(py, sup, bank=None, tokens=TOKENS):
    cmd = [py, os.path.join(HERE, "restart_generate.py"), "--socket", sup.socket,
           "--fixture", FIXTURE, "--model", "mixtral", "--policy", "lru", "--budget", "50%",
           "--tokens", str(tokens)]
    if bank:
        cmd += ["--bank", bank]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(scope="module")
def torchpy():
    py = torch_python()
    if py is None:
        pytest.skip("no torch environment (QMOE_TORCH_VENV, /var/cache/qmoed/venv-torch): run "
                    "scripts/setup.sh to install torch and transformers")
    return py


@pytest.fixture(scope="module")
def undisturbed(torchpy, hf_bank, tmp_path_factory):
    """The tokens and the daemon's token-layers of a run nobody kills."""
    sup = Supervisor(str(tmp_path_factory.mktemp("calm")), models={"mixtral": hf_bank})
    try:
        res, _ = finish(generate(torchpy, sup))
        c = sup.client()
        total = c.call("telemetry.get")["daemon"]["tokens"]
        c.close()
    finally:
        assert sup.stop() == 0, sup.log_text()[-3000:]
    assert res["restores"] == 0 and len(res["tokens"]) == TOKENS
    return res["tokens"], total


@pytest.mark.parametrize("how", ["activation", "bank-reloaded", "no-activation", "graceful"])
def test_transformers_generation_survives_a_random_sigkill(torchpy, hf_bank, undisturbed,
                                                           tmp_path, how):
    """Killed at a random token-layer of the generation (past the prompt),
    restarted at once (`graceful`: stopped with SIGTERM, as `systemctl
    restart` does, its drain answering new requests shutting_down): the
    generation ends with the undisturbed tokens, the hook having brought
    its session back once."""
    tokens, total = undisturbed
    models = {} if how == "bank-reloaded" else {"mixtral": hf_bank}
    sup = Supervisor(str(tmp_path), models={"mixtral": hf_bank},
                     activation=how != "no-activation")
    sup.models = models  # what the restarted daemons load at start
    seed = SEED + ["activation", "bank-reloaded", "no-activation", "graceful"].index(how)
    killer = Killer(sup, span=(total // 4, total * 3 // 4), seed=seed, graceful=how == "graceful")
    try:
        p = generate(torchpy, sup, bank=hf_bank if how == "bank-reloaded" else None)
        killer.start()
        res, err = finish(p)
        killer.finish()
        assert killer.error is None, killer.error
        assert len(killer.points) == 1, "the run ended before the kill at %s" % killer.points
        assert res["tokens"] == tokens, (res["tokens"], tokens, err[-3000:])
        assert res["restores"] == 1, err[-3000:]
        assert "is back after" in err, err[-3000:]
        if how == "bank-reloaded":
            assert "its model loaded again from its bank" in err, err[-3000:]
    finally:
        killer.finish()
        sup.stop()


# ---- session.resize ----

def test_a_daemon_killed_during_session_resize(tmp_path, supervisors):
    """Resizes back to back from one thread, layer calls from another, on
    one client; the daemon is SIGKILLed at a random moment (between resizes
    or during one), three times. Every layer call gives the first pass's
    bits, the session comes back under its id with the last budget the
    daemon confirmed (a resize whose answer was lost is not replayed), and
    the restarted daemon holds nothing else."""
    bank = make_bank(str(tmp_path / "small.bank"), layers=2, experts=8)
    sup = supervisors(str(tmp_path / "d"), models={"small": bank})
    rng = random.Random(SEED)
    c = qmoe_client.Client(sup.socket, reconnect=20, warm_interval=0)
    bpe = c.models()[0]["bytes_per_expert"]
    sid = c.create_session("small", policy="lru", budget_bytes=8 * bpe)["session"]
    shm = c.map(sid, 1 << 16)
    x = shm.alloc((2, 64), "f32")
    y = shm.alloc((2, 64), "f32")
    x.array[:] = np.random.default_rng(1).standard_normal((2, 64))
    want = [c.infer(sid, l, x, output_to=y).output.copy() for l in (0, 1)]
    confirmed = [8 * bpe]
    stop = threading.Event()
    errors = []

    def resizer():
        steps = [3, 8, 2, 5, 16, 4]
        i = 0
        while not stop.is_set():
            b = steps[i % len(steps)] * bpe
            i += 1
            try:
                c.resize_session(sid, b)
                confirmed.append(b)
            except qmoe_client.QmoeError as e:
                # The daemon died under it, or the session is not back yet.
                if e.name not in ("connection_lost", "not_running", "not_found", "timeout"):
                    errors.append(e)
                time.sleep(0.005)

    t = threading.Thread(target=resizer)
    t.start()
    try:
        for k in range(3):
            time.sleep(rng.uniform(0.05, 0.3))
            sup.restart()
            for l in (0, 1):
                assert np.array_equal(c.infer(sid, l, x, output_to=y).output, want[l])
            assert c.restores == k + 1
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert len(confirmed) > 3, "resizes were not answered: %s" % confirmed
    st = sup.client().call("session.list")["sessions"]
    assert [s["session"] for s in st] == [sid], st
    assert st[0]["budget_bytes"] == confirmed[-1], (st[0], confirmed[-5:])
    assert st[0]["resident_bytes"] <= st[0]["budget_bytes"]
    c.close()
    assert sup.stop() == 0, sup.log_text()[-3000:]


# ---- many clients at once ----

@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("handles", ["one each", "one shared"])
def test_many_clients_and_their_sessions_across_sigkills(tmp_path, supervisors, handles, stop):
    """Seven clients at once, each with a session of its own (policies and
    budgets mixed, auto ones sharing their residency, a miss run on the
    host, a routing trace; exact and fast; maps whose calls take the call
    ring; routing from the bank, from router logits and from the engine's
    top-k), calling without pause while the
    daemon is SIGKILLed, or stopped with SIGTERM as `systemctl restart`
    does (its drain answers new requests shutting_down: those calls wait
    for the next daemon, where they used to fail), and restarted (socket
    activation, as systemd) five times at random moments. Every call answers, each with the bits of the
    whole-bank reference; each client brings its own sessions back under
    their ids (none lost, none made twice); the last daemon holds exactly
    the sessions the clients hold, and stops cleanly. Each thread with a
    client handle of its own, and all of them on one handle (whose restore
    of one thread's session must not be taken by the others as their own:
    their retries met "no such session" before)."""
    L, E, H, K = 4, 16, 64, 2
    bank = make_bank(str(tmp_path / "m.bank"), layers=L, experts=E, hidden=H, k=K, bits=4,
                     block=32, seed=5)
    sup = supervisors(str(tmp_path / "d"), models={"m": bank})
    rng = np.random.default_rng(SEED)
    inputs = []
    for i in range(12):
        t = (1, 2, 5)[i % 3]
        route = {}
        if i % 3 == 1:
            route["router_logits"] = rng.standard_normal((t, E)).astype(np.float32)
        elif i % 3 == 2:
            route["topk_ids"] = np.stack([rng.choice(E, K, replace=False)
                                          for _ in range(t)]).astype(np.int32)
            route["topk_weights"] = rng.uniform(0.1, 1, (t, K)).astype(np.float32)
        inputs.append((i % L, rng.standard_normal((t, H)).astype(np.float32), route))
    c0 = qmoe_client.Client(sup.socket)
    bpe = c0.models()[0]["bytes_per_expert"]
    ref = {}
    for prec in ("exact", "fast"):
        sid = c0.create_session("m", policy="whole_bank", precision=prec)["session"]
        for i, (layer, x, route) in enumerate(inputs):
            ref[prec, i] = c0.infer(sid, layer, x, **route).output.tobytes()
        c0.close_session(sid)
    c0.close()
    kinds = [dict(policy="lru", budget_bytes=3 * bpe, precision="exact"),
             dict(policy="next_use", budget="25%", precision="fast"),
             dict(policy="whole_bank", precision="fast"),
             dict(policy="arc", budget_bytes=5 * bpe, precision="exact"),
             dict(policy="next_use", budget="auto", precision="exact",
                  policy_params={"share_residency": True}),
             dict(policy="next_use", budget="auto", precision="exact",
                  policy_params={"share_residency": True, "on_miss": "auto"}),
             dict(policy="lfu", budget="50%", precision="fast",
                  policy_params={"record_trace": "t.qmtr", "on_miss": "host"})]
    stop = threading.Event()
    errors, calls, held = [], [0] * len(kinds), {}

    one = qmoe_client.Client(sup.socket, reconnect=30, warm_interval=0) \
        if handles == "one shared" else None

    def client(w):
        r = random.Random(SEED * 10 + w)
        c = one or qmoe_client.Client(sup.socket, reconnect=30, warm_interval=0)
        try:
            spec = kinds[w]
            sid = c.create_session("m", **spec)["session"]
            held[w] = sid
            shm = c.map(sid, 1 << 16) if w % 2 else None
            while not stop.is_set():
                i = r.randrange(len(inputs))
                layer, x, route = inputs[i]
                if shm is not None:
                    shm.reset()

                    def mapped(a):
                        t = shm.alloc(a.shape, "i32" if a.dtype == np.int32 else "f32")
                        t.array[:] = a
                        return t
                    out = shm.alloc(x.shape, "f32")
                    got = c.infer(sid, layer, mapped(x), output_to=out,
                                  **{k: mapped(v) for k, v in route.items()}).output.tobytes()
                else:
                    got = c.infer(sid, layer, x, **route).output.tobytes()
                if got != ref[spec["precision"], i]:
                    errors.append("client %d input %d: output differs from whole_bank's" % (w, i))
                    return
                calls[w] += 1
            # Back on the ring: a restart must not leave a session's mapped
            # calls on the socket for good.
            if shm is not None and not c.ring_active(sid):
                errors.append("client %d: its mapped calls left the call ring" % w)
            c.close_session(sid)
            held.pop(w)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append("client %d: %r" % (w, e))
        finally:
            if one is None:
                c.close()

    threads = [threading.Thread(target=client, args=(w,)) for w in range(len(kinds))]
    for t in threads:
        t.start()
    krng = random.Random(SEED)
    try:
        def live():
            try:
                c = sup.client()
                try:
                    return sorted(s["session"] for s in c.call("session.list")["sessions"])
                finally:
                    c.close()
            except (OSError, EOFError, AssertionError):
                return None

        for k in range(5):
            time.sleep(krng.uniform(0.2, 0.6))
            sup.restart(graceful=stop == "SIGTERM")
            # Every client's session back on the new daemon (under its id,
            # none twice), then every client at work again, before the next kill.
            deadline = time.time() + 60
            while live() != sorted(held.values()) and not errors:
                assert time.time() < deadline, "sessions after kill %d: %s, clients hold %s\n%s" % (
                    k, live(), held, sup.log_text()[-3000:])
                time.sleep(0.01)
            before = list(calls)
            while any(calls[w] <= before[w] for w in range(len(kinds))) and not errors:
                assert time.time() < deadline, "clients stuck after kill %d: %s -> %s\n%s" % (
                    k, before, calls, sup.log_text()[-3000:])
                time.sleep(0.01)
        assert not errors, errors
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    if one is not None:
        one.close()
    assert sup.client().call("session.list")["sessions"] == []
    assert sup.stop() == 0, sup.log_text()[-3000:]


# ---- a paged session's reads ----

def test_a_daemon_killed_during_a_paged_sessions_reads(tmp_path, supervisors):
    """A session paged from disk (O_DIRECT reads into its locked arena) whose
    every call misses; the daemon is SIGKILLed at random moments while its
    reads are in flight, five times. Every output equals the undisturbed
    pass's, and the bank file is what it was."""
    bank = make_bank(str(tmp_path / "big.bank"), layers=4, experts=32, hidden=512, inter=1024,
                     bits=4, block=32, seed=3)
    digest = sha256(bank)
    sup = supervisors(str(tmp_path / "d"), models={"big": bank},
                     args=["--set", "paging_source=direct"])
    c = qmoe_client.Client(sup.socket, reconnect=20)
    bpe = c.models()[0]["bytes_per_expert"]
    sid = c.create_session("big", policy="lru", budget_bytes=4 * bpe,
                           policy_params={"prefetch": False})["session"]
    rng = np.random.default_rng(7)
    calls = []
    for i in range(120):
        ids = rng.choice(32, size=(4, 2), replace=False).astype(np.int32)
        w = rng.random((4, 2)).astype(np.float32)
        calls.append((i % 4, rng.standard_normal((4, 512)).astype(np.float32), ids, w))
    want = [c.infer(sid, l, x, topk_ids=ids, topk_weights=w).output for l, x, ids, w in calls]
    assert "pages from disk: O_DIRECT" in sup.log_text(), sup.log_text()[-2000:]
    misses = c.telemetry(sid)["expert_misses"]
    assert misses > 400, misses  # every call reads
    kill_at = sorted(random.Random(SEED).sample(range(5, 115), 5))
    killer = None
    done = []

    def kill_later(n):
        # The kill lands while call n (or the next) is being served.
        while len(done) < n:
            time.sleep(0.0005)
        sup.restart()

    try:
        for n in kill_at:
            killer = threading.Thread(target=kill_later, args=(n,))
            killer.start()
            for i in range(len(done), n + 1):
                l, x, ids, w = calls[i]
                done.append(i)
                out = c.infer(sid, l, x, topk_ids=ids, topk_weights=w).output
                assert np.array_equal(out, want[i]), i
            killer.join(30)
        for i in range(len(done), len(calls)):
            l, x, ids, w = calls[i]
            assert np.array_equal(c.infer(sid, l, x, topk_ids=ids, topk_weights=w).output,
                                  want[i]), i
    finally:
        if killer is not None:
            killer.join(30)
    assert c.restores == len(kill_at), (c.restores, kill_at)
    assert sha256(bank) == digest
    c.close()
    assert sup.stop() == 0, sup.log_text()[-3000:]


# ---- a bank import ----

def kill_at_random(cmd, seconds, rng):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0, seconds))
    p.kill()
    p.wait()
    return p.returncode


def check_no_torn_bank(out, ref_digest, c, name):
    """OUT is absent or whole; OUT.partial never loads."""
    if os.path.exists(out):
        assert sha256(out) == ref_digest, "%s exists but differs from the undisturbed import" % out
        c.load_model(name, out)
        c.unload_model(name)
    else:
        with pytest.raises(qmoe_client.QmoeError):
            c.load_model(name, out)
    if os.path.exists(out + ".partial"):
        # Refused, unless it was complete and only the rename was missing.
        try:
            c.load_model(name, out + ".partial")
        except qmoe_client.QmoeError as e:
            assert e.name in ("invalid_model", "invalid_params", "not_found"), e
        else:
            assert sha256(out + ".partial") == ref_digest, "a torn .partial loaded"
            c.unload_model(name)
    assert name not in [m["name"] for m in c.models()]


@pytest.mark.parametrize("kind", ["import hf", "create"])
def test_no_torn_bank_ever_loads(hf_bank, tmp_path, kind):
    """qmoe-bank SIGKILLed at random points of an import (or a create of a
    50 MB bank): the output is absent or byte-identical to an undisturbed
    run's, its .partial is refused by model.load unless it is already
    whole, and --resume (import; a partial cut between its last write and
    the rename is refused and a rerun is needed) or a rerun (create)
    finishes it whole."""
    rng = random.Random(SEED)
    if kind == "import hf":
        ref = hf_bank
        cmd = lambda out, *extra: [qmoe_bank_path(), "import", "hf", FIXTURE, "--out", out,  # noqa
                                   "--bits", "8", "--quiet"] + list(extra)
    else:
        ref = str(tmp_path / "ref.bank")
        args = ["--layers", "4", "--experts", "32", "--hidden", "512", "--inter", "1024",
                "--k", "2", "--bits", "4", "--block-size", "32", "--activation", "swiglu",
                "--seed", "5", "--quiet"]
        cmd = lambda out, *extra: [qmoe_bank_path(), "create", "--out", out] + args  # noqa
        subprocess.run(cmd(ref), check=True)
    t0 = time.monotonic()
    subprocess.run(cmd(str(tmp_path / "timed.bank")), check=True)
    seconds = (time.monotonic() - t0) * 1.2
    digest = sha256(ref)
    sup = Supervisor(str(tmp_path / "d"))
    c = qmoe_client.Client(sup.socket)
    try:
        for i in range(6):
            out = str(tmp_path / ("b%d.bank" % i))
            kill_at_random(cmd(out), seconds, rng)
            check_no_torn_bank(out, digest, c, "b%d" % i)
            r = None
            if kind == "import hf" and os.path.exists(out + ".partial"):
                r = subprocess.run(cmd(out, "--resume"), capture_output=True, text=True)
                # Refused only for a partial cut between its last write and
                # the rename (already whole, trailer gone); a run starts over.
                assert r.returncode == 0 or "remove it, or run without --resume" in r.stderr, \
                    r.stderr
            if r is None or r.returncode != 0:
                r = subprocess.run(cmd(out), capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            assert sha256(out) == digest and not os.path.exists(out + ".partial")
        # The daemon killed around a model.load: the next one loads the bank whole.
        want = c.load_model("whole", ref)["bytes_total"]

        def load(name):
            try:
                qmoe_client.Client(sup.socket, reconnect=0).load_model(name, ref)
            except qmoe_client.QmoeError:
                pass  # killed under it

        for i in range(3):
            loader = threading.Thread(target=load, args=("r%d" % i,))
            loader.start()
            time.sleep(rng.uniform(0, 0.01))
            sup.restart(wait=True)
            loader.join(30)
            c2 = qmoe_client.Client(sup.socket)
            # The loader's request may reach the new daemon (its connection
            # made after the restart): then the model is there, whole.
            # Either way the name then loads (or is loaded) whole.
            models = c2.models()
            assert [m["name"] for m in models] in ([], ["r%d" % i]), models
            if not models:
                assert c2.load_model("r%d" % i, ref)["bytes_total"] == want
            else:
                assert models[0]["bytes_total"] == want
            c2.close()
    finally:
        c.close()
        assert sup.stop() == 0, sup.log_text()[-3000:]
