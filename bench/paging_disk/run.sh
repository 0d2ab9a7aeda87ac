#!/bin/sh
# bench/paging_disk/run.sh - the docs/BENCHMARKS.md "CPU decode from disk" table.
#
#   bench/paging_disk/run.sh BUILD_DIR BANK LIMIT_MIB [TOKENS] [-- extra paging_disk args]
#
# Runs, each in a fresh process inside a memory cgroup limited to LIMIT_MIB
# (cgroup v2 memory.max, else v1 memory.limit_in_bytes; page cache counts
# against it in both), after dropping BANK from the page cache:
#   whole (the mapping and the page cache, no pager), then for budgets 25%,
#   50%, 100% of the expert bytes: mmap (pager copying from the mapping) and
#   direct (pager reading with O_DIRECT). Prints the JSON lines of
#   paging_disk. Without a writable cgroup it says so and runs unbounded.
# Make the bank with, e.g. (GPT-OSS-20B-like, 16 of its 24 layers, ~7.2 GB):
#   qmoe-bank create --out BANK --layers 16 --experts 32 --hidden 2880 --inter 2880 \
#     --k 4 --bits 4 --block-size 32 --activation swiglu --scale-dtype f16 --router
set -eu
BUILD=$1 BANK=$2 LIMIT_MIB=$3 TOKENS=${4:-24}
shift 3; [ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
BIN=$BUILD/bench/paging_disk/paging_from_disk
CG=""
own=$(grep -E '^0::|:memory:' /proc/self/cgroup | head -1 | cut -d: -f3)
if [ -w /sys/fs/cgroup/cgroup.subtree_control ] && grep -q memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
  CG=/sys/fs/cgroup$own/qm_paging_disk.$$; mkdir "$CG"; echo $((LIMIT_MIB * 1048576)) > "$CG/memory.max"
  echo 0 > "$CG/memory.swap.max" 2>/dev/null || true; KIND="cgroup v2 memory.max"
elif [ -d /sys/fs/cgroup/memory ]; then
  own=$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)
  CG=/sys/fs/cgroup/memory$own/qm_paging_disk.$$
  if mkdir "$CG" 2>/dev/null; then
    echo $((LIMIT_MIB * 1048576)) > "$CG/memory.limit_in_bytes"; KIND="cgroup v1 memory.limit_in_bytes"
  else CG=""; fi
fi
[ -n "$CG" ] || KIND="none (no writable memory cgroup): unbounded"
echo "# memory limit: $LIMIT_MIB MiB via $KIND; $(nproc) cores; $(uname -r)"
run() {
  if [ -n "$CG" ]; then
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$CG" "$BIN" --bank "$BANK" --tokens "$TOKENS" "$@"
  else
    "$BIN" --bank "$BANK" --tokens "$TOKENS" "$@"
  fi
  if [ -n "$CG" ] && [ -f "$CG/memory.max_usage_in_bytes" ]; then
    echo "#   cgroup peak $(($(cat "$CG/memory.max_usage_in_bytes") / 1048576)) MiB"
    echo 0 > "$CG/memory.max_usage_in_bytes" 2>/dev/null || true
  elif [ -n "$CG" ] && [ -f "$CG/memory.peak" ]; then
    echo "#   cgroup peak $(($(cat "$CG/memory.peak") / 1048576)) MiB"
  fi
}
run --mode whole "$@"
for b in 0.25 0.5 1.0; do
  run --mode mmap --budget $b "$@"
  run --mode direct --budget $b "$@"
done
[ -n "$CG" ] && rmdir "$CG"
