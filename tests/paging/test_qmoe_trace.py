"""tools/qmoe_trace.py: generator, binary format, JSON-lines round trip, and
the C reader in bench/policy_sim reading what the tool writes."""
import json
import os
import struct
import subprocess
import sys

import pytest

SRC = os.environ.get("QMOE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("QMOE_BUILD_DIR", os.path.join(SRC, "build"))
TOOL = os.path.join(SRC, "tools", "qmoe_trace.py")
sys.path.insert(0, os.path.join(SRC, "tools"))
import qmoe_trace  # noqa: E402


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def test_generated_trace_has_the_documented_header_and_payload(tmp_path):
    out = tmp_path / "t.qmtr"
    r = run_tool("gen", "--out", str(out), "--tokens", "50", "--layers", "3", "--experts", "8",
                 "--k", "2", "--alpha", "1.2", "--locality", "0.5", "--seed", "4")
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    magic, ver, tokens, layers, k, experts, flags, meta_len, _ = struct.unpack_from("<8sIIIIIIII", data)
    assert (magic, ver, tokens, layers, k, experts, flags) == (b"QMTRACE\0", 1, 50, 3, 2, 8, 0)
    meta = json.loads(data[40:40 + meta_len])
    assert meta["locality"] == 0.5 and meta["seed"] == 4
    off = 40 + meta_len
    off += (8 - off % 8) % 8
    assert len(data) == off + 2 * 50 * 3 * 2
    ids = struct.unpack_from("<%dh" % (50 * 3 * 2), data, off)
    assert all(0 <= e < 8 for e in ids)
    for t in range(50):  # k distinct experts per (token, layer)
        for l in range(3):
            row = ids[(t * 3 + l) * 2:(t * 3 + l) * 2 + 2]
            assert row[0] != row[1]


def test_same_seed_same_bytes_and_locality_one_repeats_the_first_token(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        assert run_tool("gen", "--out", str(p), "--tokens", "20", "--seed", "9").returncode == 0
    assert a.read_bytes() == b.read_bytes()
    tr = qmoe_trace.generate(30, 2, 8, 2, "1.0", 1.0, 3)
    for t in range(30):
        for l in range(2):
            assert list(tr.row(t, l)) == list(tr.row(0, l))


def test_skew_concentrates_routing_on_few_experts():
    flat = qmoe_trace.generate(2000, 1, 16, 1, "0", 0.0, 1)
    skew = qmoe_trace.generate(2000, 1, 16, 1, "1.5", 0.0, 1)
    top = lambda tr: max(list(tr.ids).count(e) for e in range(16)) / 2000.0
    assert top(flat) < 0.12
    assert top(skew) > 0.3


def test_jsonl_round_trip_is_bit_exact_with_weights(tmp_path):
    a, j, b = tmp_path / "a.qmtr", tmp_path / "a.jsonl", tmp_path / "b.qmtr"
    assert run_tool("gen", "--out", str(a), "--tokens", "40", "--layers", "4", "--weights").returncode == 0
    assert run_tool("to-jsonl", str(a), str(j)).returncode == 0
    lines = j.read_text().splitlines()
    head = json.loads(lines[0])
    assert head["format"] == "qmoe-trace" and head["tokens"] == 40 and len(lines) == 41
    assert run_tool("from-jsonl", str(j), str(b)).returncode == 0
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: b"XXXXXXXX" + d[8:], "magic"),
    (lambda d: d[:-1], "bytes, expected"),
    (lambda d: d[:20], "shorter"),
])
def test_reader_rejects_damaged_files(tmp_path, mutate, needle):
    a = tmp_path / "a.qmtr"
    assert run_tool("gen", "--out", str(a), "--tokens", "10").returncode == 0
    a.write_bytes(mutate(a.read_bytes()))
    r = run_tool("info", str(a))
    assert r.returncode == 2
    assert needle in r.stderr


def test_jsonl_with_wrong_shape_is_rejected(tmp_path):
    j = tmp_path / "bad.jsonl"
    j.write_text(json.dumps({"format": "qmoe-trace", "version": 1, "tokens": 1, "layers": 2,
                             "k": 2, "experts": 8}) + "\n" +
                 json.dumps({"token": 0, "experts": [[1, 2]]}) + "\n")
    r = run_tool("from-jsonl", str(j), str(tmp_path / "x"))
    assert r.returncode == 2 and "experts must be" in r.stderr


