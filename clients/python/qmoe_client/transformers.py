"""Hugging Face transformers on qmoed: the routed experts of every MoE layer
run in the daemon, everything else (attention, dense layers, routers, shared
experts) stays in transformers.

transformers >= 5 dispatches each MoE block's expert computation through its
experts-implementation registry (``transformers.integrations.moe``,
``ALL_EXPERTS_FUNCTIONS``): the block computes its own routing and calls
``experts(hidden_states, top_k_index, top_k_weights)``. ``attach`` registers
``"qmoed"`` there and switches the model to it (the same as loading with
``experts_implementation="qmoed"`` once ``register()`` ran); the engine's
routing goes to ``session.infer`` as ``topk_ids``/``topk_weights`` and the
tensors travel through one shared-memory map (no base64)::

    import qmoe_client
    from qmoe_client.transformers import attach

    client = qmoe_client.Client()
    hook = attach(model, client, "mixtral", policy="lru", budget="30%")
    model.generate(ids, max_new_tokens=32)
    print(hook.stats())
    hook.detach()   # the model computes its experts itself again

One session serves one model instance. transformers 4.x (sparse MoE blocks
without the registry) is not supported by this module.
"""

import json
import re
import struct
import time

_IMPL = "qmoed"
_ALIGN = 64
_DTYPES = None  # torch dtype -> wire dtype, filled on first use


def _torch():
    import torch

    global _DTYPES
    if _DTYPES is None:
        _DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    return torch


def _experts_interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:  # transformers 4.x
        raise RuntimeError("qmoe_client.transformers needs transformers >= 5 (its experts "
                           "implementation registry); this one has none") from e
    return ALL_EXPERTS_FUNCTIONS


def _original_forward(module):
    fwd = type(module).forward
    return getattr(fwd, "__wrapped__", fwd)


def _qmoed_experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args,
                           **kwargs):
    """The "qmoed" experts implementation: a tagged experts module asks the
    daemon; an untagged one (another model, or detached) computes itself."""
    hook = getattr(self, "_qmoe_layer", None)
    if hook is None:
        return _original_forward(self)(self, hidden_states, top_k_index, top_k_weights, *args,
                                       **kwargs)
    return hook[0]._forward(hook[1], hidden_states, top_k_index, top_k_weights)


def register():
    """Registers the "qmoed" experts implementation with transformers (idempotent)."""
    iface = _experts_interface()
    type(iface).register(_IMPL, _qmoed_experts_forward)


