"""qmoebank - read, write and evaluate qmoe expert bank files in Python.

A bank is a safetensors file laid out like the initializers of onnxruntime's
com.microsoft.QMoE operator (docs/BANK_FORMAT.md). This module is the Python
side of the format: the converters (onnx2bank.py, bank2onnx.py) and the tests
use it to load banks, dequantise weights, quantise float weights with the
rules onnxruntime's QMoE tests use, and compute a float64 reference forward
pass of one layer.

Only numpy and safetensors are needed; onnx/onnxruntime are imported lazily by
the functions that use them.
"""

import json
import math
import struct

import numpy as np

SUFFIXES = [
    "fc1.weight", "fc1.scales", "fc1.zero_points", "fc1.bias",
    "fc2.weight", "fc2.scales", "fc2.zero_points", "fc2.bias",
    "fc3.weight", "fc3.scales", "fc3.zero_points", "fc3.bias",
    "router.weight", "router.bias",
]
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "identity")
# qmoe.codebook (docs/BANK_FORMAT.md): a 4-bit code q weighs scale * value[q];
# e2m1 is MXFP4's E2M1 values doubled, q being the MXFP4 nibble.
CODEBOOKS = {"e2m1": (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)}

try:  # bfloat16 in numpy comes from ml_dtypes (an onnx dependency)
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None


class BankConfig:
    """The __metadata__ of a bank, typed."""

    INT_KEYS = ("layers", "experts", "hidden_size", "inter_size", "k", "bits", "block_size",
                "swiglu_fusion", "normalize_routing_weights")
    FLOAT_KEYS = ("activation_alpha", "activation_beta", "swiglu_limit")

    def __init__(self, layers, experts, hidden_size, inter_size, k, bits, block_size,
                 activation, swiglu_fusion=None, normalize_routing_weights=1,
                 activation_alpha=1.0, activation_beta=0.0, swiglu_limit=math.inf,
                 codebook=None):
        self.layers, self.experts = int(layers), int(experts)
        self.hidden_size, self.inter_size, self.k = int(hidden_size), int(inter_size), int(k)
        self.bits, self.block_size = int(bits), int(block_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not one of {ACTIVATIONS}")
        self.activation = activation
        if swiglu_fusion is None:
            swiglu_fusion = 1 if activation == "swiglu" else 0
        self.swiglu_fusion = int(swiglu_fusion)
        self.normalize_routing_weights = int(normalize_routing_weights)
        self.activation_alpha = float(activation_alpha)
        self.activation_beta = float(activation_beta)
        self.swiglu_limit = float(swiglu_limit)
        if codebook is not None and codebook not in CODEBOOKS:
            raise ValueError(f"qmoe.codebook {codebook!r} not one of {tuple(CODEBOOKS)}")
        if codebook is not None and self.bits != 4:
            raise ValueError(f"qmoe.codebook {codebook!r} needs bits 4, not {self.bits}")
        self.codebook = codebook  # None: code q weighs scale * (q - zero point)

    @property
    def pack(self):
        return 8 // self.bits

    @property
    def fused(self):
        return self.activation == "swiglu" and self.swiglu_fusion != 0

    @property
    def has_fc3(self):
        return self.activation == "swiglu" and self.swiglu_fusion == 0

    def dims(self, proj):
        """(N, K) of projection 'fc1' / 'fc2' / 'fc3'."""
        h, i = self.hidden_size, self.inter_size
        return {"fc1": (2 * i if self.fused else i, h), "fc2": (h, i), "fc3": (i, h)}[proj]

    @classmethod
    def from_metadata(cls, meta):
        def get(key, default=None):
            v = meta.get("qmoe." + key)
            return default if v is None else v

        if get("format") != "1":
            raise ValueError(f"qmoe.format is {get('format')!r}, expected '1'")
        kw = {}
        for key in cls.INT_KEYS:
            v = get(key)
            if v is not None:
                kw[key] = int(v)
        for key in cls.FLOAT_KEYS:
            v = get(key)
            if v is not None:
                kw[key] = float(v)
        kw["activation"] = get("activation")
        kw["codebook"] = get("codebook")
        return cls(**kw)

    def to_metadata(self):
        def fmt(x):
            if math.isinf(x):
                return "inf" if x > 0 else "-inf"
            return repr(float(x))

        meta = {"qmoe.format": "1", "qmoe.activation": self.activation}
        for key in self.INT_KEYS:
            meta["qmoe." + key] = str(int(getattr(self, key)))
        for key in self.FLOAT_KEYS:
            meta["qmoe." + key] = fmt(getattr(self, key))
        if self.codebook is not None:
            meta["qmoe.codebook"] = self.codebook
        return meta


def tool_parser(doc):
    """The argument parser of a converter script here: its docstring's first
    paragraph as the description, the rest, as written, after the help."""
    import argparse
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n\n", 1)[1])


def read_header(path):
    """(header dict without __metadata__, metadata dict, data offset) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    return header, meta, 8 + n


def load_bank(path):
    """(BankConfig, {name: numpy array}) of a bank file, through safetensors."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return BankConfig.from_metadata(meta), tensors


def save_bank(path, cfg, tensors):
    """Writes tensors (name -> array) and cfg's metadata with safetensors."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path,
              metadata=cfg.to_metadata())


def layer_tensors(tensors, layer):
    """{suffix: array} of one layer."""
    prefix = f"layers.{layer}."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# ---- packing -----------------------------------------------------------------

def unpack_codes(packed, bits, count):
    """Unpacks the last axis: value c sits in byte c // pack at bit (c % pack) * bits."""
    packed = np.asarray(packed, dtype=np.uint8)
    pack = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (j * bits)) & mask for j in range(pack)]
    out = np.stack(parts, axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * pack)
    return out[..., :count]


