#!/usr/bin/env python3
"""qmoe_trace.py - synthetic MoE routing traces and the JSON-lines converter.

Binary format (docs/TRACES.md): a 40-byte header, a JSON metadata block, then
the [tokens, layers, k] int16 expert ids (-1 = no expert) and, optionally,
[tokens, layers, k] float32 gate weights. The id payload is exactly vLLM's
routed_experts layout, so a trace from there is a header away.

    qmoe_trace.py gen --out t.qmtr --tokens 4000 --layers 32 --experts 8 --k 2 \
        --alpha 1.0 --locality 0.3 --seed 1
    qmoe_trace.py to-jsonl t.qmtr t.jsonl
    qmoe_trace.py from-jsonl t.jsonl t2.qmtr
    qmoe_trace.py info t.qmtr
    qmoe_trace.py gen-real --out r.qmtr --tokens 4000 --layers 32 --experts 8 --k 2 --seed 1
    qmoe_trace.py stats r.qmtr
    qmoe_trace.py min r.qmtr --slots 0.1,0.5   # Belady's MIN: the fewest loads possible

Only the Python standard library is used.
"""
import argparse
import bisect
import heapq
import json
import random
import struct
import sys
from array import array

MAGIC = b"QMTRACE\0"
VERSION = 1
HEADER = struct.Struct("<8sIIIIIIII")  # magic, version, tokens, layers, k, experts, flags, meta_len, reserved
FLAG_WEIGHTS = 1


class TraceError(Exception):
    pass


class Trace:
    """ids: array('h') of tokens*layers*k; weights: array('f') or None."""

    def __init__(self, tokens, layers, k, experts, ids, weights=None, meta=None):
        self.tokens, self.layers, self.k, self.experts = tokens, layers, k, experts
        self.ids = ids
        self.weights = weights
        self.meta = meta or {}
        if len(ids) != tokens * layers * k:
            raise TraceError("ids hold %d entries, expected %d" % (len(ids), tokens * layers * k))
        if weights is not None and len(weights) != len(ids):
            raise TraceError("weights hold %d entries, expected %d" % (len(weights), len(ids)))
        for v in ids:
            if v < -1 or v >= experts:
                raise TraceError("expert id %d outside [-1, %d)" % (v, experts))

    def row(self, t, l):
        o = (t * self.layers + l) * self.k
        return self.ids[o:o + self.k]


def _pad8(n):
    return (8 - n % 8) % 8


def write_trace(path, tr):
    meta = json.dumps(tr.meta, sort_keys=True, separators=(",", ":")).encode()
    flags = FLAG_WEIGHTS if tr.weights is not None else 0
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, tr.tokens, tr.layers, tr.k, tr.experts, flags,
                            len(meta), 0))
        f.write(meta + b"\0" * _pad8(HEADER.size + len(meta)))
        ids = array("h", tr.ids)
        if sys.byteorder != "little":
            ids.byteswap()
        f.write(ids.tobytes())
        if tr.weights is not None:
            w = array("f", tr.weights)
            if sys.byteorder != "little":
                w.byteswap()
            f.write(w.tobytes())


