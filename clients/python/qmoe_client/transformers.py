"""Hugging Face transformers on qmoed: the routed experts of every MoE layer
run in the daemon, everything else (attention, dense layers, routers, shared
experts) stays in transformers.

transformers >= 5 dispatches each MoE block's expert computation through its
experts-implementation registry (``transformers.integrations.moe``,
``ALL_EXPERTS_FUNCTIONS``): the block computes its own routing and calls
``experts(hidden_states, top_k_index, top_k_weights)``. This module registers
``"qmoed"`` there; the engine's routing goes to ``session.infer`` as
``topk_ids``/``topk_weights`` and the tensors travel through one
shared-memory map (no base64).

The road: ``from_pretrained`` loads a checkpoint without its routed experts
(never read, never allocated: their parameters stay on the ``meta`` device)
and attaches it to a new session::

    import qmoe_client
    from qmoe_client import transformers as qt

    client = qmoe_client.Client()
    model = qt.from_pretrained("~/models/Mixtral-8x7B", client, "mixtral",
                               policy="next_use", budget="30%")
    model.generate(ids, max_new_tokens=32)
    print(model.qmoe_hook.stats())
    model.qmoe_hook.close()

``attach`` is for a model already loaded in full: its experts are then held
twice, in the engine and in the bank; ``hook.detach()`` gives the model its
own experts back. One session serves one model instance. A hook's session is
closed at interpreter exit when nobody closed it. transformers 4.x (sparse
MoE blocks without the registry) is not supported by this module.
"""

import atexit
import re
import os
import threading
import time
import weakref

from . import _ring
from ._client import QmoeError

_IMPL = "qmoed"
_ALIGN = 64
_MAX_SLOTS = 8  # request layouts (token counts) cached per hook
_DTYPES = None  # torch dtype -> (wire dtype, element size), filled on first use
_LIVE = weakref.WeakSet()  # hooks not closed yet: closed at exit
_LOAD_LOCK = threading.Lock()


def _torch():
    import torch

    global _DTYPES
    if _DTYPES is None:
        _DTYPES = {torch.float32: ("f32", 4), torch.float16: ("f16", 2),
                   torch.bfloat16: ("bf16", 2)}
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


def _not_loaded(module):
    return RuntimeError(
        "%s: its expert weights were never loaded (qmoe_client.transformers.from_pretrained "
        "leaves the routed experts in qmoed) and it has no qmoed session (its hook was "
        "closed); load the model again with from_pretrained" % module._qmoe_name)


def _qmoed_experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args,
                           **kwargs):
    """The "qmoed" experts implementation: a tagged experts module asks the
    daemon; an untagged one (another model, or detached) computes itself,
    unless its weights were never loaded."""
    hook = getattr(self, "_qmoe_layer", None)
    if hook is None:
        if getattr(self, "_qmoe_name", None) is not None:
            raise _not_loaded(self)
        return _original_forward(self)(self, hidden_states, top_k_index, top_k_weights, *args,
                                       **kwargs)
    return hook[0]._forward(hook[1], hidden_states, top_k_index, top_k_weights)


def _refuse_unloaded(module, args):
    """Forward pre-hook of an experts module without weights: whatever
    experts implementation the model was switched to, it never computes on
    meta tensors."""
    if getattr(module, "_qmoe_layer", None) is None:
        raise _not_loaded(module)


def register():
    """Registers the "qmoed" experts implementation with transformers (idempotent)."""
    iface = _experts_interface()
    type(iface).register(_IMPL, _qmoed_experts_forward)


def _is_experts_module(module):
    # What @use_experts_implementation adds (the ONNX/OpenVINO exporters test the same).
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def _experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if _is_experts_module(m)]


def _wire_budget(budget):
    """The budget as the daemon takes it: bytes (an int), "N%" and "auto" as
    given, a fraction in (0, 1] as "N%" (the daemon works out the bytes of
    the bank, so nothing here reads it)."""
    if isinstance(budget, float) and 0 < budget <= 1:
        return "%.10g%%" % (budget * 100)
    if isinstance(budget, str):
        b = budget.strip()
        try:
            f = float(b)
        except ValueError:
            return b  # "auto", "N%": the daemon checks it
        return _wire_budget(f) if 0 < f <= 1 else b
    return budget


