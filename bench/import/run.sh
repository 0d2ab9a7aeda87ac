#!/bin/sh
# Import benchmark: throughput and peak RSS of `qmoe-bank import hf` on a
# synthetic bf16 checkpoint (make_synthetic_hf.py; 4.8 GB by default), int4
# block 32, next to `cat > /dev/null` of the same bytes. The shards are
# evicted from the page cache before each cold run with posix_fadvise
# (DONTNEED), since /proc/sys/vm/drop_caches needs privileges; warm runs
# read them from the page cache.
# usage: bench/import/run.sh [BUILD_DIR] [WORK_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
work=${2:-/tmp/qmoe-import-bench}
py=${PYTHON:-$here/../../.venv/bin/python}
tool=$build/tools/qmoe-bank/qmoe-bank
mkdir -p "$work"
ck=$work/ckpt
[ -f "$ck/config.json" ] || "$py" "$here/make_synthetic_hf.py" "$ck"
bytes=$(cat "$ck"/*.safetensors | wc -c)
evict() { "$py" -c 'import os,sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$@"; }
secs() { "$py" -c 'import sys,time; print(time.time())'; }
echo "checkpoint: $bytes bytes of safetensors in $(ls "$ck"/*.safetensors | wc -l) shards"
for cache in cold warm; do
  [ $cache = cold ] && evict "$ck"/*.safetensors
  t0=$(secs); cat "$ck"/*.safetensors > /dev/null; t1=$(secs)
  echo "cat > /dev/null ($cache): $(echo "$t0 $t1 $bytes" | awk '{printf "%.2f s, %.0f MB/s", $2-$1, $3/($2-$1)/1e6}')"
  [ $cache = cold ] && evict "$ck"/*.safetensors
  rm -f "$work/bank.safetensors"
  /usr/bin/time -f "%e %M %U %S" -o "$work/time.txt" \
    "$tool" import hf "$ck" --out "$work/bank.safetensors" --bits 4 --block-size 32 --quiet
  read wall rss_kb user sys < "$work/time.txt"
  echo "import hf ($cache): $(echo "$wall $bytes $rss_kb $user $sys" | awk '{printf "%.2f s, %.0f MB/s of source, peak RSS %.0f MB, cpu %.2f s user + %.2f s sys", $1, $2/$1/1e6, $3*1024/1e6, $4, $5}')"
  evict "$work/bank.safetensors"
done
layer=$(ls -l "$ck"/model-00001-*.safetensors | awk '{print $5}')
echo "one layer's source: $layer bytes ($(echo $layer | awk '{printf "%.0f MB", $1/1e6}')); bank: $(wc -c < "$work/bank.safetensors") bytes"
echo "cpu: $(nproc) cores online, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
[ -n "${KEEP:-}" ] || rm -rf "$work"
