"""The connection, the typed methods and the tensor codec."""

import atexit
import base64
import errno
import fcntl
import json
import logging
import numbers
import mmap as _mmap
import os
import re
import socket
import struct
import sys
import threading
import time

from . import _ring

try:  # numpy is optional: without it tensors come back as Tensor objects
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numpy
    _np = None

ERROR_NAMES = {
    -32700: "parse_error",
    -32600: "invalid_request",
    -32601: "method_not_found",
    -32602: "invalid_params",
    -32603: "internal_error",
    -32001: "not_found",
    -32002: "permission_denied",
    -32003: "resource_exhausted",
    -32004: "overloaded",
    -32005: "invalid_model",
    -32006: "payload_too_large",
    -32007: "shutting_down",
    -32008: "conflict",
    -32009: "in_use",
}

# Client-side failures use the same small negative codes as libqmoe-client.
E_NOT_RUNNING = -3
E_ACCESS = -4
E_TIMEOUT = -5
E_IO = -6
E_PROTO = -7

_DTYPE_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
# numpy dtypes of a mapped tensor's view (bf16 has none: its bits as uint16).
_NP_DTYPE = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i32": "<i4"}
MAP_ALIGN = 64
_MAX_RESPONSE = 1 << 31
_RECV = 1 << 16

# session.infer's answer when the output went to a map, in the one layout
# qmoed writes it (docs/PROTOCOL.md): the id and the five counters a layer
# hook adds up, read without a JSON parse (a third of a layer call's client
# time at T = 1). Any other answer goes through the JSON parser.
_INFER_COUNTS = re.compile(
    rb'\{"jsonrpc":"2\.0","id":(\d+),"result":\{"output":\{[^{}]*\},'
    rb'"stats":\{"hits":(\d+),"misses":(\d+),"host_runs":\d+,"bytes_paged":(\d+),'
    rb'"bytes_read_disk":\d+,"stall_us":\d+,"queue_us":(\d+),"compute_us":(\d+)[^{}]*\}\}\}')
_COUNT_NAMES = ("hits", "misses", "bytes_paged", "queue_us", "compute_us")

# Across a daemon restart (docs/ENGINES.md): how long a layer call that finds
# the daemon gone keeps trying, and how often a paged session's residency
# is read to start its re-creation warm.
DEFAULT_RECONNECT_S = 30.0
DEFAULT_WARM_INTERVAL_S = 1.0
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.02, 0.5
_CONFLICT, _NOT_FOUND, _EXHAUSTED, _SHUTTING_DOWN = -32008, -32001, -32003, -32007


def _session_missing(e):
    """The daemon has no such session (-32001 naming `session`)."""
    return e.code == _NOT_FOUND and e.field == "session"


_log = logging.getLogger("qmoe_client")


def _env_seconds(name, default):
    try:
        return float(os.environ.get(name, ""))
    except ValueError:
        return default


def _gone(e):
    """Whether a QmoeError says the daemon went away (the connection reset
    or closed mid-call, or nothing listens): worth a restoration."""
    return isinstance(e, QmoeError) and e.code in (E_IO, E_NOT_RUNNING)


# Sessions this process created and has not closed: {socket path: {session: pid}}.
# Closed at interpreter exit (atexit) by the process that created them.
_OWNED = {}
_OWNED_LOCK = threading.Lock()


def _own(path, session):
    with _OWNED_LOCK:
        _OWNED.setdefault(path, {})[session] = os.getpid()


def _disown(path, session):
    with _OWNED_LOCK:
        owned = _OWNED.get(path)
        if owned is not None:
            owned.pop(session, None)


def _close_owned_sessions(timeout=2.0):
    """session.close for every session this process created and left open,
    over a connection of its own per daemon; a daemon that is gone is
    skipped. Runs at interpreter exit."""
    pid = os.getpid()
    with _OWNED_LOCK:
        todo = {path: [s for s, p in owned.items() if p == pid] for path, owned in _OWNED.items()}
        _OWNED.clear()
    for path, sessions in todo.items():
        if not sessions:
            continue
        try:
            c = Client(path, timeout=timeout, close_sessions_at_exit=False)
        except QmoeError:
            continue
        try:
            for s in sessions:
                try:
                    c.call("session.close", {"session": s})
                except QmoeError as e:
                    if e.code in (E_IO, E_TIMEOUT, E_NOT_RUNNING):
                        break
        finally:
            c.close()


atexit.register(_close_owned_sessions)


class QmoeError(Exception):
    """A request that failed: `code` (JSON-RPC or client-side), `name`
    ("not_found", "invalid_params", ...), `reason` (one sentence) and `field`
    (the params path the daemon blamed, or None)."""

    def __init__(self, code, name, reason, field=None):
        super().__init__(reason if not field else "%s [%s]" % (reason, field))
        self.code = code
        self.name = name
        self.reason = reason
        self.field = field


class DaemonNotRunning(QmoeError):
    """Nothing listens on the socket path."""


def _nbytes(dtype, shape):
    """(shape as a tuple, its byte length in dtype); ValueError when bad."""
    if dtype not in _DTYPE_SIZE:
        raise ValueError("dtype must be f32, f16, bf16 or i32, not %r" % (dtype,))
    shape = tuple(int(d) for d in shape)
    n = _DTYPE_SIZE[dtype]
    for d in shape:
        if d < 0:
            raise ValueError("negative dimension in shape %r" % (shape,))
        n *= d
    return shape, n


