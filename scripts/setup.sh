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

pkgs="build-essential cmake pkg-config libuv1-dev libcjson-dev check clang libclang-rt-dev valgrind
      python3 python3-venv python3-pip redis-server redis-tools"
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