def _model_layer_index(name):
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else None


def _bank_summary(client, model_name):
    """model.list's entry of `model_name`; ValueError naming the loaded
    models when the daemon has no such model (a QmoeError when the daemon
    cannot be asked)."""
    models = client.models()
    summary = next((m for m in models if m.get("name") == model_name), None)
    if summary is None:
        raise ValueError("qmoed has no model %r loaded (loaded: %s); load its bank with "
                         "model.load (qmoectl load %s BANK) first"
                         % (model_name, ", ".join(m["name"] for m in models) or "none",
                            model_name))
    return summary


def _expert_dims(module):
    """(experts, hidden, intermediate) of an experts module, from its
    down_proj ([E, H, I], or [E, I, H] when transposed); None if unknown."""
    w = getattr(module, "down_proj", None)
    if w is None or getattr(w, "dim", lambda: 0)() != 3:
        return None
    e, a, b = (int(d) for d in w.shape)
    return (e, b, a) if getattr(module, "is_transposed", False) else (e, a, b)


def _bank_layers(summary, experts, model_name):
    """{experts module name: bank layer} for `experts` ([(name, module)]),
    checked against the bank: the same MoE layers (its qmoe.layer_map), and
    every module's expert count, hidden and intermediate size."""
    if not experts:
        raise ValueError("the model has no experts module that transformers' experts "
                         "implementation registry dispatches")
    layer_map = summary.get("layer_map")  # model.list carries it: nothing read from the file
    layers = {}
    for i, (name, mod) in enumerate(experts):
        idx = _model_layer_index(name)
        if layer_map is not None:
            if idx not in layer_map:
                raise ValueError("%s (model layer %s) is not in bank %r's layer map %s: the bank "
                                 "was imported from another model" % (name, idx, model_name,
                                                                      layer_map))
            layers[name] = layer_map.index(idx)
        else:
            layers[name] = i  # MoE layers in model order
    if len(layers) != int(summary["layers"]):
        raise ValueError("the model has %d MoE layers but bank %r has %d: the bank was "
                         "imported from another model" % (len(layers), model_name,
                                                          summary["layers"]))
    want = (int(summary["experts"]), int(summary["hidden_size"]), int(summary["inter_size"]))
    for name, mod in experts:
        got = _expert_dims(mod)
        if got is not None and got != want:
            raise ValueError("%s has %d experts of hidden size %d and intermediate size %d, "
                             "but bank %r (%s) has %d of %d and %d: the bank was imported "
                             "from another model" % ((name,) + got + (model_name,
                                                                    summary.get("path", "?"))
                                                    + want))
    return layers


