#!/usr/bin/env python3
"""bank2onnx - write onnxruntime QMoE models from a qmoe bank file.

    bank2onnx.py BANK --out MODEL.onnx [--layer N|all] [--dtype auto|f32|f16]

One layer (default 0) gives the one-node oracle model of docs/BANK_FORMAT.md:
graph inputs `input` [tokens, H] and `router_probs` [tokens, E] (raw router
logits), one com.microsoft.QMoE node whose inputs 2-13 are the bank's tensors
as initializers, in the operator's order, with every attribute explicit, and
output `output`. Opset imports: "" 17 and com.microsoft 1.

`--layer all` chains every layer (layer l's output is layer l+1's input; each
layer has its own `router_probs_l` input), which onnx2bank.py turns back into
the whole bank.

Scales and biases must have the activation dtype for onnxruntime's CPU kernel.
--dtype auto (default) keeps the dtype of the bank's scales (so bank -> onnx ->
bank is byte-identical when biases and the router share it; `qmoe-bank create`'s
default of f16 scales and f32 biases does not); f32 or f16 casts scales, biases
and the router to that dtype
and sets the graph's activation dtype (what the oracle needs). A router weight
and bias in the bank are stored as initializers `layers.N.router.weight` /
`.bias` that no node reads: onnxruntime ignores them, onnx2bank.py keeps them.

A bank with a code book (qmoe.codebook, e.g. `import` of MXFP4 by default)
goes in as its int8 twin: QMoE has no code book, so each 4-bit code q becomes
the int8 code 128 + value[q], the same weights bit for bit (what `qmoe-bank
import ... --mxfp4 int8` writes), at twice the bytes.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmoebank  # noqa: E402

QMOE_INPUTS = [  # input index -> bank tensor suffix (2..13)
    (2, "fc1.weight"), (3, "fc1.scales"), (4, "fc1.bias"),
    (5, "fc2.weight"), (6, "fc2.scales"), (7, "fc2.bias"),
    (8, "fc3.weight"), (9, "fc3.scales"), (10, "fc3.bias"),
    (11, "fc1.zero_points"), (12, "fc2.zero_points"), (13, "fc3.zero_points"),
]
FLOAT_SUFFIXES = {"fc1.scales", "fc2.scales", "fc3.scales", "fc1.bias", "fc2.bias", "fc3.bias",
                  "router.weight", "router.bias"}


def np_dtype(name):
    return {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": qmoebank.BF16}[name]


def onnx_elem_type(dt):
    from onnx import TensorProto

    if dt == np.float32:
        return TensorProto.FLOAT
    if dt == np.float16:
        return TensorProto.FLOAT16
    if qmoebank.BF16 is not None and dt == qmoebank.BF16:
        return TensorProto.BFLOAT16
    raise ValueError(f"no ONNX element type for {dt}")


def qmoe_attributes(cfg):
    """Every attribute of the node, explicit (docs/BANK_FORMAT.md)."""
    attrs = {
        "k": cfg.k,
        "activation_type": cfg.activation,
        "expert_weight_bits": cfg.bits,
        "swiglu_fusion": cfg.swiglu_fusion,
        "normalize_routing_weights": cfg.normalize_routing_weights,
        "use_sparse_mixer": 0,
        "activation_alpha": cfg.activation_alpha,
        "activation_beta": cfg.activation_beta,
        "swiglu_limit": cfg.swiglu_limit,
    }
    if cfg.block_size > 0:
        attrs["block_size"] = cfg.block_size
    return attrs


def build_model(cfg, tensors, layers, dtype=None):
    """An onnx ModelProto for the given layers (a list of indices) of a loaded bank."""
    from onnx import TensorProto, helper, numpy_helper

    if dtype is None:  # auto: the bank's float dtype (first scales tensor)
        dtype = tensors[f"layers.{layers[0]}.fc1.scales"].dtype
    elem = onnx_elem_type(dtype)
    inits, nodes, inputs = [], [], []
    tokens = "tokens"
    inputs.append(helper.make_tensor_value_info("input", elem, [tokens, cfg.hidden_size]))
    prev = "input"
    for pos, layer in enumerate(layers):
        lt = qmoebank.layer_tensors(tensors, layer)
        probs = "router_probs" if len(layers) == 1 else f"router_probs_{layer}"
        inputs.append(helper.make_tensor_value_info(probs, elem, [tokens, cfg.experts]))
        names = [prev, probs] + [""] * 12
        for idx, suffix in QMOE_INPUTS:
            if suffix not in lt:
                continue
            arr = lt[suffix]
            if suffix in FLOAT_SUFFIXES:
                arr = arr.astype(dtype)
            name = f"layers.{layer}.{suffix}"
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
            names[idx] = name
        for suffix in ("router.weight", "router.bias"):
            if suffix in lt:
                inits.append(numpy_helper.from_array(
                    np.ascontiguousarray(lt[suffix].astype(dtype)), f"layers.{layer}.{suffix}"))
        while names and names[-1] == "":
            names.pop()
        out = "output" if pos == len(layers) - 1 else f"hidden_{layer}"
        nodes.append(helper.make_node("QMoE", names, [out], name=f"qmoe_layer_{layer}",
                                      domain="com.microsoft", **qmoe_attributes(cfg)))
        prev = out
    output = helper.make_tensor_value_info("output", elem, [tokens, cfg.hidden_size])
    graph = helper.make_graph(nodes, "qmoe_bank", inputs, [output], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="qmoed bank2onnx")
    model.ir_version = min(model.ir_version, 10)
    return model


def main(argv=None):
    ap = qmoebank.tool_parser(__doc__)
    ap.add_argument("bank")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layer", default="0", help="layer index, or 'all' for a chain of nodes")
    ap.add_argument("--dtype", default="auto", choices=["auto", "f32", "f16"])
    args = ap.parse_args(argv)
    import onnx

    cfg, tensors = qmoebank.load_bank(args.bank)
    if cfg.codebook is not None:
        print(f"bank2onnx: {args.bank} reads its 4-bit codes through the {cfg.codebook} code "
              "book, which onnxruntime's QMoE has not: written as int8 codes 128 + "
              f"{cfg.codebook}[q], the same weights at twice the bytes", file=sys.stderr)
        cfg, tensors = qmoebank.codebook_as_int8(cfg, tensors)
    if args.layer == "all":
        layers = list(range(cfg.layers))
    else:
        try:
            layers = [int(args.layer)]
        except ValueError:
            ap.error("--layer wants an integer or 'all'")
        if not 0 <= layers[0] < cfg.layers:
            ap.error(f"--layer {layers[0]} out of range (the bank has {cfg.layers} layers)")
    dtype = None if args.dtype == "auto" else np_dtype(args.dtype)
    model = build_model(cfg, tensors, layers, dtype)
    onnx.save(model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
