#!/usr/bin/env bash
# verify.sh - build, test and benchmark the CUDA backend on a GPU machine.
#
# One command for a lent GPU machine (the H200 of this workplace: root, no
# network, nvcc + cmake + ninja, no libuv/cJSON/Check). Run from the
# repository root:
#
#     bash bench/cuda/verify.sh            # logs and results in $OUT (or out/device-check)
#
# Missing build dependencies are taken from .qmdeps/*.deb (downloaded on a
# machine with network: see docs/CUDA.md) and unpacked into a private prefix,
# never into /. Every step has a time limit inside one overall budget
# (QMOE_DEVICE_BUDGET seconds, default 470: under 8 minutes), in order of
# importance: build, CUDA test suites, benchmark (its last part: the
# end-to-end layer throughput through the pager at 100/50/25 % budget),
# compute-sanitizer on one test case.
# (QMOE_DEVICE_FORCE_DIRECT=1 skips CMake and compiles directly, the fallback)
# Files written to $OUT: log (everything), env.txt, build.log, test_cuda.log,
# bench.txt, sanitizer.log, summary.txt. The summary is printed last.
# Exit status: 0 all ran and passed; 3 no CUDA device answered (built and
# checked what runs without one; nothing measured: "NO DEVICE" in the
# summary); 1 a step failed.
set -uo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here" || exit 1
OUT=${OUT:-$here/out/device-check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
start=$(date +%s)
budget=${QMOE_DEVICE_BUDGET:-470}
deadline=$((start + budget))
build=${QMOE_DEVICE_BUILD:-/tmp/qmoe-device-build}
deps=/tmp/qmoe-deps
summary="$OUT/summary.txt"
: >"$summary"
failed=0    # a step failed
no_device=0 # the suites skipped / the bench found no device

note() { echo "$*" | tee -a "$summary"; }
verdict() { case $1 in 0) echo PASS ;; 77) echo SKIPPED ;; 2) echo "NO DEVICE" ;; 124 | 137) echo TIMEOUT ;; *) echo FAIL ;; esac; }
left() { echo $((deadline - $(date +%s))); }
# step_timeout WANT [RESERVE]: WANT seconds, or what is left minus RESERVE.
step_timeout() {
  local want=$1 reserve=${2:-0} l
  l=$(($(left) - reserve))
  if ((l < want)); then want=$l; fi
  if ((want < 5)); then want=5; fi
  echo "$want"
}

echo "== verify.sh at $(date -u +%FT%TZ), budget ${budget}s, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
set -x

# ---- 1. what is on this machine ----
{
  date -u
  uname -a
  cat /etc/os-release 2>/dev/null | head -3
  nvidia-smi 2>&1 | head -20
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1
  command -v nvcc && nvcc --version | tail -2
  command -v cmake && cmake --version | head -1
  command -v ninja && ninja --version
  command -v gcc && gcc --version | head -1
  command -v g++ && g++ --version | head -1
  command -v pkg-config pkgconf dpkg ar compute-sanitizer
  nproc
  free -g
  for p in libuv libcjson check; do
    printf '%s: ' "$p"
    pkg-config --modversion "$p" 2>&1 || true
  done
} >"$OUT/env.txt" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
note "gpu: ${gpu:-none reported by nvidia-smi}; nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo none)"

if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc || true)}

# ---- 2. build dependencies: system first, carried .debs for what is missing ----
unpack_deb() { # unpack_deb FILE DIR, with dpkg or ar+tar
  if command -v dpkg >/dev/null; then
    dpkg -x "$1" "$2"
  else
    local t
    t=$(mktemp -d)
    (cd "$t" && ar x "$1" && tar -xf data.tar.* -C "$2")
    rm -rf "$t"
  fi
}
need_deps=0
runlib=
command -v pkg-config >/dev/null || need_deps=1
for p in libuv libcjson check; do
  pkg-config --exists "$p" 2>/dev/null || need_deps=1
