#!/bin/sh
# bench/paging_disk/run.sh - the "Decode from disk" table of docs/BENCHMARKS.md, "A model larger than my memory".
#
#   bench/paging_disk/run.sh BUILD_DIR BANK [TOKENS] [HEADROOM_MIB] [REPS] [-- extra paging_disk args]
#
# For each budget B in 25%, 50%, 100% of the bank's expert bytes, the memory
# limit is B + HEADROOM_MIB (default 512: the process, its scratch, the
# routers); inside it, each in a fresh process after the bank is dropped from
# the page cache, run: whole (no pager: every expert read in place from the
# mapping, the page cache keeps what the limit allows: today's CPU serving),
# mmap (a pager at B copying misses from the mapping) and direct (the pager
# at B reading misses with O_DIRECT into a locked arena). The limit is a
# memory cgroup (v2 memory.max, else v1 memory.limit_in_bytes; the page
# cache counts against both); without a writable one the script says so and
# runs unbounded. BUDGETS="0.5" picks budgets. whole and direct run REPS times (default 3), alternating,
# since a shared machine's load moves tokens/s between runs; mmap once.
# Prints paging_disk's JSON lines and each run's cgroup peak.
# Make the bank with, e.g. (GPT-OSS-20B-like, 16 of its 24 layers, ~7.2 GB):
#   qmoe-bank create --out BANK --layers 16 --experts 32 --hidden 2880 --inter 2880 \
#     --k 4 --bits 4 --block-size 32 --activation swiglu --scale-dtype f16 --router
set -eu
BUILD=$1 BANK=$2 TOKENS=${3:-24} HEADROOM=${4:-512} REPS=${5:-3}
shift 2; for _ in 1 2 3; do [ $# -gt 0 ] && [ "$1" != "--" ] && shift; done
[ "${1:-}" = "--" ] && shift
BIN=$BUILD/bench/paging_disk/paging_from_disk
EXPERT_BYTES=$("$BIN" --bank "$BANK" --mode whole --tokens 1 --warm 0 | sed 's/.*"expert_gib":\([0-9.]*\).*/\1/')
CG="" KIND="none (no writable memory cgroup): unbounded"
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -q memory /sys/fs/cgroup/cgroup.controllers; then
  own=$(grep '^0::' /proc/self/cgroup | cut -d: -f3)
  CG=/sys/fs/cgroup$own/qm_paging_disk.$$; LIMITF=memory.max; PEAKF=memory.peak
  KIND="cgroup v2 memory.max"
elif [ -d /sys/fs/cgroup/memory ]; then
  own=$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)
  CG=/sys/fs/cgroup/memory$own/qm_paging_disk.$$; LIMITF=memory.limit_in_bytes
  PEAKF=memory.max_usage_in_bytes; KIND="cgroup v1 memory.limit_in_bytes"
fi
[ -n "$CG" ] && ! mkdir "$CG" 2>/dev/null && CG="" && KIND="none (cannot make a memory cgroup): unbounded"
echo "# bank $BANK: $EXPERT_BYTES GiB of experts; memory limit = budget + $HEADROOM MiB via $KIND;"
echo "# $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), load $(cut -d' ' -f1-3 /proc/loadavg), $(uname -r)"
run() {
  if [ -n "$CG" ]; then
    echo 0 > "$CG/$PEAKF" 2>/dev/null || true
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$CG" "$BIN" --bank "$BANK" --tokens "$TOKENS" "$@"
    echo "#   cgroup peak $(($(cat "$CG/$PEAKF") / 1048576)) MiB"
  else
    "$BIN" --bank "$BANK" --tokens "$TOKENS" "$@"
  fi
}
for b in ${BUDGETS:-0.25 0.5 1.0}; do
  limit=$(awk -v g="$EXPERT_BYTES" -v b="$b" -v h="$HEADROOM" 'BEGIN { printf "%d", g * b * 1024 + h }')
  echo "# budget $b: limit $limit MiB"
  [ -n "$CG" ] && echo $((limit * 1048576)) > "$CG/$LIMITF"
  r=0
  while [ $r -lt "$REPS" ]; do
    run --mode whole "$@"
    run --mode direct --budget $b "$@"
    r=$((r + 1))
  done
  run --mode mmap --budget $b "$@"
done
if [ -n "$CG" ]; then rmdir "$CG"; fi
