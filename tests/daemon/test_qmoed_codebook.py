"""qmoed over the wire with a code-book bank (qmoe.codebook e2m1,
docs/BANK_FORMAT.md): model.list names the code book; every session of it
(fast whole_bank, where the fast GEMV reads the codes in 4 bits from r8 for
decode-sized jobs and 8-bit tiles otherwise; exact; paged next_use from the
file) answers with the bits of the int8 bank of the same weights (codes 128 +
2·E2M1), which onnxruntime's QMoE can read; its expert units are half the
int8 bank's bytes."""
import os

import numpy as np
import pytest

import qmoebank
from qmoed_harness import Daemon, from_tensor, make_bank, tensor

H, I, E = 128, 64, 8
E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


@pytest.fixture(scope="module")
def twin_banks(tmp_path_factory):
    """(code-book bank, its int8 twin): the twin's codes are 128 + E2M1[q]."""
    d = tmp_path_factory.mktemp("codebook")
    cb = make_bank(str(d / "cb.bank"), layers=2, experts=E, hidden=H, inter=I, k=2,
                   block=32, seed=5, codebook="e2m1")
    cfg, t = qmoebank.load_bank(cb)
    assert cfg.codebook == "e2m1" and cfg.bits == 4
    cfg8, t8 = qmoebank.codebook_as_int8(cfg, t)
    assert cfg8.codebook is None and cfg8.bits == 8
    name = "layers.0.fc1.weight"
    assert np.array_equal(t8[name], 128 + E2M1[qmoebank.unpack_codes(t[name], 4, H)])
    twin = str(d / "int8.bank")
    qmoebank.save_bank(twin, cfg8, t8)
    return cb, twin


def _infer(c, sid, layer, x):
    r = c.call("session.infer", {"session": sid, "layer": layer, "hidden": tensor(x)})
    return from_tensor(r["output"]).tobytes()


def test_code_book_sessions_answer_the_int8_banks_bits(twin_banks):
    cb, twin = twin_banks
    dm = Daemon(models={"cb": cb, "int8": twin})
    try:
        c = dm.client()
        models = {m["name"]: m for m in c.call("model.list")["models"]}
        assert models["cb"]["quantisation"]["codebook"] == "e2m1", models["cb"]
        assert "codebook" not in models["int8"]["quantisation"], models["int8"]
        assert models["cb"]["quantisation"]["bits"] == 4
        bpe_cb, bpe8 = models["cb"]["bytes_per_expert"], models["int8"]["bytes_per_expert"]
        assert bpe_cb < 0.6 * bpe8, (bpe_cb, bpe8)
        rng = np.random.default_rng(11)
        inputs = [(i % 2, rng.standard_normal((T, H)).astype(np.float32))
                  for i, T in enumerate([1, 2, 3, 1, 4, 8, 17, 1, 3, 64])]
        for precision in ("fast", "exact"):
            s8 = c.call("session.create", {"model": "int8", "precision": precision})["session"]
            want = [_infer(c, s8, l, x) for l, x in inputs]
            sessions = [c.call("session.create", {"model": "cb", "precision": precision})
                        ["session"],
                        c.call("session.create", {"model": "cb", "precision": precision,
                                                  "policy": "next_use",
                                                  "budget_bytes": 3 * bpe_cb})["session"]]
            for sid in sessions:
                got = [_infer(c, sid, l, x) for l, x in inputs]
                for (l, x), g, w in zip(inputs, got, want):
                    assert g == w, (precision, sid, l, x.shape)
        # The fast whole_bank session laid the code book out in r8 for its GEMV.
        assert "laid out for the fast CPU decode" in dm.log_text(), dm.log_text()[-3000:]
    finally:
        assert dm.stop() == 0, dm.log_text()


def test_code_book_sessions_on_a_device_answer_the_int8_banks_bits(twin_banks):
    """On an emulated device (device memory: a whole bank copied in, or
    every expert copied in before use when paged, the CUDA backend's
    regime) code-book sessions answer with the int8 twin's bits too; the
    CUDA kernels' own code-book paths are held to the same twin in
    tests/cuda (test_cuda_code_book_layer_is_its_int8_twin)."""
    cb, twin = twin_banks
    dm = Daemon(models={"cb": cb, "int8": twin}, args=["--device", "emu:0"])
    try:
        c = dm.client()
        bpe_cb = {m["name"]: m for m in c.call("model.list")["models"]}["cb"]["bytes_per_expert"]
        rng = np.random.default_rng(3)
        inputs = [(i % 2, rng.standard_normal((T, H)).astype(np.float32))
                  for i, T in enumerate([1, 2, 5, 1, 16])]
        s8 = c.call("session.create", {"model": "int8", "precision": "exact"})["session"]
        want = [_infer(c, s8, l, x) for l, x in inputs]
        for extra in ({}, {"policy": "next_use", "budget_bytes": 3 * bpe_cb}):
            sid = c.call("session.create", {"model": "cb", "precision": "exact", **extra})[
                "session"]
            for (l, x), w in zip(inputs, want):
                assert _infer(c, sid, l, x) == w, (extra, l, x.shape)
    finally:
        assert dm.stop() == 0, dm.log_text()
