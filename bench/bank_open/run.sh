#!/usr/bin/env bash
# Opening and cataloguing a bank costs milliseconds, whatever its size:
# generates a ~3 GB bank and a tiny one with the same tensor count in /tmp,
# times open + catalog of every layer for each, deletes them.
#   bench/bank_open/run.sh [BUILD_DIR (default build)] [SIZE: big layers/experts/hidden/inter]
set -euo pipefail
build=${1:-build}
tool=$build/tools/qmoe-bank/qmoe-bank
bench=$build/bench/bank_open/bench_bank_open
[ -x "$tool" ] && [ -x "$bench" ] || { echo "build qmoe-bank and bench_bank_open first" >&2; exit 2; }
dir=$(mktemp -d /tmp/qmoe-bank-open.XXXXXX)
trap 'rm -rf "$dir"' EXIT
common=(--layers 32 --experts 32 --k 4 --bits 8 --block-size 0 --activation swiglu --quiet)
echo "== generating: 32 layers x 32 experts, hidden 1024, inter 1024, 8-bit, fused swiglu"
start=$(date +%s)
"$tool" create --out "$dir/big.qmoe" "${common[@]}" --hidden 1024 --inter 1024
echo "generated $(stat -c %s "$dir/big.qmoe") bytes in $(( $(date +%s) - start )) s"
"$tool" create --out "$dir/small.qmoe" "${common[@]}" --hidden 16 --inter 16
sync  # leave no writeback in flight: the first open then measures a cold header read only
echo "== big"
"$bench" "$dir/big.qmoe" 21
echo "== small (same tensors, tiny data)"
"$bench" "$dir/small.qmoe" 21