def read_trace(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        raise TraceError("%s: %d bytes, shorter than the %d-byte header" % (path, len(data), HEADER.size))
    magic, version, tokens, layers, k, experts, flags, meta_len, _ = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise TraceError("%s: bad magic (not a qmoe trace)" % path)
    if version != VERSION:
        raise TraceError("%s: version %d, expected %d" % (path, version, VERSION))
    if k == 0 or layers == 0 or experts == 0 or experts > 32767:
        raise TraceError("%s: bad shape layers=%d k=%d experts=%d" % (path, layers, k, experts))
    off = HEADER.size + meta_len
    off += _pad8(off)
    n = tokens * layers * k
    want = off + 2 * n + (4 * n if flags & FLAG_WEIGHTS else 0)
    if len(data) != want:
        raise TraceError("%s: %d bytes, expected %d" % (path, len(data), want))
    try:
        meta = json.loads(data[HEADER.size:HEADER.size + meta_len] or b"{}")
    except ValueError as e:
        raise TraceError("%s: metadata is not JSON: %s" % (path, e))
    ids = array("h")
    ids.frombytes(data[off:off + 2 * n])
    weights = None
    if flags & FLAG_WEIGHTS:
        weights = array("f")
        weights.frombytes(data[off + 2 * n:want])
    if sys.byteorder != "little":
        ids.byteswap()
        if weights is not None:
            weights.byteswap()
    return Trace(tokens, layers, k, experts, ids, weights, meta)


def _parse_alpha(text, layers):
    vals = [float(v) for v in str(text).split(",")]
    if len(vals) == 1:
        vals = vals * layers
    if len(vals) != layers:
        raise TraceError("--alpha lists %d values for %d layers" % (len(vals), layers))
    if any(a < 0 for a in vals):
        raise TraceError("--alpha must be >= 0")
    return vals


def _put_row(ids, weights, o, pick, rng):
    """Writes one (token, layer) row; with weights, k random descending
    weights summing to 1 (drawn after the ids, so ids do not depend on it)."""
    for j, e in enumerate(pick):
        ids[o + j] = e
    if weights is not None:
        raw = sorted((rng.random() + 0.05 for _ in range(len(pick))), reverse=True)
        s = sum(raw)
        for j, w in enumerate(raw):
            weights[o + j] = w / s


def generate(tokens, layers, experts, k, alpha, locality, seed, with_weights=False):
    """The model (docs/TRACES.md): per layer, a seeded random permutation maps
    popularity rank r (1-based) to an expert; P(rank r) ~ r^-alpha. Token 0 and,
    with probability 1 - locality, every later token draw k distinct experts
    from that distribution (without replacement); otherwise the token reuses
    the previous token's experts of that layer."""
    if not 1 <= k <= experts:
        raise TraceError("k=%d must be in [1, experts=%d]" % (k, experts))
    if not 0.0 <= locality <= 1.0:
        raise TraceError("--locality must be in [0, 1]")
    alphas = _parse_alpha(alpha, layers)
    rng = random.Random(seed)
    perms, cums = [], []
    for l in range(layers):
        perm = list(range(experts))
        rng.shuffle(perm)
        w = [1.0 / (r + 1) ** alphas[l] for r in range(experts)]
        cum, s = [], 0.0
        for x in w:
            s += x
            cum.append(s)
        perms.append(perm)
        cums.append(cum)
    ids = array("h", [0]) * (tokens * layers * k)
    weights = array("f", [0.0]) * (tokens * layers * k) if with_weights else None
    prev = [None] * layers
    for t in range(tokens):
        for l in range(layers):
            if prev[l] is not None and rng.random() < locality:
                pick = prev[l]
            else:
                cum, perm = cums[l], perms[l]
                total = cum[-1]
                chosen = []
                tries = 0
                while len(chosen) < k:
                    r = bisect.bisect_right(cum, rng.random() * total)
                    r = min(r, experts - 1)
                    e = perm[r]
                    tries += 1
                    if e not in chosen:
                        chosen.append(e)
                    elif tries > 64 * k:
                        # Very skewed and k close to E: take the next unused ranks.
                        for e2 in perm:
                            if e2 not in chosen:
                                chosen.append(e2)
                                break
                pick = chosen
            prev[l] = pick
            _put_row(ids, weights, (t * layers + l) * k, pick, rng)
    meta = {"generator": "qmoe_trace.py", "model": "zipf+locality", "alpha": alphas,
            "locality": locality, "seed": seed}
    return Trace(tokens, layers, k, experts, ids, weights, meta)


def generate_realistic(tokens, layers, experts, k, seed, reuse_top1=0.13, reuse_any=0.05,
                       alpha_lo=0.1, alpha_hi=0.7, drift=0.03, topic_tokens=250.0,
                       topic_strength=0.5, affinity=0.0, vocab=0, fidelity=0.0,
                       bigram=0.0, with_weights=False):
    """Routing shaped like a real MoE's (docs/TRACES.md, "The realistic model").

    Per layer l: a log-popularity vector from a Zipf law with its own skew
    alpha_l (uniform in [alpha_lo, alpha_hi]) over its own permutation, so
    hot experts and skew differ per layer. Popularity drifts: every token
    each log-popularity takes a mean-reverting random step (sd `drift`), and
    "topics" change after a geometric number of tokens (mean
    `topic_tokens`), each topic boosting a random quarter of every layer's
    experts by up to `topic_strength` (in log space). A token keeps the
    previous token's top-1 expert of that layer with probability
    `reuse_top1`, else draws its top-1 from the popularity; each further
    route reuses one of the previous token's experts with probability
    `reuse_any`, else draws from the popularity (k distinct experts, top-1
    first). The defaults give Mixtral's published figures for E=8, k=2
    (consecutive tokens share their top-1 ~25% of the time, >= 1 expert
    ~60%); `stats` measures them. `affinity` > 0 adds cross-layer structure:
    per layer l > 0 a random map of layer l-1's experts onto layer l's, and a
    token whose top-1 is not reused takes the image of its top-1 at layer
    l-1 with that probability (0, the default, draws nothing more, so the
    traces of the defaults are unchanged). `vocab` > 0 with `fidelity` > 0
    models tokens: each token is a word of a Zipf(1) vocabulary of `vocab`
    words, each word has its own route through every layer (drawn once from
    the layers' laws), and each of a token's routes follows its word's with
    probability `fidelity` (before reuse and affinity are tried), so
    routing agrees across layers the way a token's identity makes it.
    `bigram` > 0 makes the words a text: each word has 4 likely successors
    (a random table), and a token's word is one of its predecessor's
    successors with that probability, else a fresh Zipf draw."""
    import math
    if not 1 <= k <= experts:
        raise TraceError("k=%d must be in [1, experts=%d]" % (k, experts))
    for name, v in (("reuse_top1", reuse_top1), ("reuse_any", reuse_any)):
        if not 0.0 <= v <= 1.0:
            raise TraceError("--%s must be in [0, 1]" % name.replace("_", "-"))
    if not 0.0 <= affinity <= 1.0:
        raise TraceError("--affinity must be in [0, 1]")
    if not 0.0 <= fidelity <= 1.0 or vocab < 0 or (fidelity > 0 and vocab < 1):
        raise TraceError("--fidelity must be in [0, 1], with --vocab >= 1")
    if alpha_lo < 0 or alpha_hi < alpha_lo or drift < 0 or topic_tokens < 1:
        raise TraceError("bad realistic-model parameters")
    rng = random.Random(seed)
    base, alphas = [], []
    for l in range(layers):
        a = rng.uniform(alpha_lo, alpha_hi)
        perm = list(range(experts))
        rng.shuffle(perm)
        logp = [0.0] * experts
        for r, e in enumerate(perm):
            logp[e] = -a * math.log(r + 1)
        base.append(logp)
        alphas.append(round(a, 4))
    cur = [list(b) for b in base]
    topic = [[0.0] * experts for _ in range(layers)]
    succ = []
    if affinity > 0:  # layer l-1's expert e leads to succ[l][e] at layer l
        for l in range(layers):
            m = list(range(experts))
            rng.shuffle(m)
            succ.append(m)
    if not 0.0 <= bigram <= 1.0:
        raise TraceError("--bigram must be in [0, 1]")
    words, word_cum, follow = [], [], []
    if fidelity > 0:  # each word's route: k distinct experts per layer, from the layer's law
        for _ in range(vocab):
            route = []
            for l in range(layers):
                w = [math.exp(x) for x in base[l]]
                pick = []
                while len(pick) < k:
                    u, acc = rng.random() * sum(w[e] for e in range(experts) if e not in pick), 0.0
                    for e in range(experts):
                        if e in pick:
                            continue
                        acc += w[e]
                        if acc >= u:
                            break
                    pick.append(e)
                route.append(pick)
            words.append(route)
        acc = 0.0
        for r in range(vocab):
            acc += 1.0 / (r + 1)
            word_cum.append(acc)
        if bigram > 0:
            follow = [[rng.randrange(vocab) for _ in range(4)] for _ in range(vocab)]

    def new_topic():
        for l in range(layers):
            boosted = set(rng.sample(range(experts), max(1, experts // 4)))
            topic[l] = [rng.uniform(0.3, 1.0) * topic_strength if e in boosted else 0.0
                        for e in range(experts)]

    new_topic()
    ids = array("h", [0]) * (tokens * layers * k)
    weights = array("f", [0.0]) * (tokens * layers * k) if with_weights else None
    prev = [None] * layers
    for t in range(tokens):
        if t and rng.random() < 1.0 / topic_tokens:
            new_topic()
        if fidelity > 0:
            if t and bigram > 0 and rng.random() < bigram:
                w_id = follow[w_id][rng.randrange(4)]
            else:
                w_id = min(bisect.bisect_left(word_cum, rng.random() * word_cum[-1]), vocab - 1)
            word = words[w_id]
        else:
            word = None
        for l in range(layers):
            c, b, tp = cur[l], base[l], topic[l]
            for e in range(experts):  # mean-reverting drift around the layer's law
                c[e] += 0.02 * (b[e] - c[e]) + rng.gauss(0.0, drift)
            w = [math.exp(c[e] + tp[e]) for e in range(experts)]

            def draw(exclude):
                tot = sum(w[e] for e in range(experts) if e not in exclude)
                u = rng.random() * tot
                last = None
                for e in range(experts):
                    if e in exclude:
                        continue
                    last = e
                    u -= w[e]
                    if u <= 0:
                        return e
                return last

            p = prev[l]
            if word is not None and rng.random() < fidelity:
                pick = [word[l][0]]
            elif p is not None and rng.random() < reuse_top1:
                pick = [p[0]]
            elif l > 0 and affinity > 0 and rng.random() < affinity:
                pick = [succ[l][prev[l - 1][0]]]
            else:
                pick = [draw(())]
            while len(pick) < k:
                pool = [e for e in (p or []) if e not in pick]
                own = word[l][len(pick)] if word is not None else None
                if own is not None and own not in pick and rng.random() < fidelity:
                    pick.append(own)
                elif pool and rng.random() < reuse_any:
                    pick.append(pool[rng.randrange(len(pool))])
                else:
                    pick.append(draw(pick))
            prev[l] = pick
            _put_row(ids, weights, (t * layers + l) * k, pick, rng)
    meta = {"generator": "qmoe_trace.py", "model": "realistic", "alpha": alphas, "seed": seed,
            "reuse_top1": reuse_top1, "reuse_any": reuse_any, "drift": drift,
            "topic_tokens": topic_tokens, "topic_strength": topic_strength}
    if affinity > 0:
        meta["affinity"] = affinity
    if fidelity > 0:
        meta["vocab"], meta["fidelity"], meta["bigram"] = vocab, fidelity, bigram
    return Trace(tokens, layers, k, experts, ids, weights, meta)


def stats(tr, window=None):
    """Routing statistics to compare with published figures: how often
    consecutive tokens keep the top-1 expert of a layer (and the chance
    level, 1/E), share >= 1 expert, and how popularity differs per layer and
    drifts (total-variation distance between a layer's expert histogram in
    the first and second half, averaged; and between layers), and how much
    a token's top-1 at layer l says about its top-1 at layer l+1: the share
    of tokens whose top-1 at l+1 is the commonest successor of their top-1
    at l (`next_top1_given_top1`, fitted on the trace itself) against the
    share that is layer l+1's commonest top-1 (`next_top1_marginal`)."""
    L, k, E, T = tr.layers, tr.k, tr.experts, tr.tokens
    same1 = share = pairs = 0
    for t in range(1, T):
        for l in range(L):
            a, b = tr.row(t - 1, l), tr.row(t, l)
            if a[0] < 0 or b[0] < 0:
                continue
            pairs += 1
            same1 += a[0] == b[0]
            share += bool(set(x for x in a if x >= 0) & set(x for x in b if x >= 0))

    def hist(l, t0, t1):
        h = [0] * E
        for t in range(t0, t1):
            for e in tr.row(t, l):
                if e >= 0:
                    h[e] += 1
        n = float(sum(h)) or 1.0
        return [x / n for x in h]

    def tv(p, q):
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))

    follow = marginal = steps = 0
    for l in range(L - 1):
        joint, last = {}, [0] * E
        for t in range(T):
            a, b = tr.row(t, l)[0], tr.row(t, l + 1)[0]
            if a >= 0 and b >= 0:
                joint[(a, b)] = joint.get((a, b), 0) + 1
                last[b] += 1
                steps += 1
        best = {}
        for (a, b), n in joint.items():
            best[a] = max(best.get(a, 0), n)
        follow += sum(best.values())
        marginal += max(last)
    half = T // 2
    drift = sum(tv(hist(l, 0, half), hist(l, half, T)) for l in range(L)) / L if T > 1 else 0.0
    whole = [hist(l, 0, T) for l in range(L)]
    between = (sum(tv(whole[i], whole[j]) for i in range(L) for j in range(i + 1, L)) /
               (L * (L - 1) / 2)) if L > 1 else 0.0
    return {"top1_reuse": same1 / pairs if pairs else 0.0, "chance_top1": 1.0 / E,
            "share_any": share / pairs if pairs else 0.0, "drift_tv": drift,
            "layer_tv": between,
            "next_top1_given_top1": follow / steps if steps else 0.0,
            "next_top1_marginal": marginal / steps if steps else 0.0}


def access_sequence(tr):
    """The trace as the accesses a cache sees: per token, per layer, its
    distinct experts in ascending order, each a (layer, expert) key."""
    seq = []
    for t in range(tr.tokens):
        for l in range(tr.layers):
            seq.extend((l, e) for e in sorted(set(x for x in tr.row(t, l) if x >= 0)))
    return seq


def min_loads(seq, slots):
    """Belady's MIN on an access sequence with `slots` places: (its loads
    from a cold cache, the loads of the first fill = min(slots, distinct
    keys)). Every access stands alone, so MIN may evict an expert of the
    layer in progress once it is used: fewer constraints than a layer call
    has, a lower bound on any policy's loads. `loads - fill` is a lower
    bound from the best starting cache (a cold run can copy any warm one
    for at most `slots` more loads). No prefetching policy loads fewer into
    the same places (demand paging is optimal in loads). O(n log n)."""
    if slots < 1:
        raise ValueError("MIN needs at least one slot")
    n = len(seq)
    nxt, last = [0] * n, {}
    for i in range(n - 1, -1, -1):  # next position of seq[i]; never again: past the end, distinct
        nxt[i] = last.get(seq[i], n + i + 1)
        last[seq[i]] = i
    cache, heap, loads = {}, [], 0  # cache: key -> its next use; heap: (-next use, key), lazy
    for i, key in enumerate(seq):
        if key not in cache:
            loads += 1
            if len(cache) >= slots:
                while True:  # evict the furthest next use still current
                    nu, k = heapq.heappop(heap)
                    if cache.get(k) == -nu:
                        del cache[k]
                        break
        cache[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return loads, min(slots, len(last))


def to_jsonl(tr, path):
    with open(path, "w") as f:
        head = {"format": "qmoe-trace", "version": VERSION, "tokens": tr.tokens,
                "layers": tr.layers, "k": tr.k, "experts": tr.experts, "meta": tr.meta}
        f.write(json.dumps(head, sort_keys=True) + "\n")
        for t in range(tr.tokens):
            rec = {"token": t, "experts": [list(tr.row(t, l)) for l in range(tr.layers)]}
            if tr.weights is not None:
                o = t * tr.layers * tr.k
                rec["weights"] = [[float(x) for x in tr.weights[o + l * tr.k:o + (l + 1) * tr.k]]
                                  for l in range(tr.layers)]
            f.write(json.dumps(rec) + "\n")


def from_jsonl(path):
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    if not lines:
        raise TraceError("%s: empty" % path)
    head = json.loads(lines[0])
    if head.get("format") != "qmoe-trace":
        raise TraceError("%s: first line is not a qmoe-trace header" % path)
    layers, k, experts = int(head["layers"]), int(head["k"]), int(head["experts"])
    recs = [json.loads(ln) for ln in lines[1:]]
    if "tokens" in head and int(head["tokens"]) != len(recs):
        raise TraceError("%s: header says %d tokens, %d records follow" % (path, head["tokens"], len(recs)))
    ids = array("h")
    has_w = bool(recs) and "weights" in recs[0]
    weights = array("f") if has_w else None
    for i, rec in enumerate(recs):
        if rec.get("token", i) != i:
            raise TraceError("%s: record %d has token %r" % (path, i, rec.get("token")))
        ex = rec["experts"]
        if len(ex) != layers or any(len(r) != k for r in ex):
            raise TraceError("%s: token %d: experts must be [%d][%d]" % (path, i, layers, k))
        for r in ex:
            ids.extend(int(v) for v in r)
        if has_w:
            w = rec.get("weights")
            if w is None or len(w) != layers or any(len(r) != k for r in w):
                raise TraceError("%s: token %d: weights must be [%d][%d]" % (path, i, layers, k))
            for r in w:
                weights.extend(float(v) for v in r)
    return Trace(len(recs), layers, k, experts, ids, weights, head.get("meta") or {})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="generate a synthetic trace")
    g.add_argument("--out", required=True)
    g.add_argument("--tokens", type=int, default=1000)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--k", type=int, default=2)
    g.add_argument("--alpha", default="1.0", help="Zipf skew; one value or one per layer (a,b,...)")
    g.add_argument("--locality", type=float, default=0.0,
                   help="probability a token reuses the previous token's experts")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--weights", action="store_true", help="also store gate weights")
    r = sub.add_parser("gen-real", help="generate a trace shaped like real routing (drifting "
                       "per-layer popularity, token-to-token expert reuse)")
    r.add_argument("--out", required=True)
    r.add_argument("--tokens", type=int, default=4000)
    r.add_argument("--layers", type=int, default=32)
    r.add_argument("--experts", type=int, default=8)
    r.add_argument("--k", type=int, default=2)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--reuse-top1", type=float, default=0.13,
                   help="probability a token keeps the previous token's top-1 expert")
    r.add_argument("--reuse-any", type=float, default=0.05,
                   help="probability each further route reuses one of the previous token's")
    r.add_argument("--drift", type=float, default=0.03, help="sd of the per-token popularity walk")
    r.add_argument("--topic-tokens", type=float, default=250.0, help="mean tokens per topic")
    r.add_argument("--alpha-lo", type=float, default=0.1, help="least per-layer Zipf skew")
    r.add_argument("--alpha-hi", type=float, default=0.7, help="largest per-layer Zipf skew")
    r.add_argument("--topic-strength", type=float, default=0.5,
                   help="largest log-popularity boost of a topic's experts")
    r.add_argument("--affinity", type=float, default=0.0,
                   help="probability a token's top-1 follows its top-1 of the layer before "
                        "(a random map per layer; cross-layer structure)")
    r.add_argument("--vocab", type=int, default=0, help="words, each with its own route")
    r.add_argument("--fidelity", type=float, default=0.0,
                   help="probability a token's route follows its word's (with --vocab)")
    r.add_argument("--bigram", type=float, default=0.0,
                   help="probability a token's word is one of its predecessor's 4 successors")
    r.add_argument("--weights", action="store_true", help="also store gate weights")
    st = sub.add_parser("stats", help="routing statistics of a trace (reuse, drift)")
    st.add_argument("src")
    a = sub.add_parser("to-jsonl", help="binary -> JSON lines")
    a.add_argument("src")
    a.add_argument("dst")
    b = sub.add_parser("from-jsonl", help="JSON lines -> binary")
    b.add_argument("src")
    b.add_argument("dst")
    i = sub.add_parser("info", help="print a trace's header")
    i.add_argument("src")
    m = sub.add_parser("min", help="Belady's MIN: the fewest loads any policy could make with "
                       "SLOTS places (a share of all experts, e.g. 0.5, or a count)")
    m.add_argument("src")
    m.add_argument("--slots", required=True, help="comma-separated: counts, or shares in (0, 1)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "gen":
            tr = generate(args.tokens, args.layers, args.experts, args.k, args.alpha,
                          args.locality, args.seed, args.weights)
            write_trace(args.out, tr)
        elif args.cmd == "gen-real":
            tr = generate_realistic(args.tokens, args.layers, args.experts, args.k, args.seed,
                                    reuse_top1=args.reuse_top1, reuse_any=args.reuse_any,
                                    alpha_lo=args.alpha_lo, alpha_hi=args.alpha_hi,
                                    drift=args.drift, topic_tokens=args.topic_tokens,
                                    topic_strength=args.topic_strength, affinity=args.affinity,
                                    vocab=args.vocab, fidelity=args.fidelity,
                                    bigram=args.bigram, with_weights=args.weights)
            write_trace(args.out, tr)
        elif args.cmd == "stats":
            print(json.dumps(stats(read_trace(args.src)), sort_keys=True))
        elif args.cmd == "to-jsonl":
            to_jsonl(read_trace(args.src), args.dst)
        elif args.cmd == "from-jsonl":
            write_trace(args.dst, from_jsonl(args.src))
        elif args.cmd == "min":
            tr = read_trace(args.src)
            seq = access_sequence(tr)
            for text in args.slots.split(","):
                v = float(text)
                slots = int(v * tr.layers * tr.experts) if 0 < v < 1 else int(v)
                loads, fill = min_loads(seq, slots)
                print(json.dumps({"slots": slots, "accesses": len(seq), "loads": loads,
                                  "hit_rate": 1 - loads / len(seq) if seq else None,
                                  "warm_loads": loads - fill,
                                  "warm_loads_per_token": (loads - fill) / tr.tokens
                                  if tr.tokens else None}, sort_keys=True))
        else:
            tr = read_trace(args.src)
            print(json.dumps({"tokens": tr.tokens, "layers": tr.layers, "k": tr.k,
                              "experts": tr.experts, "weights": tr.weights is not None,
                              "meta": tr.meta}, sort_keys=True))
    except (TraceError, OSError, KeyError, ValueError, TypeError) as e:
        print("qmoe_trace: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
