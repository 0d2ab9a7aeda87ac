"""The call ring (PROTOCOL.md "session.ring"; protocol/qm_ring_wire.h): one
page of shared memory per session and connection through which a layer call
goes to qmoed without JSON and without the daemon's loop thread. This side
writes the request slot, rings the REQ_SEQ futex word and waits on ANS_SEQ
(spinning about as long as it expects to wait when that is shorter than a
wake-up, else sleeping); one thread of the daemon answers in the answer slot.

Stdlib only: the region is an mmap of a sealed memfd, the futex is the
futex(2) system call through ctypes. Used by Client (the `ring*` methods)."""
import ctypes
import fcntl
import mmap
import os
import platform
import select
import struct
import time

RING_BYTES = 4096
VERSION = 1
OFF_STATE, OFF_CLOSED_CODE, OFF_CLOSED_REASON, REASON_BYTES = 12, 16, 64, 192
OFF_REQ_SEQ, OFF_DAEMON_PARKED, OFF_ANS_SEQ, OFF_CLIENT_PARKED = 256, 320, 384, 448
OFF_REQUEST, OFF_ANSWER = 512, 768
F_ROUTER_LOGITS, F_TOPK = 1, 2
CLOSED_CONN = 1
DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "i32": 3}
STAT_NAMES = ("hits", "misses", "host_runs", "bytes_paged", "bytes_read_disk", "stall_us",
              "queue_us", "compute_us", "decode_us", "encode_us", "wall_us")
COUNT_INDEX = tuple(STAT_NAMES.index(n) for n in
                    ("hits", "misses", "bytes_paged", "queue_us", "compute_us"))

# The request: layer, flags, rung_ns, then hidden, router_logits, topk_ids,
# topk_weights as (dtype, reserved, rows, cols, map, offset), then the
# output's map and offset (192 bytes).
REQUEST = struct.Struct("<IIQ" + "IIQQQQ" * 4 + "QQ")
_LAYER_STAMP = struct.Struct("<IIQ")
# The answer's head: code, reserved, answered_ns, the 11 stats.
_ANSWER = struct.Struct("<iIQ11Q")
_U32 = struct.Struct("<I")
_SLICE_S = 0.02  # parked: the socket is looked at this often
_SPIN_MAX_NS = 200000

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238,
              "riscv64": 98}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported():
    """Whether this machine's futex call is known (else the socket)."""
    return _SYS_FUTEX is not None


def request(layer, hidden, output, router_logits=None, topk_ids=None, topk_weights=None):
    """The request slot's bytes. Each tensor is (dtype name, rows, cols, map,
    offset); `output` is (map, offset)."""
    t = []
    for x in (hidden, router_logits, topk_ids, topk_weights):
        if x is None:
            t += [0, 0, 0, 0, 0, 0]
        else:
            dt, rows, cols, m, off = x
            t += [DTYPES[dt], 0, int(rows), int(cols), int(m), int(off)]
    flags = (F_ROUTER_LOGITS if router_logits is not None else 0) | \
        (F_TOPK if topk_ids is not None else 0)
    return bytearray(REQUEST.pack(int(layer), flags, 0, *t, int(output[0]), int(output[1])))