def pack_codes(codes, bits):
    """Inverse of unpack_codes; pads the last axis with zeros to a multiple of pack."""
    codes = np.asarray(codes, dtype=np.uint8)
    pack = 8 // bits
    n = codes.shape[-1]
    padded = -(-n // pack) * pack
    if padded != n:
        pad = [(0, 0)] * (codes.ndim - 1) + [(0, padded - n)]
        codes = np.pad(codes, pad)
    codes = codes.reshape(*codes.shape[:-1], padded // pack, pack)
    out = np.zeros(codes.shape[:-1], dtype=np.uint8)
    for j in range(pack):
        out |= (codes[..., j] << (j * bits)).astype(np.uint8)
    return out


def zero_points(cfg, zp, n):
    """Per-(expert, row, block) zero points [E, N, nblk'] from ORT's packed layout:
    row-wise [E, ceil(N/pack)] (packed along rows), block-wise [E, N, ceil(nblk/pack)]
    (packed along blocks). nblk' may exceed nblk by the packing padding."""
    if cfg.block_size:
        return unpack_codes(zp, cfg.bits, zp.shape[2] * cfg.pack).astype(np.float64)
    rows = unpack_codes(zp, cfg.bits, n).astype(np.float64)  # [E, N]
    return rows[:, :, None]


def dequantize(cfg, proj, lt):
    """Float64 weights [E, N, K] of projection `proj` ('fc1', ...) of a layer dict:
    scale * (code - zero point), or scale * value[code] through a code book."""
    n, k = cfg.dims(proj)
    codes = unpack_codes(lt[proj + ".weight"], cfg.bits, k)  # [E, N, K]
    s = np.asarray(lt[proj + ".scales"]).astype(np.float64)
    bs = cfg.block_size or k
    nblk = -(-k // bs)
    if s.ndim == 2:
        s = s[:, :, None]
    col_block = np.arange(k) // bs
    s_full = s[:, :, col_block] if s.shape[2] > 1 else s
    if cfg.codebook is not None:
        if proj + ".zero_points" in lt:
            raise ValueError(f"{proj}.zero_points in a bank with qmoe.codebook {cfg.codebook}")
        return s_full * np.asarray(CODEBOOKS[cfg.codebook], np.float64)[codes]
    q = codes.astype(np.float64)
    zp = lt.get(proj + ".zero_points")
    if zp is not None:
        z = zero_points(cfg, zp, n)[:, :, :nblk]
    else:
        z = np.full((1, 1, 1), float(1 << (cfg.bits - 1)))
    z_full = z[:, :, col_block] if z.shape[2] > 1 else z
    return s_full * (q - z_full)


# ---- quantisation (onnxruntime's QMoE test rules) ------------------------------

def quantize_rows(w, bits, block_size, asymmetric):
    """Quantises float rows w [..., N, K] per row (block_size 0) or per block.

    Returns (packed codes [..., N, K/pack] uint8, scales float32 [..., N] or
    [..., N, nblk], zero points or None). Symmetric: scale = absmax / qmax;
    asymmetric: scale = (max - min) / (2^bits - 1), zero point round(-min/scale);
    both floored at 1e-8; np.rint rounds half to even."""
    w = np.asarray(w, dtype=np.float32)
    k = w.shape[-1]
    bs = block_size or k
    nblk = -(-k // bs)
    pad = nblk * bs - k
    wp = np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)], constant_values=np.nan)
    blocks = wp.reshape(*w.shape[:-1], nblk, bs)
    qmax_sym = (1 << (bits - 1)) - 1
    smax = (1 << bits) - 1
    if not asymmetric:
        amax = np.nanmax(np.abs(blocks), axis=-1)
        scale = np.maximum(amax / np.float32(qmax_sym), np.float32(1e-8)).astype(np.float32)
        q = np.rint(blocks.astype(np.float64) / scale[..., None].astype(np.float64))
        q = np.clip(q, -qmax_sym - 1, qmax_sym) + (1 << (bits - 1))
        zp = None
    else:
        mn = np.nanmin(blocks, axis=-1)
        mx = np.nanmax(blocks, axis=-1)
        scale = np.maximum((mx - mn) / np.float32(smax), np.float32(1e-8)).astype(np.float32)
        zpf = 0.0 - mn.astype(np.float64) / scale.astype(np.float64)
        zp = np.clip(np.rint(zpf), 0, smax).astype(np.uint8)
        q = np.rint(blocks.astype(np.float64) / scale[..., None].astype(np.float64) + zpf[..., None])
        q = np.clip(q, 0, smax)
    q = np.nan_to_num(q).astype(np.uint8).reshape(*w.shape[:-1], nblk * bs)[..., :k]
    packed = pack_codes(q, bits)
    if not block_size:
        scale = scale[..., 0]
        if zp is not None:  # row-wise: packed along rows, [..., ceil(N/pack)]
            zp = pack_codes(zp[..., 0], bits)
    elif zp is not None:  # block-wise: packed along blocks, [..., N, ceil(nblk/pack)]
        zp = pack_codes(zp, bits)
    return packed, scale, zp


def quantize_rows_codebook(w, block_size, codebook="e2m1", scale_dtype=np.float32):
    """Quantises float rows w [..., N, K] (K even) through a code book the way
    `qmoe-bank create --codebook` does: per block the scale absmax / (the
    book's largest value), floored at 1e-8, rounded to scale_dtype; each code
    the nearest value to w / scale in f32, ties to the smaller code. Returns
    (packed codes [..., N, K/2] uint8, scales [..., N] or [..., N, nblk] of
    scale_dtype)."""
    values = np.asarray(CODEBOOKS[codebook], np.float32)
    w = np.asarray(w, dtype=np.float32)
    k = w.shape[-1]
    bs = block_size or k
    nblk = -(-k // bs)
    wp = np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, nblk * bs - k)])
    blocks = wp.reshape(*w.shape[:-1], nblk, bs)
    amax = np.abs(blocks).max(axis=-1)
    scale = np.maximum(amax / np.float32(np.abs(values).max()), np.float32(1e-8))
    scale = scale.astype(scale_dtype)
    s32 = scale.astype(np.float32)
    d = np.abs((blocks / s32[..., None])[..., None] - values)  # [..., nblk, bs, 16], f32
    codes = np.argmin(d, axis=-1).astype(np.uint8).reshape(*w.shape[:-1], nblk * bs)[..., :k]
    if not block_size:
        scale = scale[..., 0]
    return pack_codes(codes, 4), scale