def test_policy_sim_reads_the_tools_traces(tmp_path):
    sim = os.path.join(BUILD, "bench", "policy_sim", "policy_sim")
    if not os.path.exists(sim):
        pytest.skip("policy_sim not built at %s" % sim)
    a = tmp_path / "a.qmtr"
    assert run_tool("gen", "--out", str(a), "--tokens", "60", "--layers", "4", "--experts", "8",
                    "--k", "2", "--alpha", "1.0", "--locality", "0.5").returncode == 0
    r = subprocess.run([sim, "--trace", str(a)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| " + str(a))]
    assert len(rows) == 4 + 6  # 4 budgets, then 3 policies x 2 budgets of prefetch
    a.write_bytes(a.read_bytes()[:-3])
    r = subprocess.run([sim, "--trace", str(a)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "truncated" in r.stderr


# ---- the realistic generator ------------------------------------------------


def test_realistic_generator_matches_published_mixtral_routing_statistics():
    # Mixtral-8x7B (8 experts, top-2, 32 layers): consecutive tokens keep the
    # top-1 expert 22-27% of the time (chance 12.5%) and share >= 1 expert
    # ~60%; popularity differs per layer and drifts.
    for seed in (1, 2):
        tr = qmoe_trace.generate_realistic(1500, 32, 8, 2, seed)
        s = qmoe_trace.stats(tr)
        assert 0.22 <= s["top1_reuse"] <= 0.27, s
        assert s["chance_top1"] == 0.125
        assert 0.55 <= s["share_any"] <= 0.65, s
        assert s["layer_tv"] > 0.08, s  # layers prefer different experts
        assert s["drift_tv"] > 0.02, s  # the first and second half differ
        assert tr.meta["model"] == "realistic" and len(tr.meta["alpha"]) == 32


def test_realistic_generator_knobs_move_the_statistics_and_seed_fixes_the_bytes(tmp_path):
    none = qmoe_trace.stats(qmoe_trace.generate_realistic(800, 8, 8, 2, 3, reuse_top1=0.0,
                                                          reuse_any=0.0, drift=0.0,
                                                          topic_strength=0.0))
    more = qmoe_trace.stats(qmoe_trace.generate_realistic(800, 8, 8, 2, 3, reuse_top1=0.6))
    assert none["top1_reuse"] < 0.2 < 0.5 < more["top1_reuse"], (none, more)
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        r = run_tool("gen-real", "--out", str(p), "--tokens", "30", "--layers", "4", "--seed", "5")
        assert r.returncode == 0, r.stderr
    assert a.read_bytes() == b.read_bytes()
    r = run_tool("stats", str(a))
    assert r.returncode == 0 and set(json.loads(r.stdout)) >= {"top1_reuse", "share_any"}
    r = run_tool("gen-real", "--out", str(a), "--reuse-top1", "1.5")
    assert r.returncode == 2 and "reuse-top1" in r.stderr


def test_realistic_generator_cross_layer_knobs_add_structure_and_keep_the_defaults(tmp_path):
    base = qmoe_trace.generate_realistic(600, 8, 8, 2, 4)
    # the defaults draw nothing more: the same bytes as before the knobs existed
    assert base.ids == qmoe_trace.generate_realistic(600, 8, 8, 2, 4, affinity=0.0, vocab=50,
                                                     fidelity=0.0, bigram=0.0).ids
    plain = qmoe_trace.stats(base)
    aff = qmoe_trace.stats(qmoe_trace.generate_realistic(600, 8, 8, 2, 4, affinity=0.5))
    # a token's top-1 at layer l says more about layer l+1 with affinity
    assert plain["next_top1_given_top1"] - plain["next_top1_marginal"] < 0.08, plain
    assert aff["next_top1_given_top1"] - aff["next_top1_marginal"] > 0.2, aff
    words = qmoe_trace.generate_realistic(600, 8, 8, 2, 4, vocab=20, fidelity=1.0, bigram=0.5)
    assert words.meta["vocab"] == 20 and words.meta["bigram"] == 0.5
    # fidelity 1: every token is one of 20 routes through all layers
    routes = {tuple(tuple(words.row(t, l)) for l in range(8)) for t in range(600)}
    assert len(routes) <= 20, len(routes)
    for bad, needle in ((["--affinity", "1.5"], "--affinity"),
                        (["--fidelity", "0.5"], "--vocab"),  # words need a vocabulary
                        (["--vocab", "4", "--bigram", "2"], "--bigram")):
        r = run_tool("gen-real", "--out", str(tmp_path / "x"), "--tokens", "10", *bad)
        assert r.returncode == 2 and needle in r.stderr, (bad, r.stderr)


# ---- policy_sim's readers: .npy (vLLM routed_experts) and JSON lines -----------


def _sim():
    sim = os.path.join(BUILD, "bench", "policy_sim", "policy_sim")
    if not os.path.exists(sim):
        pytest.skip("policy_sim not built at %s" % sim)
    return sim


def _table(sim, path, *extra):
    r = subprocess.run([sim, "--trace", str(path), "--no-prefetch", "--policies", "lru,next_use",
                        *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [ln.split("|")[2:] for ln in r.stdout.splitlines() if ln.startswith("| " + str(path))]
    assert len(rows) == 4
    return rows


def test_policy_sim_reads_npy_and_jsonl_like_the_binary_trace(tmp_path):
    np = pytest.importorskip("numpy")
    sim = _sim()
    tr = qmoe_trace.generate_realistic(80, 4, 8, 2, 11)
    q, j = tmp_path / "t.qmtr", tmp_path / "t.jsonl"
    qmoe_trace.write_trace(str(q), tr)
    qmoe_trace.to_jsonl(tr, str(j))
    want = _table(sim, q)
    assert _table(sim, j) == want
    arr = np.array(list(tr.ids), dtype=np.int64).reshape(80, 4, 2)
    for dtype in (np.int64, np.int32, np.int16):
        n = tmp_path / ("t_%s.npy" % np.dtype(dtype).name)
        np.save(str(n), arr.astype(dtype))
        # The expert count is not in a .npy: given, or the largest id + 1.
        assert _table(sim, n, "--experts", "8") == want
    # A dropped route (-1) is read as no expert.
    arr[0, 0, 1] = -1
    n = tmp_path / "dropped.npy"
    np.save(str(n), arr)
    assert len(_table(sim, n, "--experts", "8")) == 4


@pytest.mark.parametrize("make,needle", [
    (lambda np: np.zeros((5, 4), dtype=np.int64), "3-D"),
    (lambda np: np.asfortranarray(np.zeros((5, 4, 2), dtype=np.int64)), "Fortran"),
    (lambda np: np.zeros((5, 4, 2), dtype=np.float32), "dtype"),
    (lambda np: np.full((5, 4, 2), 40000, dtype=np.int64), "outside"),
])
def test_policy_sim_rejects_npy_it_cannot_read_naming_why(tmp_path, make, needle):
    np = pytest.importorskip("numpy")
    sim = _sim()
    n = tmp_path / "bad.npy"
    np.save(str(n), make(np))
    r = subprocess.run([sim, "--trace", str(n), "--no-prefetch"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and needle in r.stderr, r.stderr


def test_policy_sim_rejects_a_jsonl_record_of_the_wrong_shape(tmp_path):
    sim = _sim()
    j = tmp_path / "bad.jsonl"
    j.write_text(json.dumps({"format": "qmoe-trace", "layers": 2, "k": 2, "experts": 8}) + "\n" +
                 json.dumps({"token": 0, "experts": [[1, 2]]}) + "\n")
    r = subprocess.run([sim, "--trace", str(j), "--no-prefetch"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "line 2" in r.stderr, r.stderr


def _brute_min(seq, slots):
    """The fewest loads, by trying every victim (small sequences only)."""
    from functools import lru_cache

    @lru_cache(None)
    def best(i, cache):
        if i == len(seq):
            return 0
        key = seq[i]
        if key in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, cache | {key})
        return 1 + min(best(i + 1, (cache - {v}) | {key}) for v in cache)

    return best(0, frozenset())


def test_min_loads_equal_a_brute_force_optimum():
    import random
    rng = random.Random(7)
    for _ in range(400):
        n, keys, slots = rng.randint(1, 13), rng.randint(1, 6), rng.randint(1, 4)
        seq = [rng.randrange(keys) for _ in range(n)]
        loads, fill = qmoe_trace.min_loads(seq, slots)
        assert loads == _brute_min(seq, slots), (seq, slots)
        assert fill == min(slots, len(set(seq)))
    with pytest.raises(ValueError):
        qmoe_trace.min_loads([1], 0)


def test_min_of_a_cycle_beats_lru_and_the_subcommand_prints_it(tmp_path):
    # One expert per layer, 3 layers visited in turn, 2 places: LRU misses
    # every access; MIN keeps one for good and misses half the others.
    ids = qmoe_trace.array("h", [0] * (10 * 3))
    tr = qmoe_trace.Trace(10, 3, 1, 4, ids)
    seq = qmoe_trace.access_sequence(tr)
    assert seq[:4] == [(0, 0), (1, 0), (2, 0), (0, 0)] and len(seq) == 30
    loads, fill = qmoe_trace.min_loads(seq, 2)
    assert fill == 2 and loads == 2 + 14  # after the fill, every other access of one key
    path = tmp_path / "c.qmtr"
    qmoe_trace.write_trace(str(path), tr)
    r = run_tool("min", str(path), "--slots", "2,3")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["slots"], x["loads"], x["warm_loads"]) for x in rows] == [(2, 16, 14), (3, 3, 0)]
    assert rows[1]["hit_rate"] == 0.9 and rows[0]["warm_loads_per_token"] == 1.4