def region():
    """A sealed memfd of one page and its mapping: (fd, mmap)."""
    fd = os.memfd_create("qmoe-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, RING_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, RING_BYTES)
    except BaseException:
        os.close(fd)
        raise


class RingClosed(Exception):
    """The daemon closed the ring: code (a JSON-RPC code, or CLOSED_CONN)
    and reason."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code, self.reason = code, reason


class RingTimeout(Exception):
    pass


class RingHangup(Exception):
    pass


class Ring:
    """A ring's region on this side. call() is not thread-safe: the Client's
    lock serialises it."""

    def __init__(self, mm, session, conn_gen):
        self.mm, self.session, self.conn_gen = mm, session, conn_gen
        self._word = ctypes.c_char.from_buffer(mm)  # keeps the address; released by close()
        self._addr = ctypes.addressof(self._word)
        # The shared words are read and written whole, as one aligned 32-bit
        # access: struct.pack_into clears its bytes before it fills them, so
        # the daemon could see a doorbell of 0 between two calls and take a
        # call that was never rung (and then the real one again).
        self._words = {off: ctypes.c_uint32.from_address(self._addr + off)
                       for off in (OFF_STATE, OFF_REQ_SEQ, OFF_ANS_SEQ, OFF_CLIENT_PARKED)}
        self.seq = self._load(OFF_ANS_SEQ)
        self._wake_ns = 20000  # a wake-up's cost, until measured
        self._expect_ns = 20000  # a call's service time, moving average

    def close(self):
        self._words = {}  # the addresses end with the mapping
        self._word = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass

    def _load(self, off):
        return self._words[off].value

    def _store(self, off, v):
        self._words[off].value = v & 0xffffffff

    def _futex(self, off, op, val, timeout_s=None):
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1) * 1e9)))
        return _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr + off), op, val, ts, None, 0)

    def closed(self):
        """None while open; else (code, reason)."""
        if self._load(OFF_STATE) == 0:
            return None
        code = struct.unpack_from("<i", self.mm, OFF_CLOSED_CODE)[0]
        raw = bytes(self.mm[OFF_CLOSED_REASON:OFF_CLOSED_REASON + REASON_BYTES])
        return code, raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def _budget(self):
        wake = min(max(self._wake_ns, 1000), _SPIN_MAX_NS // 2)
        if self._expect_ns > 2 * wake:
            return 0
        return max(2000, min(2 * self._expect_ns, 2 * wake))

    def call(self, req, layer, sock_fd, timeout_s):
        """One call: the request bytes (layer patched in), then the answer
        as (code, stats, field, reason). Raises RingClosed, RingHangup (the
        daemon's end of the socket is gone) or RingTimeout."""
        shut = self.closed()
        if shut is not None:
            raise RingClosed(*shut)
        mm = self.mm
        t0 = time.monotonic_ns()
        mm[OFF_REQUEST:OFF_REQUEST + len(req)] = req
        _LAYER_STAMP.pack_into(mm, OFF_REQUEST, layer, _U32.unpack_from(req, 4)[0], t0)
        seq = (self.seq + 1) & 0xffffffff
        self.seq = seq
        self._store(OFF_REQ_SEQ, seq)
        # Always rung: Python cannot fence between this store and a look at
        # DAEMON_PARKED; the kernel's wake path does.
        self._futex(OFF_REQ_SEQ, _FUTEX_WAKE, 0x7fffffff)
        parked = self._wait(seq, t0, sock_fd, timeout_s)
        head = _ANSWER.unpack_from(mm, OFF_ANSWER)
        now = time.monotonic_ns()
        self._expect_ns += ((now - t0) - self._expect_ns) // 8
        if parked and 0 < head[2] <= now:
            self._wake_ns += (min(now - head[2], 4 * _SPIN_MAX_NS) - self._wake_ns) // 8
        code, stats = head[0], head[3:]
        if not code:
            return 0, stats, "", ""
        a = OFF_ANSWER
        field = bytes(mm[a + 112:a + 176]).split(b"\0", 1)[0].decode("utf-8", "replace")
        reason = bytes(mm[a + 176:a + 688]).split(b"\0", 1)[0].decode("utf-8", "replace")
        return code, stats, field, reason

    def _wait(self, seq, t0, sock_fd, timeout_s):
        load = self._load
        end_spin = t0 + self._budget()
        while load(OFF_ANS_SEQ) != seq:
            if load(OFF_STATE) != 0:
                raise RingClosed(*self.closed())
            if time.monotonic_ns() >= end_spin:
                break
        else:
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            v = load(OFF_ANS_SEQ)
            if v == seq:
                return True
            if load(OFF_STATE) != 0:
                raise RingClosed(*self.closed())
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingTimeout()
            # PARKED set, then the kernel looks at ANS_SEQ again under its
            # lock before sleeping: an answer in between is never missed.
            self._store(OFF_CLIENT_PARKED, 1)
            self._futex(OFF_ANS_SEQ, _FUTEX_WAIT, v, min(left, _SLICE_S))
            self._store(OFF_CLIENT_PARKED, 0)
            if load(OFF_ANS_SEQ) == seq:
                return True
            # The region's word before the socket: a daemon that closed the
            # ring (drain, exit) and then its socket said why in the region.
            if load(OFF_STATE) != 0:
                raise RingClosed(*self.closed())
            if sock_fd < 0:  # no socket to look at (tests drive the region alone)
                continue
            p = select.poll()
            p.register(sock_fd, select.POLLIN | getattr(select, "POLLRDHUP", 0x2000))
            for _, ev in p.poll(0):
                if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL |
                         getattr(select, "POLLRDHUP", 0x2000)):
                    raise RingHangup()