def codebook_as_int8(cfg, tensors):
    """The int8 bank of a code-book bank's weights, bit for bit: each 4-bit
    code q becomes the 8-bit code 128 + value[q] (zero point 128), the
    scales and everything else unchanged (what `qmoe-bank import --mxfp4
    int8` writes from the same MXFP4 source). Returns (cfg, tensors); a bank
    without a code book comes back as it is."""
    if cfg.codebook is None:
        return cfg, tensors
    values = np.asarray(CODEBOOKS[cfg.codebook], np.int16)
    out = {}
    for name, arr in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[2] in ("fc1", "fc2", "fc3") and parts[3] == "weight":
            codes = unpack_codes(arr, 4, cfg.dims(parts[2])[1])
            out[name] = (128 + values[codes]).astype(np.uint8)
        else:
            out[name] = arr
    meta = cfg.to_metadata()
    meta["qmoe.bits"] = "8"
    del meta["qmoe.codebook"]
    return BankConfig.from_metadata(meta), out


# ---- the reference forward pass (float64) -----------------------------------------

def route(logits, k):
    """Top-k per token (ties: larger expert index), softmax over the k, drop w <= 1e-8."""
    logits = np.asarray(logits, dtype=np.float64)
    t, e = logits.shape
    experts = np.zeros((t, k), dtype=np.int64)
    weights = np.zeros((t, k), dtype=np.float64)
    for i in range(t):
        order = sorted(range(e), key=lambda j: (logits[i, j], j), reverse=True)[:k]
        sel = logits[i, order]
        p = np.exp(sel - sel.max())
        p /= p.sum()
        experts[i] = order
        weights[i] = np.where(p > 1e-8, p, 0.0)
    return experts, weights