class Hook:
    """A model attached to a qmoed session. `session` is its id, `layers`
    maps the model's experts module names to bank layers; stats() sums what
    every session.infer answered; close() releases the map and the session.
    A hook of `attach` also has detach(): the model computes its experts
    itself again."""

    def __init__(self, model, client, model_name, summary, session, layers, previous,
                 owns_experts=True):
        self.model, self.client, self.model_name = model, client, model_name
        self.summary, self.session, self.layers = summary, session, layers
        self._previous = previous
        self._owns_experts = owns_experts
        self._map = None
        self._bytes = None
        self._slots = {}
        self._tagged = []
        self._stats = {"calls": 0, "tokens": 0, "hits": 0, "misses": 0, "bytes_paged": 0,
                       "compute_us": 0, "queue_us": 0, "wall_s": 0.0, "wait_s": 0.0,
                       "ring_calls": 0}
        self.trace = None  # a list of (layer, topk_ids) when recording
        _LIVE.add(self)

    # ---- the shared map ----
    def _ensure_map(self, need):
        if self._map is not None and self._map.size >= need:
            return
        self._slots = {}
        if self._map is not None:
            self._bytes = None
            self.client.unmap(self._map)
            self._map = None
        size = max(1 << 20, 1 << (need - 1).bit_length())
        self._map = self.client.map(self.session, size)
        torch = _torch()
        self._bytes = torch.frombuffer(self._map.mmap, dtype=torch.uint8)

    def _slot(self, key):
        """The map regions and the request text of one call layout (`key`:
        the shapes and dtypes of hidden_states, top_k_index and
        top_k_weights): views of the map shaped like the inputs (x, ids as
        i32, weights; the output like x) and session.infer's params as JSON
        with %d for the layer. Weights given for every expert ([T, E]) are
        gathered to the chosen ones (`gather`)."""
        torch = _torch()
        xshape, xdt, ishape, wshape, wdt = key
        if xdt not in _DTYPES:
            raise TypeError("qmoed takes float32, float16 or bfloat16 hidden states, not %s"
                            % xdt)
        H = xshape[-1]
        T = 1
        for d in xshape[:-1]:
            T *= d
        k = 1
        for d in ishape:
            k *= d
        k //= max(T, 1)
        wn = 1
        for d in wshape:
            wn *= d
        gather = wn != T * k
        if gather or wdt not in _DTYPES:
            wdt = torch.float32
        xw, xsz = _DTYPES[xdt]
        ww, wsz = _DTYPES[wdt]

        def up(n):
            return (n + _ALIGN - 1) // _ALIGN * _ALIGN

        o_ids = up(T * H * xsz)
        o_w = o_ids + up(T * k * 4)
        o_out = o_w + up(T * k * wsz)
        self._ensure_map(o_out + up(T * H * xsz))
        if len(self._slots) >= _MAX_SLOTS:
            self._slots = {}
        b = self._bytes

        def region(off, n, dt, shape):
            return b[off:off + n].view(dt).view(shape)

        m = self._map.id
        params = ('{"session":"%s","layer":%%d,'
                  '"hidden":{"dtype":"%s","shape":[%d,%d],"map":%d,"offset":0},'
                  '"topk_ids":{"dtype":"i32","shape":[%d,%d],"map":%d,"offset":%d},'
                  '"topk_weights":{"dtype":"%s","shape":[%d,%d],"map":%d,"offset":%d},'
                  '"output_to":{"map":%d,"offset":%d}}'
                  % (self.session, xw, T, H, m, T, k, m, o_ids, ww, T, k, m, o_w, m, o_out))
        # The same call as the call ring's request (its layer patched per call).
        ring_req = _ring.request(0, (xw, T, H, m, 0), (m, o_out),
                                 topk_ids=("i32", T, k, m, o_ids), topk_weights=(ww, T, k, m, o_w))
        slot = (region(0, T * H * xsz, xdt, xshape),
                region(o_ids, T * k * 4, torch.int32, (T, k) if gather else ishape),
                region(o_w, T * k * wsz, wdt, (T, k) if gather else wshape),
                region(o_out, T * H * xsz, xdt, xshape), params.encode("ascii"),
                (T, k) if gather else None, T, ring_req)
        self._slots[key] = slot
        return slot

    def _forward(self, bank_layer, hidden_states, top_k_index, top_k_weights):
        t0 = time.perf_counter()
        key = (hidden_states.shape, hidden_states.dtype, top_k_index.shape,
               top_k_weights.shape, top_k_weights.dtype)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slot(key)
        xv, iv, wv, ov, params, gather, T, ring_req = slot
        torch = _torch()
        x, ids, w = hidden_states, top_k_index, top_k_weights
        if torch.is_grad_enabled():
            x, ids, w = x.detach(), ids.detach(), w.detach()
        if gather is not None:  # full [T, E] scores: the chosen ones
            ids = ids.reshape(gather)
            w = torch.gather(w.reshape(T, -1), 1, ids.long())
        xv.copy_(x)
        iv.copy_(ids)
        wv.copy_(w)
        t1 = time.perf_counter()
        gen = self.client.restores
        try:
            counts = self._call(ring_req, params, bank_layer)
        except QmoeError as e:
            # The daemon went away: the client brings the session and its
            # map back (the map's id changes: the call's text and ring
            # request are written again), and the call is retried once; the
            # inputs are still in the map, the same memfd.
            e._qmoe_generation = gen
            if not self.client.restore(self.session, e):
                raise
            self._slots = {}
            slot = self._slot(key)
            counts = self._call(slot[7], slot[4], bank_layer)
        self.client.note_call(self.session)
        hits, misses, paged, queue_us, compute_us = counts
        t2 = time.perf_counter()
        out = ov.clone() if x.device.type == "cpu" else ov.to(x.device)
        s = self._stats
        s["calls"] += 1
        s["tokens"] += T
        s["hits"] += hits
        s["misses"] += misses
        s["bytes_paged"] += paged
        s["compute_us"] += compute_us
        s["queue_us"] += queue_us
        if self.trace is not None:
            self.trace.append((bank_layer, ids.reshape(T, -1).to(torch.int32).cpu().numpy()
                               .copy()))
        s["wait_s"] += t2 - t1
        s["wall_s"] += time.perf_counter() - t0
        return out

    def _call(self, ring_req, params, bank_layer):
        """One layer call: the session's call ring when it has one (the
        client opens it on the first call), else the socket."""
        counts = self.client.ring_counts(self.session, ring_req, bank_layer)
        if counts is None:
            counts = self.client.infer_counts(params % bank_layer)
        else:
            self._stats["ring_calls"] += 1
        return counts

    def stats(self):
        """Sums over this hook's calls: calls, tokens (token-layers), hits,
        misses, bytes_paged, compute_us, queue_us (the daemon's answers),
        wall_s (time in the hook), wait_s (of which waiting for the
        daemon's answer); hit_rate; ring_calls (of calls, those that went
        through the session's call ring)."""
        s = dict(self._stats)
        looked = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / looked if looked else 1.0
        return s

    def _release(self):
        """Untags the experts modules, unmaps and closes the session. An
        experts module without weights gets a forward pre-hook that refuses
        to run (installed now, so that a layer call of an open session does
        not pay for it)."""
        for mod in self._tagged:
            if getattr(mod, "_qmoe_layer", None) is not None:
                mod._qmoe_layer = None
            if getattr(mod, "_qmoe_name", None) is not None and \
                    getattr(mod, "_qmoe_refusal", None) is None:
                mod._qmoe_refusal = mod.register_forward_pre_hook(_refuse_unloaded)
        self._tagged = []
        self._slots = {}
        _LIVE.discard(self)
        try:
            if self._map is not None:
                self._bytes = None
                self.client.unmap(self._map)
        finally:
            self._map = None
            if self.session is not None:
                session, self.session = self.session, None
                self.client.close_session(session)

    def close(self):
        """Releases the map and closes the session. A model of
        from_pretrained has no experts of its own: calling it afterwards
        raises an error naming its first experts module. A model given to
        attach() gets its own experts back (detach())."""
        if self._owns_experts:
            self.detach()
        else:
            self._release()

    def detach(self, close_session=True):
        """attach() only: the model computes its experts itself again; the
        map and (unless told otherwise) the session are released."""
        if not self._owns_experts:
            raise RuntimeError("this model was loaded without its experts (from_pretrained); "
                               "it cannot compute them itself: use close()")
        if self._previous is not None:
            self.model.set_experts_implementation(self._previous)
            self._previous = None
        if close_session:
            self._release()
            return
        for mod in self._tagged:
            mod._qmoe_layer = None
        self._tagged = []
        _LIVE.discard(self)
        if self._map is not None:
            self._bytes = None
            self._slots = {}
            m, self._map = self._map, None
            self.client.unmap(m)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_pending(budget, client_pending_bytes):
    """client_pending_bytes goes with budget "auto" only: refused before
    anything is read or created."""
    if client_pending_bytes is not None and _wire_budget(budget) != "auto":
        raise ValueError("client_pending_bytes needs budget=\"auto\" (it is what the auto "
                         "budget leaves free), got budget=%r" % (budget,))


