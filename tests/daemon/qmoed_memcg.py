"""A memory cgroup for tests and benches: cgroup v1's memory controller
(memory.limit_in_bytes) where it is mounted, else v2 (memory.max). Needs
root and a writable hierarchy; MemCgroup.unavailable() says why not.

Shared by tests/daemon/test_qmoed_budget.py and bench/e2e (the capped
sweep): one place that knows both versions' file names.
"""
import os
import time

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"


class MemCgroup:
    """A fresh memory cgroup with a limit; remove() when done."""

    def __init__(self, limit, prefix="qmoe-test"):
        self.v2 = not os.path.exists(os.path.join(V1_ROOT, "memory.limit_in_bytes"))
        base = V2_ROOT if self.v2 else V1_ROOT
        self.path = os.path.join(base, "%s-%d-%d" % (prefix, os.getpid(), int(time.time() * 1e6)))
        os.makedirs(self.path)
        self.set_limit(limit)

    @staticmethod
    def unavailable():
        """None when a memory cgroup can be made here, else the reason."""
        if os.geteuid() != 0:
            return "needs root to make a memory cgroup"
        if os.path.exists(os.path.join(V1_ROOT, "memory.limit_in_bytes")):
            return None if os.access(V1_ROOT, os.W_OK) else "%s is not writable" % V1_ROOT
        ctl = os.path.join(V2_ROOT, "cgroup.subtree_control")
        try:
            with open(ctl) as f:
                if "memory" not in f.read().split():
                    return "cgroup v2 without the memory controller in %s" % ctl
        except OSError as e:
            return "no memory cgroup hierarchy (%s)" % e
        return None if os.access(V2_ROOT, os.W_OK) else "%s is not writable" % V2_ROOT

    def _file(self, v1, v2):
        return os.path.join(self.path, v2 if self.v2 else v1)

    def set_limit(self, limit):
        """Writes the limit; OSError (EBUSY on v1) when the kernel refuses it."""
        with open(self._file("memory.limit_in_bytes", "memory.max"), "w") as f:
            f.write(str(int(limit)))

    def limit(self):
        with open(self._file("memory.limit_in_bytes", "memory.max")) as f:
            v = f.read().strip()
        return None if v == "max" else int(v)

    def usage(self):
        with open(self._file("memory.usage_in_bytes", "memory.current")) as f:
            return int(f.read())

    def prefix(self):
        """A command prefix that moves the command into the group first."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path]

    def add(self, pid):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def oom_kills(self):
        with open(self._file("memory.oom_control", "memory.events")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