def activation(cfg, h):
    a = cfg.activation
    if a == "relu":
        return np.maximum(h, 0)
    if a == "gelu":
        return 0.5 * h * (1 + np.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))
    if a == "silu":
        return h / (1 + np.exp(-h))
    if a == "identity":
        return h
    raise ValueError(a)


def swiglu(cfg, g, lin):
    lim = cfg.swiglu_limit
    g = np.minimum(g, lim)
    lin = np.clip(lin, -lim, lim)
    return g / (1 + np.exp(-cfg.activation_alpha * g)) * (lin + cfg.activation_beta)


def reference_forward(cfg, lt, x, logits):
    """Float64 output [T, H] of one layer (layer dict lt) for x [T, H] and logits [T, E]."""
    x = np.asarray(x, dtype=np.float64)
    i_size = cfg.inter_size
    w1 = dequantize(cfg, "fc1", lt)
    w2 = dequantize(cfg, "fc2", lt)
    w3 = dequantize(cfg, "fc3", lt) if cfg.has_fc3 else None
    b1 = lt.get("fc1.bias")
    b2 = lt.get("fc2.bias")
    b3 = lt.get("fc3.bias")
    experts, weights = route(logits, cfg.k)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.k):
            e, w = experts[t, j], weights[t, j]
            if w == 0:
                continue
            h = w1[e] @ x[t]
            if b1 is not None:
                h = h + b1[e].astype(np.float64)
            if cfg.activation == "swiglu":
                if cfg.swiglu_fusion == 1:
                    g, lin = h[0::2], h[1::2]
                elif cfg.swiglu_fusion == 2:
                    g, lin = h[:i_size], h[i_size:]
                else:
                    g = h
                    lin = w3[e] @ x[t]
                    if b3 is not None:
                        lin = lin + b3[e].astype(np.float64)
                a = swiglu(cfg, g, lin)
            else:
                a = activation(cfg, h)
            y = w2[e] @ a
            if b2 is not None:
                y = y + b2[e].astype(np.float64)
            out[t] += w * y
    return out
