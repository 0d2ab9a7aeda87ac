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

Only the Python standard library is used.
"""
import argparse
import bisect
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
            o = (t * layers + l) * k
            for j, e in enumerate(pick):
                ids[o + j] = e
            if weights is not None:
                raw = sorted((rng.random() + 0.05 for _ in range(k)), reverse=True)
                s = sum(raw)
                for j in range(k):
                    weights[o + j] = raw[j] / s
    meta = {"generator": "qmoe_trace.py", "model": "zipf+locality", "alpha": alphas,
            "locality": locality, "seed": seed}
    return Trace(tokens, layers, k, experts, ids, weights, meta)


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
    a = sub.add_parser("to-jsonl", help="binary -> JSON lines")
    a.add_argument("src")
    a.add_argument("dst")
    b = sub.add_parser("from-jsonl", help="JSON lines -> binary")
    b.add_argument("src")
    b.add_argument("dst")
    i = sub.add_parser("info", help="print a trace's header")
    i.add_argument("src")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "gen":
            tr = generate(args.tokens, args.layers, args.experts, args.k, args.alpha,
                          args.locality, args.seed, args.weights)
            write_trace(args.out, tr)
        elif args.cmd == "to-jsonl":
            to_jsonl(read_trace(args.src), args.dst)
        elif args.cmd == "from-jsonl":
            write_trace(args.dst, from_jsonl(args.src))
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