done
if ((need_deps)); then
  if ls .qmdeps/*.deb >/dev/null 2>&1; then
    rm -rf "$deps"
    mkdir -p "$deps"
    for f in .qmdeps/*.deb; do unpack_deb "$here/$f" "$deps"; done
    lib="$deps/usr/lib/x86_64-linux-gnu"
    # The .pc files say prefix=/usr: point them at the private prefix.
    for pc in "$lib"/pkgconfig/*.pc "$deps"/usr/share/pkgconfig/*.pc; do
      [ -f "$pc" ] && sed -i "s|^prefix=/usr\$|prefix=$deps/usr|; s|^libdir=/usr/|libdir=$deps/usr/|; s|^includedir=/usr/|includedir=$deps/usr/|" "$pc"
    done
    export PKG_CONFIG_PATH="$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    # Only the programs built here load these (cmake itself may use the system's libuv).
    runlib="$lib"
    export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    if ! command -v pkg-config >/dev/null; then
      mkdir -p "$deps/bin"
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$lib" "$deps/usr/bin/pkgconf" >"$deps/bin/pkg-config"
      chmod +x "$deps/bin/pkg-config"
      export PATH="$deps/bin:$PATH"
    fi
    note "deps: unpacked $(ls .qmdeps/*.deb | wc -l) carried .debs into $deps"
  else
    note "deps: libuv/cJSON/Check/pkg-config missing and no .qmdeps/*.deb carried"
  fi
else
  note "deps: libuv, cJSON, Check and pkg-config found on the system"
fi
for p in libuv libcjson check; do
  echo "$p: $(pkg-config --modversion "$p" 2>&1)"
done

# ---- 3. build: CMake (the project's own build), else a direct compile ----
targets="test_cuda qmoe-cuda-bench"               # required
optional_targets="test_cuda_paging test_cuda_emu" # built one by one if they exist
bin_test="$build/tests/cuda/test_cuda"
bin_emu="$build/tests/cuda/test_cuda_emu"
bin_paging="$build/tests/cuda/test_cuda_paging"
bin_bench="$build/cuda/qmoe-cuda-bench"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
built=0
rm -rf "$build"
if [ -n "${QMOE_DEVICE_FORCE_DIRECT:-}" ]; then
  note "build: QMOE_DEVICE_FORCE_DIRECT set, skipping CMake"
elif timeout -k 5 "$(step_timeout 90 300)" cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DQMOE_WITH_CUDA=ON -DQMOE_CUDA_ARCHITECTURES=90-real >"$OUT/build.log" 2>&1 &&
   timeout -k 5 "$(step_timeout 300 200)" cmake --build "$build" -j"$(nproc)" --target $targets \
     >>"$OUT/build.log" 2>&1; then
  built=1
  for t in $optional_targets; do
    timeout -k 5 "$(step_timeout 120 200)" cmake --build "$build" -j"$(nproc)" --target "$t" \
      >>"$OUT/build.log" 2>&1 || note "build: optional target $t not built"
  done
  note "build: cmake OK ($(($(date +%s) - start))s since start)"
else
  note "build: cmake FAILED (see build.log tail below); trying the direct compile"
  tail -30 "$OUT/build.log"
fi

direct_build() { # everything test_cuda and the bench need, without CMake
  local o="$build/direct" cf
  rm -rf "$o" && mkdir -p "$o/obj"
  # shellcheck disable=SC2207 # pkg-config output is meant to split
  cf=(-O2 -g -std=c11 -D_GNU_SOURCE -DQMOE_VERSION=\"0.1.0\" -DQMOE_HAVE_CUDA -DQMOE_X86_KERNELS
      -Icommon -Iresidency -Iprotocol -Imodel -Iengine/backend -Iengine/kernels -Iengine/forward -Iengine/pager -Icuda -Itests -Itests/engine
      $(pkg-config --cflags libcjson check 2>/dev/null) -I"$(dirname "$(command -v nvcc)")/../include")
  local f flags
  for f in common/*.c residency/*.c protocol/*.c model/*.c engine/*/*.c backends/*.c cuda/qm_cuda_backend.c \
           cuda/qm_cuda_run.c cuda/qm_cuda_route.c cuda/qm_cuda_bench.c cuda/qm_cuda_bench_e2e.c \
           tests/cuda/test_cuda.c tests/cuda/test_cuda_route.c tests/cuda/cuda_fixture.c \
           tests/engine/engine_fixture.c; do
    flags=()
    case "$f" in
      engine/kernels/qm_kernel_avx2.c) flags=(-mavx2 -mfma -mf16c -O3) ;;
      engine/kernels/qm_kernel_avx512.c) flags=(-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -O3) ;;
    esac
    gcc "${cf[@]}" "${flags[@]}" -c "$f" -o "$o/obj/$(echo "$f" | tr / _).o" || return 1
  done
  nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -Icuda -c cuda/qm_cuda_kernels.cu -o "$o/obj/kernels.o" || return 1
  nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -Icuda -c cuda/qm_cuda_route.cu -o "$o/obj/route.o" || return 1
  nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -Icuda -c cuda/qm_cuda_tc.cu -o "$o/obj/tc.o" || return 1
  nvcc -O2 -std=c++17 -gencode arch=compute_90,code=sm_90 -c cuda/qm_cuda_bench_fill.cu -o "$o/obj/fill.o" || return 1
  local lib=() main_test main_bench
  for f in "$o"/obj/*.o; do
    case "$f" in
      *tests_cuda_test_cuda.c.o) main_test=$f ;;
      *cuda_qm_cuda_bench.c.o) main_bench=$f ;;
      *fill.o) ;;
      *) lib+=("$f") ;;
    esac
  done
  # shellcheck disable=SC2207
  local libs=($(pkg-config --libs libcjson check 2>/dev/null) -lm -lpthread -lrt -ldl)
  mkdir -p "$(dirname "$bin_test")" "$(dirname "$bin_bench")"
  nvcc -o "$bin_test" "$main_test" "${lib[@]}" "${libs[@]}" || return 1
  nvcc -o "$bin_bench" "$main_bench" "$o/obj/fill.o" "${lib[@]}" "${libs[@]}" || return 1
}
if ((!built)); then
  if timeout -k 5 "$(step_timeout 300 200)" bash -c "$(declare -f direct_build); bin_test='$bin_test' bin_bench='$bin_bench' build='$build' direct_build" >>"$OUT/build.log" 2>&1; then
    built=1
    note "build: direct compile OK"
  else
    note "build: direct compile FAILED too"
    tail -40 "$OUT/build.log"
  fi
fi

# ---- 4. the CUDA suite (CPU vs CUDA over the variant matrix, copies, fences) ----
# run_suite BIN WANT RESERVE WHAT: runs a Check suite (step_timeout WANT RESERVE)
# into test_cuda.log and notes its verdict; its exit status is left in rc.
run_suite() {
  CK_FORK=no LD_LIBRARY_PATH="$runlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    timeout -k 5 "$(step_timeout "$2" "$3")" "$1" >>"$OUT/test_cuda.log" 2>&1
  rc=$?
  note "$4: exit $rc ($(verdict $rc))"
}
if ((built)) && [ -x "$bin_test" ]; then
  : >"$OUT/test_cuda.log"
  run_suite "$bin_test" 200 150 "test_cuda"
  case $rc in 0) ;; 77) no_device=1 ;; *) failed=1 ;; esac
  grep -E "^(device|variant matrix|gpt-oss|f16|bf16|FAIL|CPU-OFF|SKIP)|Checks:|:[EF]:" "$OUT/test_cuda.log" | head -60 | tee -a "$summary"
  if [ -x "$bin_paging" ]; then
    run_suite "$bin_paging" 90 150 "test_cuda_paging (pager on CUDA)"
    case $rc in 0 | 77) ;; *) failed=1 ;; esac
    grep -E "^(paging|e2e)|Checks:|:[EF]:" "$OUT/test_cuda.log" | tail -14 | tee -a "$summary"
  fi
  if [ -x "$bin_emu" ]; then
    run_suite "$bin_emu" 60 140 "test_cuda_emu (CPU emulation of the kernels)"
    case $rc in 0) ;; *) failed=1 ;; esac
  fi
else
  note "test_cuda: not built"
  failed=1
fi

# ---- 5. benchmark ----
if ((built)) && [ -x "$bin_bench" ]; then
  LD_LIBRARY_PATH="$runlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    timeout -k 5 "$(step_timeout 180 40)" "$bin_bench" --out "$OUT/bench.txt" --layers 8 --iters 60 \
      --e2e-layers "${QMOE_E2E_LAYERS:-4}" --e2e-seconds "${QMOE_E2E_SECONDS:-2}" >/dev/null 2>"$OUT/bench.err"
  rc=$?
  note "bench: exit $rc ($(verdict $rc))"
  case $rc in 0) ;; 2) no_device=1 ;; *) failed=1 ;; esac
  [ -f "$OUT/bench.txt" ] && cat "$OUT/bench.txt" >>"$summary"
  [ -s "$OUT/bench.err" ] && head -20 "$OUT/bench.err" | tee -a "$summary"
  rm -f "$OUT/bench.err"
fi

# ---- 6. compute-sanitizer memcheck on the layer case (if time is left) ----
if ((built)) && [ -x "$bin_test" ] && command -v compute-sanitizer >/dev/null && (($(left) > 45)); then
  CK_FORK=no CK_RUN_CASE=layer LD_LIBRARY_PATH="$runlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    timeout -k 5 "$(step_timeout 120 5)" \
    compute-sanitizer --tool memcheck --error-exitcode 99 "$bin_test" >"$OUT/sanitizer.log" 2>&1
  rc=$?
  case $rc in 0 | 77 | 124 | 137) ;; *) failed=1 ;; esac # out of time: noted, not a failure
  note "compute-sanitizer memcheck (case layer): exit $rc; $(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$OUT/sanitizer.log") error lines; $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
else
  note "compute-sanitizer: skipped (not found, not built, or out of time)"
fi

set +x
if ((no_device)); then
  note "NO DEVICE: no CUDA device answered (see the SKIP line of test_cuda.log / bench.txt); nothing was measured (the lines above say what ran)"
fi
note "total: $(($(date +%s) - start))s"
echo "================ summary ================"
cat "$summary"
if ((failed)); then exit 1; fi
if ((no_device)); then exit 3; fi
exit 0
