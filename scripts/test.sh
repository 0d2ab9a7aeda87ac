#!/usr/bin/env bash
# The full test suite: the release build's tests, a valgrind memcheck slice
# of the abuse suite, the unit tests again under AddressSanitizer +
# UndefinedBehaviorSanitizer and the daemon's integration suites against the
# sanitized qmoed, then the fuzz targets for a bounded time. Everything CI
# runs.
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

# Valgrind memcheck of the release qmoed under a slice of the abuse suite:
# any error or definitely-lost block makes qmoed exit 99, which the suite's
# fixture fails on; the logs are checked here too.
if command -v valgrind >/dev/null; then
  echo "== valgrind memcheck: release qmoed + abuse subset"
  vg_logs=$(mktemp -d)
  QMOE_BUILD_DIR="$here/build" QMOE_HARDENING_SLOW=10 QMOE_HARDENING_RSS_SLACK_MB=200 \
    QMOED_WRAP="valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite --log-file=$vg_logs/vg.%p" \
    python -m pytest -q -p no:cacheprovider tests/hardening/test_abuse.py \
      -k "nesting or utf8 or numbers or shape_products or base64 or duplicate_keys or batches or half_close or reset_in"
  ls "$vg_logs"/vg.* >/dev/null
  if grep -L "ERROR SUMMARY: 0 errors" "$vg_logs"/vg.* | grep -q .; then
    echo "valgrind reported errors:" >&2; cat "$vg_logs"/vg.* >&2; exit 1
  fi
  rm -rf "$vg_logs"
fi

echo "== ASan+UBSan build + unit tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DQMOE_WERROR=ON \
      -DQMOE_SANITIZE=address,undefined -DQMOE_WITH_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j"$jobs" -L unit

# The daemon's integration suites against the sanitized qmoed. A report
# aborts the daemon (-fno-sanitize-recover, abort_on_error) and also lands in
# $san_logs, which must stay empty: that catches a daemon whose exit status a
# test does not look at.
echo "== ASan+UBSan qmoed + integration subset"
san_logs=$(mktemp -d)
QMOE_HARDENING_SLOW=3 QMOE_HARDENING_RSS_SLACK_MB=400 \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:log_path=$san_logs/asan \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$san_logs/ubsan \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" \
        -R '^(test_qmoed|test_client_live|test_qmoectl|hardening_.*)$' || san_rc=$?
if [ -n "$(ls -A "$san_logs")" ]; then
  echo "sanitizer reports:" >&2; cat "$san_logs"/* >&2; exit 1
fi
rm -rf "$san_logs"
[ "${san_rc:-0}" = 0 ] || exit "$san_rc"

if command -v clang >/dev/null; then
  echo "== fuzz targets (bounded)"
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
        -DQMOE_FUZZ=ON -DQMOE_WITH_CUDA=OFF >/dev/null
  cmake --build build-fuzz -j"$jobs" --target fuzz_all
  ctest --test-dir build-fuzz --output-on-failure -L fuzz
fi
