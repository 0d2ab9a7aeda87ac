#!/usr/bin/env python3
"""onnx2bank - convert the com.microsoft.QMoE nodes of an ONNX model into a bank file.

    onnx2bank.py MODEL.onnx --out BANK [--allow-mixed]

Every QMoE node becomes one layer, in graph order (layer 0 = first node).
Inputs 2-13 of each node must be initializers (or Constant nodes); they are
copied byte for byte into `layers.L.<tensor>` (docs/BANK_FORMAT.md), and the
node's attributes become the bank's metadata. All nodes must share one
configuration (experts, sizes, k, bits, block size, activation, fusion,
constants), since a bank has one. A router is taken along when it is
recognisable: initializers named `layers.L.router.weight`/`.bias` (as
bank2onnx.py writes them), or a Gemm(transB=1) / MatMul(+Add) with
initializer weights feeding the node's router_probs.

Models with external data are loaded from the model's directory.
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmoebank  # noqa: E402

INPUT_SUFFIX = {2: "fc1.weight", 3: "fc1.scales", 4: "fc1.bias", 5: "fc2.weight",
                6: "fc2.scales", 7: "fc2.bias", 8: "fc3.weight", 9: "fc3.scales",
                10: "fc3.bias", 11: "fc1.zero_points", 12: "fc2.zero_points",
                13: "fc3.zero_points"}


class ConvertError(Exception):
    pass


def attr_dict(node):
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def constant_values(graph):
    """name -> numpy array for initializers and Constant node outputs."""
    from onnx import numpy_helper

    vals = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value":
                    vals[n.output[0]] = numpy_helper.to_array(a.t)
    return vals


def find_router(graph, vals, node):
    """(weight [E,H], bias [E] or None) of a node's router, or (None, None)."""
    probs_name = node.input[1]
    fc1 = node.input[2]
    if fc1.endswith("fc1.weight"):  # bank2onnx.py's naming: <prefix>router.weight
        prefix = fc1[: -len("fc1.weight")]
        w = vals.get(prefix + "router.weight")
        if w is not None:
            return w, vals.get(prefix + "router.bias")
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(probs_name)
    bias = None
    if node is not None and node.op_type == "Add":
        a, b = node.input[0], node.input[1]
        if b in vals and vals[b].ndim == 1:
            bias, node = vals[b], producer.get(a)
        elif a in vals and vals[a].ndim == 1:
            bias, node = vals[a], producer.get(b)
        else:
            return None, None
    if node is None:
        return None, None
    if node.op_type == "Gemm":
        at = attr_dict(node)
        if at.get("transA", 0) or not at.get("transB", 0) or at.get("alpha", 1.0) != 1.0:
            return None, None
        if node.input[1] not in vals:
            return None, None
        if len(node.input) > 2 and node.input[2]:
            if node.input[2] not in vals or bias is not None:
                return None, None
            bias = vals[node.input[2]]
        return vals[node.input[1]], bias
    if node.op_type == "MatMul" and node.input[1] in vals:
        return np.ascontiguousarray(vals[node.input[1]].T), bias
    return None, None


def node_config(node, vals):
    at = attr_dict(node)
    name = node.name or node.output[0]
    get = lambda i: vals.get(node.input[i]) if len(node.input) > i and node.input[i] else None  # noqa: E731
    fc1, fc2 = get(2), get(5)
    if fc1 is None or fc2 is None:
        raise ConvertError(f"{name}: fc1/fc2 weights must be initializers or Constants")
    bits = int(at.get("expert_weight_bits", 4))
    if bits not in (4, 8):
        raise ConvertError(f"{name}: expert_weight_bits {bits} not supported (4 or 8)")
    for key in ("fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits"):
        if key in at and int(at[key]) != bits:
            raise ConvertError(f"{name}: {key} differs from expert_weight_bits")
    qt = at.get("quant_type", b"int")
    if (qt.decode() if isinstance(qt, bytes) else qt) not in ("int", ""):
        raise ConvertError(f"{name}: quant_type {qt!r} not supported (integer only)")
    if int(at.get("weights_prepacked", 0) or 0) > 0:
        raise ConvertError(f"{name}: prepacked (device-specific) weights are not supported")
    pack = 8 // bits
    e, h = int(fc1.shape[0]), int(fc1.shape[2]) * pack
    i = int(fc2.shape[2]) * pack
    act = at.get("activation_type", b"relu")
    act = act.decode() if isinstance(act, bytes) else act
    fusion = int(at.get("swiglu_fusion", 0))
    if act != "swiglu":
        fusion = 0
    k = at.get("k")
    if k is None:
        raise ConvertError(f"{name}: attribute k is missing")
    return qmoebank.BankConfig(
        layers=1, experts=e, hidden_size=h, inter_size=i, k=int(k), bits=bits,
        block_size=int(at.get("block_size", 0) or 0), activation=act, swiglu_fusion=fusion,
        normalize_routing_weights=1,
        activation_alpha=float(at.get("activation_alpha", 1.0)),
        activation_beta=float(at.get("activation_beta", 0.0)),
        swiglu_limit=float(at.get("swiglu_limit", math.inf)))


def convert(model):
    """(BankConfig, tensors) of every QMoE node of an onnx ModelProto."""
    graph = model.graph
    vals = constant_values(graph)
    nodes = [n for n in graph.node if n.op_type == "QMoE" and n.domain == "com.microsoft"]
    if not nodes:
        raise ConvertError("the model has no com.microsoft.QMoE node")
    cfg, tensors = None, {}
    for layer, node in enumerate(nodes):
        c = node_config(node, vals)
        if cfg is None:
            cfg = c
        elif vars(c) | {"layers": 0} != vars(cfg) | {"layers": 0}:
            diff = [k for k in vars(c) if k != "layers" and vars(c)[k] != vars(cfg)[k]]
            raise ConvertError(f"{node.name or node.output[0]}: configuration differs from the "
                               f"first QMoE node in {', '.join(diff)} (a bank has one)")
        for idx, suffix in INPUT_SUFFIX.items():
            if len(node.input) > idx and node.input[idx]:
                arr = vals.get(node.input[idx])
                if arr is None:
                    raise ConvertError(f"{node.name}: input {idx} ({suffix}) is not an initializer")
                tensors[f"layers.{layer}.{suffix}"] = arr
        w, b = find_router(graph, vals, node)
        if w is not None:
            tensors[f"layers.{layer}.router.weight"] = w
            if b is not None:
                tensors[f"layers.{layer}.router.bias"] = b
    cfg.layers = len(nodes)
    return cfg, tensors


def main(argv=None):
    ap = qmoebank.tool_parser(__doc__)
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import onnx

    model = onnx.load(args.model, load_external_data=True)
    try:
        cfg, tensors = convert(model)
    except ConvertError as e:
        print(f"onnx2bank: {e}", file=sys.stderr)
        return 2
    qmoebank.save_bank(args.out, cfg, tensors)
    print(f"wrote {args.out}: {cfg.layers} layers, {cfg.experts} experts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
