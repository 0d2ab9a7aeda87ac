#!/usr/bin/env bash
# The full test suite: the release build's tests, then the unit tests again
# under AddressSanitizer + UndefinedBehaviorSanitizer, then the fuzz targets
# for a bounded time. Everything CI runs.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bash scripts/setup.sh
export PATH="$here/.venv/bin:$PATH"
jobs=$(nproc)

echo "== release build + all tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DQMOE_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== ASan+UBSan build + unit tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DQMOE_WERROR=ON \
      -DQMOE_SANITIZE=address,undefined -DQMOE_WITH_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs" -L unit

if command -v clang >/dev/null; then
  echo "== fuzz targets (bounded)"
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
        -DQMOE_FUZZ=ON -DQMOE_WITH_CUDA=OFF >/dev/null
  cmake --build build-fuzz -j"$jobs" --target fuzz_all
  ctest --test-dir build-fuzz --output-on-failure -L fuzz
fi
