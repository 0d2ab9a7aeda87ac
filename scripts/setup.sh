#!/usr/bin/env bash
# Installs what building and testing qmoed needs. Idempotent; as root or with sudo.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "setup: not root and no sudo; install the packages in scripts/setup.sh by hand" >&2
  fi
fi

pkgs="build-essential cmake pkg-config libuv1-dev libcjson-dev liburing-dev check clang
      libclang-rt-dev valgrind python3 python3-venv python3-pip redis-server redis-tools fio abigail-tools"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "setup: installing$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

# Python side: the onnxruntime oracle, converters, the Python client's tests.
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.requirements.stamp"
if [ ! -f "$stamp" ] || ! cmp -s "$here/tools/requirements.txt" "$stamp"; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/tools/requirements.txt"
  cp "$here/tools/requirements.txt" "$stamp"
fi

# torch + transformers for the transformers hook (tests/clients/
# test_transformers_hook.py, examples/generate.py): a venv of its own outside
# the repo, so every clone and every CI run reuses it ($QMOE_TORCH_VENV;
# /var/cache/qmoed/venv-torch, or ~/.cache/qmoed/venv-torch when that cannot
# be written). The tests need no GPU. QMOE_SKIP_TORCH=1 skips it.
if [ "${QMOE_SKIP_TORCH:-0}" != 1 ]; then
  torch_venv="${QMOE_TORCH_VENV:-}"
  if [ -z "$torch_venv" ]; then
    torch_venv=/var/cache/qmoed/venv-torch
    if ! { $SUDO mkdir -p /var/cache/qmoed && $SUDO chown "$(id -u):$(id -g)" /var/cache/qmoed; } \
        2>/dev/null; then
      torch_venv="$HOME/.cache/qmoed/venv-torch"
    fi
  fi
  torch_reqs="$here/tools/requirements-torch.txt"
  tstamp="$torch_venv/.requirements.stamp"
  if [ ! -f "$tstamp" ] || ! cmp -s "$torch_reqs" "$tstamp"; then
    t0=$(date +%s)
    mkdir -p "$(dirname "$torch_venv")"
    [ -x "$torch_venv/bin/python" ] || python3 -m venv "$torch_venv"
    # PyPI's torch (CUDA-enabled on x86_64, a few GB; it runs on the CPU,
    # which is all the tests need). About 5.5 minutes the first time.
    "$torch_venv/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.5"
    "$torch_venv/bin/python" -m pip install -q --disable-pip-version-check -r "$torch_reqs"
    cp "$torch_reqs" "$tstamp"
    echo "setup: torch environment at $torch_venv ready in $(( $(date +%s) - t0 )) s"
  fi
  echo "setup: export QMOE_TORCH_VENV=$torch_venv for the transformers hook's tests"
fi