def _create_session(client, summary, model_name, policy, budget, precision, policy_params,
                    client_pending_bytes):
    r = client.create_session(model_name, policy=policy, budget=_wire_budget(budget),
                              policy_params=policy_params or None, precision=precision,
                              client_pending_bytes=client_pending_bytes)
    return r["session"]


def _anticipate(client):
    """The daemon may spin for this engine's layer calls (session.ring's
    `anticipate`) when torch's threads leave a CPU of this process idle
    between them: then its waking ahead of each call costs the engine
    nothing, and saves two wake-ups a call. The caller's own choice
    (client.ring_anticipate True or False) stands."""
    if getattr(client, "ring_anticipate", False) is not None:
        return
    import torch
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    client.ring_anticipate = torch.get_num_threads() < cpus


def _attach(model, client, model_name, summary, layers, experts, session_args, owns_experts):
    _anticipate(client)
    session = _create_session(client, summary, model_name, *session_args)
    previous = model.get_experts_implementation() if owns_experts else None
    hook = Hook(model, client, model_name, summary, session, layers, previous, owns_experts)
    try:
        for name, mod in experts:
            mod._qmoe_layer = (hook, layers[name])
            hook._tagged.append(mod)
        model.set_experts_implementation(_IMPL)
    except BaseException:
        hook._release()
        raise
    return hook