class Tensor:
    """A tensor as the wire carries it: dtype ("f32", "f16", "bf16", or "i32"
    for topk_ids), shape and little-endian row-major bytes."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        shape, n = _nbytes(dtype, shape)
        data = bytes(data)
        if len(data) != n:
            raise ValueError("shape %r of %s needs %d bytes, got %d" % (shape, dtype, n, len(data)))
        self.dtype, self.shape, self.data = dtype, shape, data

    def to_numpy(self):
        """A numpy array (bf16 widens to float32, exactly)."""
        if _np is None:
            raise RuntimeError("numpy is not installed")
        if self.dtype == "bf16":
            u = _np.frombuffer(self.data, dtype="<u2").astype(_np.uint32) << 16
            return u.view(_np.float32).reshape(self.shape)
        dt = {"f32": "<f4", "f16": "<f2", "i32": "<i4"}[self.dtype]
        return _np.frombuffer(self.data, dtype=dt).reshape(self.shape).copy()

    def __repr__(self):
        return "Tensor(%s, %r, %d bytes)" % (self.dtype, self.shape, len(self.data))


def encode_tensor(x, dtype=None):
    """A numpy array (float32/float16, int32 for topk_ids), Tensor or
    MappedTensor as the protocol's tensor object (a MappedTensor names its
    map region)."""
    if isinstance(x, MappedTensor):
        if dtype is not None and dtype != x.dtype:
            raise ValueError("tensor is %s, %s was asked for" % (x.dtype, dtype))
        return x.wire()
    if isinstance(x, Tensor):
        t = x
    elif _np is not None and isinstance(x, _np.ndarray):
        if x.dtype == _np.float32:
            dt = "f32"
        elif x.dtype == _np.float16:
            dt = "f16"
        elif x.dtype == _np.int32:
            dt = "i32"
        else:
            raise ValueError("tensors must be float32, float16 or int32 arrays, not %s" % x.dtype)
        arr = _np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<"))
        t = Tensor(dt, arr.shape, arr.tobytes())
    else:
        raise TypeError("a tensor is a numpy array or a qmoe_client.Tensor")
    if dtype is not None and dtype != t.dtype:
        raise ValueError("tensor is %s, %s was asked for" % (t.dtype, dtype))
    return {"dtype": t.dtype, "shape": list(t.shape), "data": base64.b64encode(t.data).decode("ascii")}


class SharedMap:
    """A shared-memory map of a session (PROTOCOL.md "Shared-memory
    tensors"): a memfd this process created, sealed against shrinking and
    further seals, mapped here and handed to qmoed by session.map. Tensors
    placed in it travel without a copy: `tensor()` / `alloc()` return
    MappedTensor views, and session.infer's `output_to` makes qmoed write the
    output into it. Create with Client.map(); release with Client.unmap() (or
    close the session)."""

    def __init__(self, nbytes):
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError("a map needs at least one byte")
        page = _mmap.PAGESIZE
        self.size = nbytes
        self.id = None
        self.session = None
        self._next = 0
        fd = os.memfd_create("qmoe-map", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, (nbytes + page - 1) // page * page)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.mmap = _mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def _close_fd(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def keep_fd(self):
        """Whether the memfd is kept open (to pass it again after a restart)."""
        return self.fd is not None

    def close(self):
        """Drops this process's mapping (the daemon keeps its own until unmap)."""
        self._close_fd()
        if self.mmap is not None:
            try:
                self.mmap.close()
            except BufferError:
                pass  # numpy views are still alive: the mapping goes with them
            self.mmap = None

    def tensor(self, offset, shape, dtype):
        """The region at `offset` (a multiple of 64) as a MappedTensor."""
        return MappedTensor(self, offset, shape, dtype)

    def alloc(self, shape, dtype):
        """The next free 64-aligned region of `shape` and `dtype` (a bump
        allocator; reset() starts over)."""
        t = MappedTensor(self, self._next, shape, dtype)
        self._next = (t.offset + t.nbytes + MAP_ALIGN - 1) // MAP_ALIGN * MAP_ALIGN
        return t

    def reset(self):
        self._next = 0

    def __repr__(self):
        return "SharedMap(id=%r, %d bytes)" % (self.id, self.size)


class MappedTensor:
    """A tensor in a SharedMap: `map`, `offset`, `shape`, `dtype`. `array`
    is a numpy view on the shared memory (bf16 as its uint16 bits); writing
    into it writes what qmoed reads."""

    __slots__ = ("map", "offset", "shape", "dtype", "nbytes")

    def __init__(self, shm, offset, shape, dtype):
        offset = int(offset)
        if offset < 0 or offset % MAP_ALIGN:
            raise ValueError("offset %d is not a multiple of %d" % (offset, MAP_ALIGN))
        shape, n = _nbytes(dtype, shape)
        if offset + n > shm.size:
            raise ValueError("region [%d, %d) lies outside the %d-byte map" % (offset, offset + n, shm.size))
        self.map, self.offset, self.shape, self.dtype, self.nbytes = shm, offset, shape, dtype, n

    @property
    def array(self):
        if _np is None:
            raise RuntimeError("numpy is not installed")
        count = self.nbytes // _DTYPE_SIZE[self.dtype]
        return _np.frombuffer(self.map.mmap, dtype=_NP_DTYPE[self.dtype], count=count,
                              offset=self.offset).reshape(self.shape)

    @property
    def memoryview(self):
        return memoryview(self.map.mmap)[self.offset:self.offset + self.nbytes]

    def wire(self):
        if self.map.id is None:
            raise ValueError("the map was never passed to session.map (or was unmapped)")
        return {"dtype": self.dtype, "shape": list(self.shape), "map": self.map.id,
                "offset": self.offset}

    def __repr__(self):
        return "MappedTensor(map=%r, offset=%d, %s %r)" % (self.map.id, self.offset, self.dtype, self.shape)


def decode_tensor(obj, as_numpy=True):
    """The protocol's tensor object as a numpy array (when numpy is there and
    `as_numpy`) or a Tensor. Shape and byte length must agree."""
    if not isinstance(obj, dict):
        raise QmoeError(E_PROTO, "bad_response", "tensor is not an object")
    try:
        data = base64.b64decode(obj["data"], validate=True)
        t = Tensor(obj["dtype"], obj["shape"], data)
    except (KeyError, TypeError, ValueError) as e:
        raise QmoeError(E_PROTO, "bad_response", "unreadable tensor: %s" % e)
    if as_numpy and _np is not None and t.dtype != "bf16":
        return t.to_numpy()
    return t


def default_socket_path(explicit=None):
    """The socket path, resolved as qmoed and qmoectl do."""
    if explicit:
        return explicit
    env = os.environ
    if env.get("QMOED_SOCKET"):
        return env["QMOED_SOCKET"]
    if env.get("RUNTIME_DIRECTORY"):
        return os.path.join(env["RUNTIME_DIRECTORY"], "qmoed.sock")
    if os.geteuid() == 0:
        return "/run/qmoed/qmoed.sock"
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.exists(os.path.join(xdg, "qmoed.sock")):
        return os.path.join(xdg, "qmoed.sock")
    return "/run/qmoed/qmoed.sock"


class InferResult:
    """session.infer's answer: `output` (numpy array or Tensor), `routing`
    (list per token of (expert, weight) pairs, or None) and `stats` (dict)."""

    __slots__ = ("output", "routing", "stats")

    def __init__(self, output, routing, stats):
        self.output, self.routing, self.stats = output, routing, stats


class _Kept:
    """What re-creating a session after a restart needs: its session.create
    params as sent, whether some bank is paged (its residency is then worth
    reading), the last residency read, and its maps (memfds kept open)."""

    __slots__ = ("params", "paged", "warm", "warm_at", "maps", "alive_on", "made_on")

    def __init__(self, params, paged, alive_on):
        self.params = dict(params or {})
        self.paged = paged
        self.alive_on = alive_on  # the connection of its last answer (create or layer call)
        self.made_on = alive_on  # the connection it was last made (or found still there) on
        self.warm = None
        self.warm_at = None
        self.maps = []


def _ring_request(layer, hidden, router_logits, topk_ids, topk_weights, output_to):
    """The ring's request for infer()'s arguments, or None when one is not a
    2-D MappedTensor of output_to's map (those go through the socket)."""
    m = output_to.map.id
    parts = []
    for t in (hidden, router_logits, topk_ids, topk_weights):
        if t is None:
            parts.append(None)
            continue
        if not isinstance(t, MappedTensor) or t.map.id != m or len(t.shape) != 2:
            return None
        parts.append((t.dtype, t.shape[0], t.shape[1], m, t.offset))
    if len(output_to.shape) != 2:
        return None
    return _ring.request(layer, parts[0], (m, output_to.offset), *parts[1:])


def _budget_member(budget):
    """A budget as the wire takes it: bytes (a whole number) as budget_bytes,
    which every daemon reads; "auto" or "N%" as text in `budget`, which the
    daemon checks and sizes ({} for None)."""
    if budget is None:
        return {}
    if isinstance(budget, str):
        return {"budget": budget.strip()}
    if isinstance(budget, numbers.Real) and not isinstance(budget, bool) and \
            float(budget).is_integer():
        return {"budget_bytes": int(budget)}
    raise TypeError('a budget is bytes (a whole number), "N%%" or "auto", not %r' % (budget,))


def _excerpt(raw, e):
    """Where a response line stopped being JSON: its length and the bytes
    around the error's position, for the report (a daemon's defect or a
    stream out of step)."""
    pos = getattr(e, "pos", None)
    if not isinstance(pos, int):
        return " (%d bytes)" % len(raw)
    return " (%d bytes; at %d: %r)" % (len(raw), pos, bytes(raw[max(0, pos - 48):pos + 48]))


class Client:
    """One connection to qmoed. Calls are synchronous and bounded by
    `timeout` seconds; a Client may be shared between threads (calls are
    serialised by a lock). After a timeout or broken connection the next call
    reconnects. Sessions created through it are closed when the interpreter
    exits if they are still open (unless close_sessions_at_exit=False);
    close() only drops the connection.

    Across a daemon restart: a layer call (infer, or an engine's call that
    goes through restore()) that finds the daemon gone brings its session
    back and is retried once: `reconnect` seconds at most (default
    $QMOED_RECONNECT_S or 30; 0 turns it off), the model loaded again from
    the bank load_model or set_model_bank named, the session re-created
    under its id with its options, warm from the residency read every
    `warm_interval` seconds (default $QMOED_WARM_INTERVAL_S or 1), its maps
    passed again. Each step is logged on the "qmoe_client" logger."""

    def __init__(self, socket_path=None, timeout=30.0, as_numpy=True,
                 close_sessions_at_exit=True, reconnect=None, warm_interval=None):
        self.path = default_socket_path(socket_path)
        self.timeout = float(timeout)
        self.as_numpy = as_numpy
        self.close_sessions_at_exit = close_sessions_at_exit
        # Across a daemon restart: seconds a layer call keeps trying (0: off;
        # $QMOED_RECONNECT_S), seconds between residency reads of a paged
        # session (0: every call, < 0: never; $QMOED_WARM_INTERVAL_S).
        self.reconnect = max(0.0, float(reconnect if reconnect is not None else
                                        _env_seconds("QMOED_RECONNECT_S",
                                                     DEFAULT_RECONNECT_S)))
        self.warm_interval = float(warm_interval if warm_interval is not None else
                                   _env_seconds("QMOED_WARM_INTERVAL_S",
                                                DEFAULT_WARM_INTERVAL_S))
        self.restores = 0  # sessions brought back (a generation count)
        self._kept = {}    # session -> _Kept: what re-creating it needs
        self._banks = {}   # model -> bank file to model.load again
        self._resume_lock = threading.Lock()
        self._lock = threading.Lock()
        # Per thread: the connection (_conn_gen) whose daemon gave this
        # thread's last answer, over the socket or a ring (note_call).
        self._answered = threading.local()
        self._sock = None
        self._buf = bytearray()
        self._rbuf = bytearray(_RECV)
        self._next_id = 1
        self._method_json = {}  # method name -> its JSON text
        self._conn_gen = 0  # connections made: a ring lives with the one it was opened on
        self._rings = {}  # session -> _ring.Ring, or False (refused on this connection)
        env = os.environ.get("QMOE_RING", "")
        # "auto": infer() with mapped tensors and ring_counts() open the
        # session's ring themselves; "explicit": only rings opened by
        # ring(); "off": the socket always.
        self.ring_mode = "off" if env in ("0", "off") else "auto"
        # True: rings this handle opens from now on ask the daemon to
        # anticipate each call from the ring's tempo (session.ring's
        # `anticipate`: it wakes ahead and spins for the call, which costs
        # it CPU while it waits): for an engine that leaves a CPU idle
        # between its calls. None (the default): no, unless the
        # transformers hook sets it (it does when torch's threads leave a
        # CPU of this process's idle).
        self.ring_anticipate = None
        self._connect(time.monotonic() + self.timeout)

    # ---- connection ----
    def _connect(self, deadline):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            s.connect(self.path)
        except FileNotFoundError:
            s.close()
            raise DaemonNotRunning(E_NOT_RUNNING, "not_running",
                                   "qmoed is not running (no socket at %s); start it with "
                                   "`systemctl start qmoed` or `qmoed`" % self.path)
        except ConnectionRefusedError:
            s.close()
            raise DaemonNotRunning(E_NOT_RUNNING, "not_running",
                                   "qmoed is not running (nothing listens on %s); start it with "
                                   "`systemctl start qmoed` or `qmoed`" % self.path)
        except PermissionError:
            s.close()
            raise QmoeError(E_ACCESS, "access_denied",
                            "permission denied opening %s; ask an admin to add you to the "
                            "socket's group (qmoe)" % self.path)
        except socket.timeout:
            s.close()
            raise QmoeError(E_TIMEOUT, "timeout", "qmoed did not accept in time")
        except OSError as e:
            s.close()
            raise QmoeError(E_IO, "connection_lost", "cannot connect to %s: %s" % (self.path, e))
        # Connected: a blocking socket whose reads and writes the kernel times
        # out (SO_RCVTIMEO/SO_SNDTIMEO, `timeout`), one syscall each way per
        # call instead of poll + call + two mode changes; _read_line keeps the
        # call's deadline.
        s.settimeout(None)
        self._sock = s
        self._conn_gen += 1
        self._apply_timeout()
        self._buf = bytearray()

    def _apply_timeout(self):
        if self._sock is None:
            return
        t = max(0.001, self.timeout)
        tv = struct.pack("ll", int(t), int((t - int(t)) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def _drop(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._buf = bytearray()

    def close(self):
        with self._lock:
            self._drop()
            for session in list(self._rings):
                self._ring_forget(session)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read_line(self, deadline):
        """The next line. A read waits at most `timeout` (the kernel's
        SO_RCVTIMEO), and none starts after `deadline`: a call is bounded by
        about twice its timeout when an answer trickles in."""
        buf, rbuf = self._buf, self._rbuf
        while True:
            i = buf.find(b"\n")
            if i >= 0:
                line = bytes(buf[:i])
                del buf[: i + 1]
                return line
            if len(buf) > _MAX_RESPONSE:
                raise QmoeError(E_PROTO, "bad_response", "a response exceeds %d bytes" % _MAX_RESPONSE)
            if time.monotonic() >= deadline:
                raise socket.timeout()
            try:
                n = self._sock.recv_into(rbuf)
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise socket.timeout()
            if not n:
                raise QmoeError(E_IO, "connection_lost", "qmoed closed the connection before answering")
            if not buf and rbuf[n - 1] == 10 and rbuf.find(b"\n", 0, n - 1) < 0:
                return bytes(rbuf[:n - 1])  # exactly one whole line: the usual answer
            buf += memoryview(rbuf)[:n]

    def call(self, method, params=None, fd=None):
        """Any method: `params` a dict (or None). Returns the result, raises
        QmoeError. `fd`: one descriptor sent as SCM_RIGHTS with the line's
        first byte (session.map)."""
        body = b""
        if params is not None:
            body = b',"params":' + json.dumps(params, separators=(",", ":"),
                                              ensure_ascii=False).encode("utf-8")
        try:
            r = self._call(method, body, fd)
        except QmoeError as e:
            if method == "session.close" and e.name == "not_found":
                _disown(self.path, (params or {}).get("session"))
            raise
        if method == "session.create" and isinstance(r, dict) and "session" in r:
            if self.close_sessions_at_exit:
                _own(self.path, r["session"])
            if "session" not in (params or {}):  # not a restoration's own call
                per_expert = (r.get("plan_summary") or {}).get("per_expert", 0)
                self._kept[r["session"]] = _Kept(params, per_expert > 0, self._conn_gen)
        elif method == "session.close":
            _disown(self.path, (params or {}).get("session"))
            self._forget((params or {}).get("session"))
        elif method == "model.load":
            self._banks[params["name"]] = params["path"]
        elif method == "session.resize" and (params or {}).get("session") in self._kept:
            # A re-creation takes the budget in force, not the first one (as
            # given: "auto" sizes it again on the restarted daemon).
            kept = self._kept[params["session"]].params
            kept.pop("budget", None)
            kept.pop("budget_bytes", None)
            kept.update({k: params[k] for k in ("budget", "budget_bytes") if k in params})
        return r

    def call_json(self, method, params_json):
        """call() with `params` already JSON text (bytes): an engine's layer
        calls, whose text differs only by a number, are formatted, not
        encoded. Not for session.create/session.close (whose sessions
        call() keeps track of)."""
        return self._call(method, b',"params":' + params_json, None)

    def infer_counts(self, params_json):
        """session.infer with `params` already JSON text (bytes) whose
        output goes to a map (`output_to`): a layer hook's call. Returns
        (hits, misses, bytes_paged, queue_us, compute_us), the answer's
        stats; raises QmoeError as call() does."""
        r = self._call("session.infer", b',"params":' + params_json, None, _INFER_COUNTS)
        if isinstance(r, tuple):
            return r
        st = r.get("stats") if isinstance(r, dict) else None
        st = st if isinstance(st, dict) else {}
        return tuple(int(st.get(n, 0)) for n in _COUNT_NAMES)

    def _call(self, method, body, fd, counts=None):
        """The call; with `counts` (a compiled pattern whose first group is
        the id), an answer it matches whole is returned as the tuple of its
        other groups, as ints, without a JSON parse."""
        with self._lock:
            deadline = time.monotonic() + self.timeout
            if self._sock is None:
                self._connect(deadline)
            rid = self._next_id
            self._next_id += 1
            name = self._method_json.get(method)
            if name is None:
                name = json.dumps(method, ensure_ascii=False).encode("utf-8")
                if len(self._method_json) < 64:
                    self._method_json[method] = name
            line = b'{"jsonrpc":"2.0","id":%d,"method":%s%s}\n' % (rid, name, body)
            try:
                if fd is not None:
                    sent = socket.send_fds(self._sock, [line], [fd])
                    line = line[sent:]
                self._sock.sendall(line)
                while True:
                    raw = self._read_line(deadline)
                    if counts is not None:
                        m = counts.fullmatch(raw)
                        if m is not None and int(m.group(1)) == rid:
                            self._answered.gen = self._conn_gen
                            return tuple(map(int, m.groups()[1:]))
                    if not raw.strip():
                        continue
                    try:
                        msg = json.loads(raw)
                    except ValueError as e:
                        raise QmoeError(E_PROTO, "bad_response",
                                        "unreadable response from qmoed: %s%s" % (e, _excerpt(raw, e)))
                    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
                        raise QmoeError(E_PROTO, "bad_response", "response is not JSON-RPC 2.0")
                    got = msg.get("id")
                    if got is not None and got != rid:
                        continue  # the answer to a request that timed out earlier
                    self._answered.gen = self._conn_gen
                    if "error" in msg:
                        err = msg["error"] or {}
                        code = err.get("code", -32603)
                        data = err.get("data") if isinstance(err.get("data"), dict) else {}
                        if code == -32006 or got is None:
                            self._drop()  # the daemon closes the stream after these
                        raise QmoeError(code, ERROR_NAMES.get(code, "error"),
                                        data.get("reason") or err.get("message", "error"),
                                        data.get("field"))
                    if "result" not in msg:
                        raise QmoeError(E_PROTO, "bad_response", "response has neither result nor error")
                    return msg["result"]
            except (socket.timeout, BlockingIOError):  # BlockingIOError: SO_SNDTIMEO ran out
                self._drop()
                raise QmoeError(E_TIMEOUT, "timeout", "qmoed did not answer %s in time" % method)
            except QmoeError as e:
                if e.code in (E_IO, E_PROTO):
                    self._drop()
                raise
            except OSError as e:
                self._drop()
                if e.errno in (errno.EPIPE, errno.ECONNRESET):
                    raise QmoeError(E_IO, "connection_lost", "qmoed closed the connection")
                raise QmoeError(E_IO, "connection_lost", str(e))

    # ---- typed methods, one per PROTOCOL.md method ----
    def status(self):
        return self.call("daemon.status")

    def models(self):
        return self.call("model.list")["models"]

    def load_model(self, name, path):
        return self.call("model.load", {"name": name, "path": os.fspath(path)})

    def unload_model(self, name, force=False):
        p = {"name": name}
        if force:
            p["force"] = True
        return self.call("model.unload", p)

    def sessions(self):
        return self.call("session.list")["sessions"]

    def create_session(self, model, policy=None, budget_bytes=None, policy_params=None,
                       precision=None, budget=None, client_pending_bytes=None):
        """precision: "exact" (the daemon's default) or "fast" (int8 activations).
        budget: bytes (an int), "N%" of the model's expert bytes, or "auto"
        (the daemon sizes it from the memory this machine and its cgroup give,
        and shrinks it under memory pressure); budget_bytes is the same as
        bytes. The result carries "budget_auto" (what auto came to and why).
        client_pending_bytes (with budget "auto"): memory this process takes
        after the call (a KV cache, buffers), which the auto budget leaves
        free; not sent again when the session is re-created after a restart."""
        p = {"model": model}
        if policy is not None:
            p["policy"] = policy
        p.update(_budget_member(budget_bytes if budget is None else budget))
        if policy_params is not None:
            p["policy_params"] = policy_params
        if precision is not None:
            p["precision"] = precision
        if client_pending_bytes is not None:
            p["client_pending_bytes"] = client_pending_bytes
        return self.call("session.create", p)

    def close_session(self, session):
        try:
            return self.call("session.close", {"session": session})
        finally:
            self._ring_forget(session)

    def plan(self, session):
        return self.call("session.plan", {"session": session})

    def map(self, session, nbytes):
        """session.map: a new SharedMap of `nbytes` for `session`. The
        daemon holds its own mapping; ours is shm.mmap. The memfd stays open
        for a session this client would re-create after a restart (the map
        is then passed again, its id rewritten), or whose map the daemon
        reclaimed while the session lived on (the connection that last used
        it closed long ago: passed again at the next call that names it)."""
        shm = SharedMap(nbytes)
        try:
            r = self.call("session.map", {"session": session, "bytes": shm.size}, fd=shm.fd)
        except BaseException:
            shm.close()
            raise
        shm.id, shm.session = int(r["map"]), session
        kept = self._kept.get(session)
        if kept is not None and self.reconnect > 0:
            kept.maps.append(shm)
        else:
            shm._close_fd()
        return shm

    def unmap(self, shm):
        """session.unmap, then drops this process's mapping too."""
        kept = self._kept.get(shm.session)
        if kept is not None and shm in kept.maps:
            kept.maps.remove(shm)
        try:
            if shm.id is not None:
                self.call("session.unmap", {"session": shm.session, "map": shm.id})
        finally:
            shm.id = None
            shm.close()

    # ---- across a daemon restart (docs/ENGINES.md "Across a daemon restart") ----
    def set_model_bank(self, model, path):
        """The bank file this client may model.load (admin) as `model` when
        a restarted daemon lacks it (load_model records the same); None
        forgets it."""
        if path is None:
            self._banks.pop(model, None)
        else:
            self._banks[model] = os.fspath(path)

    def _forget(self, session):
        kept = self._kept.pop(session, None)
        for shm in kept.maps if kept is not None else ():
            shm._close_fd()

    def note_call(self, session):
        """After a successful layer call on `session`: reads its residency
        (session.plan's resident_now) when `warm_interval` says so, for a
        re-creation to start from."""
        kept = self._kept.get(session)
        if kept is None:
            return
        # The connection that answered this thread's call, not the one there
        # is now: another thread may have reconnected to a new daemon since,
        # which lacks the session until it is restored (taking that one made
        # its "no such session" look final: its calls failed until the next
        # restart).
        answered = getattr(self._answered, "gen", None)
        kept.alive_on = answered if answered is not None else self._conn_gen
        if not kept.paged or self.reconnect <= 0 or self.warm_interval < 0:
            return
        now = time.monotonic()
        if kept.warm_at is not None and now - kept.warm_at < self.warm_interval:
            return
        kept.warm_at = now
        try:
            banks = self.call("session.plan", {"session": session}).get("banks", [])
        except QmoeError:
            return  # the next layer call meets whatever this met
        warm = [{"layer": b["layer"], "experts": b["resident_now"]}
                for b in banks if b.get("resident_now")]
        if warm:
            kept.warm = warm

    def restore(self, session, cause):
        """The one place a layer call that found the daemon gone (`cause`, a
        QmoeError) comes: reconnects with a bounded backoff for up to
        `reconnect` seconds, makes the model available again (model.load of
        a bank known for it, else waits for an operator's load), re-creates
        the session under its id with its options and last known residency,
        and passes its maps again (their ids rewritten). True: retry the call
        once. False: not restorable here, or the window passed (the caller
        raises `cause`)."""
        gen = getattr(cause, "_qmoe_generation", None)
        with self._resume_lock:
            kept = self._kept.get(session)
            if kept is None or self.reconnect <= 0:
                return False
            # Another thread brought this session back meanwhile, on the
            # connection there is now. One that brought back another session
            # did not: this one is restored too (it used to be taken as back,
            # and its retry met "no such session").
            if gen is not None and gen != self.restores and kept.made_on == self._conn_gen:
                return True
            # Gone: a broken or refused connection, or "no such session" on
            # a connection made since the session last answered (another
            # call on this client reconnected to a restarted daemon first).
            # Or going: a draining daemon (systemctl restart, an upgrade)
            # answers shutting_down; the next one takes the session.
            if not (_gone(cause) or (isinstance(cause, QmoeError) and cause.code == _SHUTTING_DOWN)
                    or (isinstance(cause, QmoeError) and cause.code == _NOT_FOUND
                        and cause.field == "session" and kept.alive_on != self._conn_gen)):
                return False
            _log.warning("qmoed at %s went away (%s): bringing session %s back, for up to "
                         "%.1f s", self.path, cause.reason, session, self.reconnect)
            t0 = time.monotonic()
            deadline = t0 + self.reconnect
            state = {"created": False, "mapped": 0, "warmed": 0, "loaded": False}
            timeout, delay, err = self.timeout, _BACKOFF_FIRST_S, None
            try:
                while True:
                    self.timeout = max(0.1, min(timeout, deadline - time.monotonic()))
                    self._apply_timeout()
                    try:
                        self._restore_once(session, kept, state)
                        err = None
                        break
                    except QmoeError as e:
                        err = e
                        left = deadline - time.monotonic()
                        if not self._transient(e) or left <= 0:
                            break
                    time.sleep(min(delay, left))
                    delay = min(2 * delay, _BACKOFF_MAX_S)
            finally:
                self.timeout = timeout
                self._apply_timeout()
            took = time.monotonic() - t0
            if err is not None:
                _log.warning("qmoed at %s: giving up on session %s after %.1f s: %s",
                             self.path, session, took, err.reason)
                return False
            self.restores += 1
            kept.made_on = self._conn_gen
            _log.warning("qmoed at %s: session %s is back after %.2f s (%s; %d map(s) passed "
                         "again; %d experts warm); retrying the call", self.path, session, took,
                         "re-created, its model loaded again from its bank" if state["loaded"]
                         else "re-created" if state["created"] else "the daemon still had it",
                         len(kept.maps) if state["created"] else 0, state["warmed"])
            return True

    @staticmethod
    def _transient(e):
        return (_gone(e) or e.code in (E_TIMEOUT, _EXHAUSTED, _SHUTTING_DOWN)
                or (e.code == _NOT_FOUND and e.field == "model"))

    def _recreate(self, session, kept, state):
        p = dict(kept.params, session=session)
        p.pop("client_pending_bytes", None)  # taken by the client since
        if kept.warm:
            p["warm"] = kept.warm
        r = self.call("session.create", p)
        state.update(created=True, mapped=0, warmed=int(r.get("warmed", 0)))

    def _restore_once(self, session, kept, state):
        """One attempt: the session (re-created, or still there), its model
        loaded again when missing and a bank is known, its maps (those not
        passed since the session was last made)."""
        try:
            self._recreate(session, kept, state)
        except QmoeError as e:
            bank = self._banks.get(kept.params.get("model"))
            if e.code == _NOT_FOUND and e.field == "model" and bank:
                try:
                    self.call("model.load", {"name": kept.params["model"], "path": bank})
                except QmoeError as le:
                    if le.code != _CONFLICT:  # conflict: another engine loaded it
                        raise
                state["loaded"] = True
                try:
                    self._recreate(session, kept, state)
                except QmoeError as e2:
                    e = e2
                else:
                    e = None
            if e is not None and e.code == _CONFLICT and not state["created"]:
                return  # the daemon never went: the session and its maps are there
            if e is not None and e.code != _CONFLICT:
                raise e
        while state["mapped"] < len(kept.maps):
            shm = kept.maps[state["mapped"]]
            if shm.mmap is not None and shm.fd is not None:
                r = self.call("session.map", {"session": session, "bytes": shm.size},
                              fd=shm.fd)
                shm.id = int(r["map"])
            state["mapped"] += 1
        # And whatever else the session had in the daemon, after its maps: a
        # call ring opened by the caller (ring_mode "explicit"; one this
        # client opens itself comes back with the retried call). A refusal
        # leaves the socket.
        ring = self._rings.get(session)
        if self.ring_mode == "explicit" and ring and ring[0] and ring[1] != self._conn_gen:
            try:
                self.ring(session)
            except QmoeError as e:
                if _gone(e) or e.code == E_TIMEOUT:
                    raise

    def _layer_call(self, session, fn, maps=None):
        """fn() once, and once more when the daemon went away and the
        session came back (restore), or when the daemon no longer held a
        map the call named (`maps`: tensor name -> SharedMap) and it was
        passed again."""
        gen = self.restores
        ids = {name: shm.id for name, shm in (maps or {}).items()}  # as this call names them
        try:
            try:
                r = fn()
            except QmoeError as e:
                e._qmoe_generation = gen
                if not self.restore(session, e):
                    raise
                r = fn()
        except QmoeError as e:
            if not self._map_again(session, e, maps, ids):
                raise
            r = fn()
        self.note_call(session)
        return r

    def _map_again(self, session, cause, maps, ids):
        """A call failed because the daemon no longer holds one of its maps
        (not_found naming `<tensor>.map` while the session lives on: the
        daemon reclaimed it once the connection that last used it had been
        closed for session_orphan_timeout_s, PROTOCOL.md "Lifecycle"): the
        map is passed again from its kept memfd and its id rewritten, unless
        another thread did so since the call began (`ids`: the maps' ids
        then). True: retry the call once."""
        field = cause.field or ""
        if not (maps and cause.code == _NOT_FOUND and field.endswith(".map")):
            return False
        name = field[:-len(".map")]
        shm = maps.get(name)
        if shm is None:
            return False
        failed_id = ids.get(name)
        with self._resume_lock:
            kept = self._kept.get(session)
            if kept is None or shm not in kept.maps or shm.fd is None or shm.mmap is None:
                return False
            if shm.id != failed_id:
                return True  # another thread passed it again meanwhile
            r = self.call("session.map", {"session": session, "bytes": shm.size}, fd=shm.fd)
            shm.id = int(r["map"])
        _log.warning("qmoed at %s no longer held map %s of session %s (reclaimed: this "
                     "client's connection had been closed for a while); passed it again as map "
                     "%d, retrying the call", self.path, failed_id, session, shm.id)
        return True

    def resize_session(self, session, budget_bytes=None, budget=None,
                       client_pending_bytes=None):
        """session.resize: the session's new expert budget: bytes (an int),
        "N%" of the model's expert bytes, or "auto" (bytes or "N%" end an
        auto budget; "auto" sizes it again). Requests sent before it finish
        under the old budget, later ones under the new. Returns
        {budget_bytes, resident_bytes, plan_summary[, budget_auto]}.
        client_pending_bytes (with budget "auto"): memory this process takes
        after the call (a longer context's KV cache), left free beside the
        daemon's reserve; not kept for a re-creation after a restart."""
        b = budget_bytes if budget is None else budget
        if b is None:
            raise ValueError("resize_session needs a budget")
        p = {"session": session}
        p.update(_budget_member(b))
        if client_pending_bytes is not None:
            p["client_pending_bytes"] = client_pending_bytes
        return self.call("session.resize", p)

    def infer(self, session, layer, hidden, router_logits=None, return_routing=False,
              topk_ids=None, topk_weights=None, output_to=None):
        """One MoE layer. Routing: the bank's router (nothing given),
        `router_logits` [T, E], or the engine's own choice: `topk_ids` (int32
        [T, k'], -1 = no route) with `topk_weights` (float [T, k']), used
        exactly as given (PROTOCOL.md "Routing supplied by the engine").
        Any tensor may be a MappedTensor (zero copy); with `output_to` (a
        MappedTensor of hidden's shape and dtype) qmoed writes the output
        there and `output` is that MappedTensor's view."""
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("topk_ids and topk_weights go together")
        p = {"session": session, "layer": int(layer), "hidden": encode_tensor(hidden)}
        if router_logits is not None:
            p["router_logits"] = encode_tensor(router_logits)
        if topk_ids is not None:
            if _np is not None and not isinstance(topk_ids, (Tensor, MappedTensor, _np.ndarray)):
                topk_ids = _np.asarray(topk_ids, dtype=_np.int32)
            p["topk_ids"] = encode_tensor(topk_ids, "i32")
            p["topk_weights"] = encode_tensor(topk_weights)
        if return_routing:
            p["return_routing"] = True
        if output_to is not None:
            if not isinstance(output_to, MappedTensor):
                raise TypeError("output_to is a MappedTensor (SharedMap.tensor / alloc)")

        def once():
            # Mapped tensors name their map's id at each try: it changes when
            # a restored session's maps are passed again.
            for key, t in (("hidden", hidden), ("router_logits", router_logits),
                           ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                if isinstance(t, MappedTensor):
                    p[key] = t.wire()
            if output_to is not None:
                p["output_to"] = {"map": output_to.wire()["map"], "offset": output_to.offset}
                req = None if return_routing else _ring_request(
                    layer, hidden, router_logits, topk_ids, topk_weights, output_to)
                st = self._ring_stats(session, req, int(layer)) if req is not None else None
                if st is not None:
                    return {"stats": st, "_ring": True}
            return self.call("session.infer", p)

        maps = {name: t.map for name, t in (
            ("hidden", hidden), ("router_logits", router_logits), ("topk_ids", topk_ids),
            ("topk_weights", topk_weights), ("output_to", output_to))
            if isinstance(t, MappedTensor)}
        r = self._layer_call(session, once, maps)
        if r.get("_ring"):
            output = output_to.array if (self.as_numpy and _np is not None) else output_to
            return InferResult(output, None, r["stats"])
        routing = r.get("routing")
        if routing is not None:
            routing = [[(int(e), float(w)) for e, w in tok] for tok in routing]
        out = r.get("output")
        if output_to is not None:
            if not isinstance(out, dict) or out.get("map") != output_to.map.id:
                raise QmoeError(E_PROTO, "bad_response", "output is not the mapped tensor asked for")
            output = output_to.array if (self.as_numpy and _np is not None) else output_to
        else:
            output = decode_tensor(out, self.as_numpy)
        return InferResult(output, routing, r.get("stats", {}))

    # ---- the call ring (PROTOCOL.md "session.ring") ----
    def ring(self, session):
        """session.ring: opens `session`'s call ring on this connection (again
        after a reconnect). infer() with every tensor mapped and output_to,
        and ring_counts(), then go through it. Raises QmoeError when the
        daemon refuses (-32601 from a daemon without rings)."""
        self._ring_forget(session)
        fd, mm = _ring.region()
        try:
            gen = self._conn_gen
            params = {"session": session}
            if self.ring_anticipate:
                params["anticipate"] = True
            try:
                r = self.call("session.ring", params, fd=fd)
            except QmoeError as e:
                # A daemon older than `anticipate` names it: a ring without.
                if not (e.name == "invalid_params" and e.field == "anticipate"):
                    raise
                os.close(fd)
                fd = -1
                mm.close()
                fd, mm = _ring.region()
                gen = self._conn_gen
                r = self.call("session.ring", {"session": session}, fd=fd)
            if int(r.get("version", 0)) != _ring.VERSION:
                raise QmoeError(E_PROTO, "bad_response",
                                "qmoed's call ring is version %s; this client speaks %d"
                                % (r.get("version"), _ring.VERSION))
        except BaseException as e:
            mm.close()
            # Refused: this connection's calls take the socket. Not when the
            # daemon lacks the session (restarted, the session not re-created
            # yet): asked again once it is back.
            if (isinstance(e, QmoeError) and e.code not in (E_IO, E_TIMEOUT)
                    and not _session_missing(e)):
                self._rings[session] = (False, self._conn_gen)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        if gen != self._conn_gen:  # reconnected on the way: the ring is the new connection's
            gen = self._conn_gen
        self._rings[session] = (_ring.Ring(mm, session, gen), gen)
        return True

    def ring_active(self, session):
        """True when calls of `session` take its ring now."""
        r = self._rings.get(session)
        return bool(r and r[0] and r[1] == self._conn_gen and self._sock is not None)

    def _ring_forget(self, session):
        r = self._rings.pop(session, None)
        if r and r[0]:
            r[0].close()

    def _ring_for(self, session):
        """The session's ring on this connection, opened when ring_mode is
        "auto"; None when its calls take the socket."""
        if self.ring_mode == "off" or not _ring.supported():
            return None
        r = self._rings.get(session)
        if r is not None and r[1] == self._conn_gen and self._sock is not None:
            return r[0] or None
        if self.ring_mode != "auto":
            return None
        try:
            self.ring(session)
        except QmoeError as e:
            # The connection broke, or a restarted daemon lacks the session:
            # the layer call's restore handles it, and the retry asks again.
            if e.code in (E_IO, E_TIMEOUT) or _session_missing(e):
                raise
            sys.stderr.write("qmoe_client: no call ring for session %s (%s: %s); its calls "
                             "go through the socket\n" % (session[:64], e.name, e.reason))
            return None
        return self._rings[session][0]

    def _ring_call(self, session, req, layer):
        """One call through the ring: the answer's stats, or None when the
        session's calls take the socket. Raises QmoeError as call() would."""
        ring = self._ring_for(session)
        if ring is None:
            return None
        with self._lock:
            if self._sock is None or self._rings.get(session, (None, -1))[1] != self._conn_gen:
                return None
            try:
                code, stats, field, reason = ring.call(req, layer, self._sock.fileno(),
                                                       self.timeout)
                self._answered.gen = self._conn_gen  # the ring's: checked above
            except _ring.RingClosed as e:
                self._rings.pop(session, None)
                ring.close()
                if e.code >= 0:
                    self._drop()
                    raise QmoeError(E_IO, "connection_lost",
                                    "qmoed closed the connection: %s" % e.reason)
                raise QmoeError(e.code, ERROR_NAMES.get(e.code, "error"), e.reason)
            except _ring.RingHangup:
                self._drop()
                raise QmoeError(E_IO, "connection_lost",
                                "qmoed closed the connection before answering")
            except _ring.RingTimeout:
                self._drop()
                raise QmoeError(E_TIMEOUT, "timeout", "qmoed did not answer session.infer in time")
        if code:
            raise QmoeError(code, ERROR_NAMES.get(code, "error"), reason, field or None)
        return stats

    def _ring_stats(self, session, req, layer):
        stats = self._ring_call(session, req, layer)
        return None if stats is None else dict(zip(_ring.STAT_NAMES, stats))

    def ring_counts(self, session, req, layer):
        """infer_counts() through the session's ring: `req` is the request
        slot's bytes (_ring.request), `layer` patched in. The same tuple, or
        None when the session's calls take the socket."""
        stats = self._ring_call(session, req, layer)
        return None if stats is None else tuple(stats[i] for i in _ring.COUNT_INDEX)

    def telemetry(self, session=None):
        return self.call("telemetry.get", {"session": session} if session is not None else None)

    def trace(self, session=None, limit=None):
        p = {}
        if session is not None:
            p["session"] = session
        if limit is not None:
            p["limit"] = int(limit)
        return self.call("telemetry.trace", p)["spans"]

    def metrics(self):
        return self.call("telemetry.metrics")["text"]

    def shutdown(self):
        return self.call("daemon.shutdown")