def _is_experts_module(module):
    # What @use_experts_implementation adds (the ONNX/OpenVINO exporters test the same).
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def _bank_layer_map(path):
    """qmoe.layer_map from the bank file's header (a safetensors header)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 1 << 28:
                return None
            meta = json.loads(f.read(n)).get("__metadata__", {})
    except (OSError, ValueError, struct.error):
        return None
    lm = meta.get("qmoe.layer_map")
    return json.loads(lm) if lm else None


def _budget_bytes(budget, total):
    if budget is None:
        return None
    if isinstance(budget, str):
        b = budget.strip()
        if b.endswith("%"):
            return max(1, int(total * float(b[:-1]) / 100.0))
        budget = float(b)
    if isinstance(budget, float) and 0 < budget <= 1:
        return max(1, int(total * budget))
    return int(budget)


class Hook:
    """A model attached to a qmoed session. `session` is its id, `layers`
    maps the model's MoE layer index to the bank layer; stats() sums what
    every session.infer answered; detach() restores the model."""

    def __init__(self, model, client, model_name, summary, session, layers, previous):
        self.model, self.client, self.model_name = model, client, model_name
        self.summary, self.session, self.layers = summary, session, layers
        self._previous = previous
        self._map = None
        self._views = None
        self._tagged = []
        self._stats = {"calls": 0, "tokens": 0, "hits": 0, "misses": 0, "bytes_paged": 0,
                       "compute_us": 0, "queue_us": 0, "wall_s": 0.0}
        self.trace = None  # a list of (layer, topk_ids) when recording

    # ---- the shared map ----
    def _ensure_map(self, need):
        if self._map is not None and self._map.size >= need:
            return
        if self._map is not None:
            self._views = None
            self.client.unmap(self._map)
            self._map = None
        size = max(1 << 20, 1 << (need - 1).bit_length())
        self._map = self.client.map(self.session, size)
        torch = _torch()
        self._views = torch.frombuffer(self._map.mmap, dtype=torch.uint8)

    def _region(self, offset, shape, dtype):
        torch = _torch()
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self._views[offset:offset + nbytes].view(dtype).view(*shape)

    def _forward(self, bank_layer, hidden_states, top_k_index, top_k_weights):
        torch = _torch()
        t0 = time.perf_counter()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        T, H = x.shape
        ids = top_k_index.reshape(T, -1)
        w = top_k_weights.reshape(T, -1)
        if w.shape[1] != ids.shape[1]:  # full [T, E] scores: the chosen ones
            w = torch.gather(w, 1, ids.long())
        k = ids.shape[1]
        wire = _DTYPES.get(x.dtype)
        if wire is None:
            raise TypeError("qmoed takes float32, float16 or bfloat16 hidden states, not %s" % x.dtype)
        esz = x.element_size()
        wdt = w.dtype if w.dtype in _DTYPES else torch.float32
        wsz = torch.empty((), dtype=wdt).element_size()

        def up(n):
            return (n + _ALIGN - 1) // _ALIGN * _ALIGN

        o_x = 0
        o_ids = up(T * H * esz)
        o_w = o_ids + up(T * k * 4)
        o_out = o_w + up(T * k * wsz)
        self._ensure_map(o_out + up(T * H * esz))
        with torch.no_grad():
            self._region(o_x, (T, H), x.dtype).copy_(x)
            self._region(o_ids, (T, k), torch.int32).copy_(ids)
            self._region(o_w, (T, k), wdt).copy_(w)
        m = self._map.id
        p = {"session": self.session, "layer": bank_layer,
             "hidden": {"dtype": wire, "shape": [T, H], "map": m, "offset": o_x},
             "topk_ids": {"dtype": "i32", "shape": [T, k], "map": m, "offset": o_ids},
             "topk_weights": {"dtype": _DTYPES[wdt], "shape": [T, k], "map": m, "offset": o_w},
             "output_to": {"map": m, "offset": o_out}}
        r = self.client.call("session.infer", p)
        out = self._region(o_out, (T, H), x.dtype).clone()
        st = r.get("stats", {})
        s = self._stats
        s["calls"] += 1
        s["tokens"] += T
        for key in ("hits", "misses", "bytes_paged", "compute_us", "queue_us"):
            s[key] += int(st.get(key, 0))
        if self.trace is not None:
            self.trace.append((bank_layer, ids.to(torch.int32).cpu().numpy().copy()))
        out = out.to(hidden_states.device).reshape(shape)
        s["wall_s"] += time.perf_counter() - t0
        return out

    def stats(self):
        """Sums over this hook's calls: calls, tokens (token-layers), hits,
        misses, bytes_paged, compute_us, queue_us, wall_s; hit_rate."""
        s = dict(self._stats)
        looked = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / looked if looked else 1.0
        return s

    def detach(self, close_session=True):
        """The model computes its experts itself again; the map and (unless
        told otherwise) the session are released."""
        for mod in self._tagged:
            if getattr(mod, "_qmoe_layer", None) is not None:
                del mod._qmoe_layer
        self._tagged = []
        if self._previous is not None:
            self.model.set_experts_implementation(self._previous)
            self._previous = None
        try:
            if self._map is not None:
                self._views = None
                self.client.unmap(self._map)
        finally:
            self._map = None
            if close_session and self.session is not None:
                self.client.close_session(self.session)
                self.session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()


def _model_layer_index(name):
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else None


def attach(model, client, model_name, policy=None, budget=None, precision=None,
           policy_params=None):
    """Runs `model`'s routed experts in qmoed's model `model_name` (a bank
    imported from the same checkpoint, loaded with model.load): creates a
    session (policy, budget as bytes, a fraction or "NN%" of the bank's
    expert bytes, precision "exact"/"fast"), tags each MoE layer's experts
    with its bank layer (the bank's qmoe.layer_map) and switches the model to
    the "qmoed" experts implementation. Returns a Hook; hook.detach()
    restores the model."""
    register()
    summary = next((m for m in client.models() if m.get("name") == model_name), None)
    if summary is None:
        raise ValueError("qmoed has no model %r loaded (model.load it first)" % model_name)
    experts = [(n, mod) for n, mod in model.named_modules() if _is_experts_module(mod)]
    if not experts:
        raise ValueError("the model has no experts module that transformers' experts "
                         "implementation registry dispatches")
    layer_map = summary.get("layer_map") or _bank_layer_map(summary.get("path", ""))
    layers = {}
    for i, (name, mod) in enumerate(experts):
        idx = _model_layer_index(name)
        if layer_map is not None:
            if idx not in layer_map:
                raise ValueError("%s (model layer %s) is not in the bank's layer map %s"
                                 % (name, idx, layer_map))
            bank = layer_map.index(idx)
        else:
            bank = i  # MoE layers in model order
        layers[name] = bank
    if len(layers) != int(summary["layers"]):
        raise ValueError("the model has %d MoE layers but bank %r has %d"
                         % (len(layers), model_name, summary["layers"]))
    p = {"model": model_name}
    if policy is not None:
        p["policy"] = policy
    b = _budget_bytes(budget, int(summary["bytes_total"]))
    if b is not None:
        p["budget_bytes"] = b
    if policy_params:
        p["policy_params"] = policy_params
    if precision is not None:
        p["precision"] = precision
    session = client.call("session.create", p)["session"]
    previous = model.get_experts_implementation()
    hook = Hook(model, client, model_name, summary, session, layers, previous)
    try:
        for name, mod in experts:
            mod._qmoe_layer = (hook, layers[name])
            hook._tagged.append(mod)
        model.set_experts_implementation(_IMPL)
    except BaseException:
        hook.detach()
        raise
    return hook