def attach(model, client, model_name, policy=None, budget=None, precision=None,
           policy_params=None, client_pending_bytes=None):
    """Runs `model`'s routed experts in qmoed's model `model_name` (a bank
    imported from the same checkpoint, loaded with model.load): creates a
    session (policy; budget as bytes, a fraction or "NN%" of the bank's
    expert bytes, or "auto": what this machine and qmoed's memory cgroup can
    give, shrunk under memory pressure, with client_pending_bytes: memory this
    process takes after the session is made, such as the KV cache of the
    longest generation it will run, left free beside the daemon's reserve;
    precision "exact"/"fast"), tags each MoE layer's experts
    with its bank layer (the bank's qmoe.layer_map) and switches the model to
    the "qmoed" experts implementation. The model keeps its own experts too
    (held twice: from_pretrained holds them once). Returns a Hook;
    hook.detach() restores the model."""
    _check_pending(budget, client_pending_bytes)
    register()
    summary = _bank_summary(client, model_name)
    experts = _experts_modules(model)
    layers = _bank_layers(summary, experts, model_name)
    return _attach(model, client, model_name, summary, layers, experts,
                   (policy, budget, precision, policy_params, client_pending_bytes), True)


# ---- loading a checkpoint without its experts ----

def _hidden_experts(experts):
    """A context in which the experts modules have no parameters (sizes
    worked out for a device_map leave the experts out)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        saved = [(mod, dict(mod._parameters)) for _, mod in experts]
        try:
            for mod, params in saved:
                for n in params:
                    mod._parameters[n] = None
            yield
        finally:
            for mod, params in saved:
                mod._parameters.update(params)
    return ctx()


def _loader_patches(check):
    """Wrappers of transformers' convert_and_load_state_dict_in_model and
    _get_device_map (modeling_utils' names for them): checkpoint keys that
    land in an experts module are dropped before anything is read, and the
    experts' parameters are neither reported missing nor allocated nor
    initialised. `check(model, experts)` runs first, on the model still on
    the meta device."""
    import transformers.modeling_utils as mu
    from transformers import core_model_loading as cml

    inner_load, inner_map = mu.convert_and_load_state_dict_in_model, mu._get_device_map
    seen = {"experts": None, "skipped": []}

    def experts_of(model):
        if seen["experts"] is None:
            seen["experts"] = _experts_modules(model)
            check(model, seen["experts"])
        return seen["experts"]

    def get_device_map(model, device_map, *args, **kwargs):
        if not isinstance(device_map, str):
            return inner_map(model, device_map, *args, **kwargs)
        with _hidden_experts(experts_of(model)):
            return inner_map(model, device_map, *args, **kwargs)

    def load(model, state_dict, load_config, *args, **kwargs):
        experts = experts_of(model)
        prefixes = tuple(name + "." for name, _ in experts)
        meta = model.state_dict()
        wm = load_config.weight_mapping or []
        ren = [e for e in wm if isinstance(e, cml.WeightRenaming)]
        conv = [e for e in wm if isinstance(e, cml.WeightConverter)]
        base = model.base_model_prefix
        kept = {}
        for key, value in state_dict.items():
            target, _ = cml.rename_source_key(key, ren, conv, base, meta)
            if target not in meta and key in meta:  # the loader's own fallback
                target, _ = cml.rename_source_key(key, [], [], base, meta)
            if target.startswith(prefixes):
                seen["skipped"].append(key)
            else:
                kept[key] = value
        info, index = inner_load(model, kept, load_config, *args, **kwargs)
        info.missing_keys = {k for k in info.missing_keys if not k.startswith(prefixes)}
        info.unexpected_keys = {k for k in info.unexpected_keys if not k.startswith(prefixes)}
        for _, mod in experts:
            mod._is_hf_initialized = True
            for t in list(mod.parameters()) + list(mod.buffers()):
                t._is_hf_initialized = True
        return info, index

    return mu, {"convert_and_load_state_dict_in_model": (inner_load, load),
                "_get_device_map": (inner_map, get_device_map)}, seen


def _config_without_mxfp4(path, hf_kwargs):
    """GPT-OSS's MXFP4 checkpoints quantize the routed experts only
    (quantization_config.modules_to_not_convert is the rest): without the
    experts there is nothing to dequantize, and transformers' MXFP4 loader
    (which needs accelerate, and a GPU to keep MXFP4) is not needed."""
    if "config" in hf_kwargs:
        return hf_kwargs
    from transformers import AutoConfig

    cfg_kwargs = {k: hf_kwargs[k] for k in ("trust_remote_code", "revision", "cache_dir",
                                            "local_files_only", "token") if k in hf_kwargs}
    cfg = AutoConfig.from_pretrained(path, **cfg_kwargs)
    q = getattr(cfg, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    if str(getattr(method, "value", method)) != "mxfp4" or cfg.model_type != "gpt_oss":
        return hf_kwargs
    del cfg.quantization_config
    return dict(hf_kwargs, config=cfg)


def from_pretrained(path, client, model, *, policy=None, budget=None, precision=None,
                    policy_params=None, client_pending_bytes=None, **hf_kwargs):
    """A transformers model of the checkpoint at `path` whose routed experts
    run in qmoed's model `model` (a bank imported from this checkpoint and
    loaded in the daemon): they are never read from the checkpoint nor
    allocated (their parameters stay on the meta device); every other
    weight, buffer and setting is what AutoModelForCausalLM.from_pretrained
    (path, **hf_kwargs) gives (dtype, device_map, ...). The model is
    attached to a new session (policy, budget, precision, policy_params,
    client_pending_bytes as attach takes them: the session is made after
    the non-expert weights are read, so an auto budget already counts them);
    `model.qmoe_hook` is its Hook (stats(), close()).

    Before anything is read: a daemon that cannot be reached raises
    qmoe_client.QmoeError; a model the daemon has not loaded, or a bank
    whose layers, expert count, hidden or intermediate size differ from the
    checkpoint's, raise ValueError."""
    import transformers

    _check_pending(budget, client_pending_bytes)
    _torch()
    register()
    summary = _bank_summary(client, model)
    found = {}

    def check(m, experts):
        found["layers"] = _bank_layers(summary, experts, model)

    hf_kwargs = _config_without_mxfp4(path, hf_kwargs)
    hf_kwargs.pop("experts_implementation", None)
    with _LOAD_LOCK:
        mu, patches, seen = _loader_patches(check)
        for name, (_, wrapper) in patches.items():
            setattr(mu, name, wrapper)
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(path, **hf_kwargs)
        finally:
            for name, (inner, _) in patches.items():
                setattr(mu, name, inner)
    experts = seen["experts"]
    if experts is None or "layers" not in found:
        raise RuntimeError("transformers loaded %s without going through its "
                           "convert_and_load_state_dict_in_model (a distributed or GGUF "
                           "load?): from_pretrained cannot keep the experts out" % path)
    prefixes = tuple(n + "." for n, _ in experts)
    for name, t in list(m.named_parameters()) + list(m.named_buffers()):
        on_meta = t.device.type == "meta"
        if on_meta != name.startswith(prefixes):
            raise RuntimeError("%s is %s after loading %s" % (
                name, "still on the meta device" if on_meta else "materialised", path))
    for name, mod in experts:
        mod._qmoe_name = name
    hook = _attach(m, client, model, summary, found["layers"], experts,
                   (policy, budget, precision, policy_params, client_pending_bytes), False)
    m.qmoe_hook = hook
    return m


def _close_live_hooks():
    for hook in list(_LIVE):
        try:
            hook._release()
        except Exception:  # the daemon may be gone already
            pass


atexit.register(_close_live_hooks)
