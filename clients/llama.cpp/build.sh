#!/usr/bin/env bash
# build.sh PREFIX - llama.cpp with the routed experts of its MoE layers served
# by qmoed (docs/ENGINES.md, "llama.cpp").
#
# Downloads the llama-cpp-python sdist from PyPI (it vendors llama.cpp),
# checks its sha256, applies llama.cpp.patch and copies src/llama-qmoed.*
# into the tree, builds against the libqmoe-client that pkg-config finds
# (`qmoe-client`, honouring PKG_CONFIG_PATH: a `cmake --install` prefix or
# the .deb), and installs the tools under PREFIX/bin and llama.cpp's
# converter (convert_hf_to_gguf.py, conversion/, gguf-py/) under
# PREFIX/share/qmoed-llama.cpp. The sdist, the patched tree and the build
# live in a cache outside the clone ($QMOE_LLAMA_CACHE, default
# /var/cache/qmoed/llama.cpp, or ~/.cache/qmoed/llama.cpp when that cannot
# be written), so a machine builds once and later runs only relink or
# recompile what changed. Idempotent; concurrent runs wait on a lock.
set -euo pipefail

SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CPP_COMMIT=0c1e57098 # what llama-cpp-python 0.3.36 vendors (its CHANGELOG)
# GCC 12 with -march=native on a CPU with AMX miscompiles ggml's AMX path
# (_tile_loadconfig stores 8 of the tile configuration's 64 bytes; every run
# dies in ldtilecfg): never let -march=native turn AMX on.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
TOOLS="llama-completion llama-server llama-bench llama-quantize llama-simple llama-debug"

here=$(cd "$(dirname "$0")" && pwd)
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 PREFIX   (installs PREFIX/bin/llama-completion, llama-server, ...)" >&2
  exit 2
fi
mkdir -p "$1"
prefix=$(cd "$1" && pwd)

cache=${QMOE_LLAMA_CACHE:-}
if [ -z "$cache" ]; then
  cache=/var/cache/qmoed/llama.cpp
  if ! mkdir -p "$cache" 2>/dev/null || [ ! -w "$cache" ]; then
    cache="$HOME/.cache/qmoed/llama.cpp"
  fi
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

say() { echo "llama.cpp build: $*"; }

# 1. The sdist, checked.
tarball="$cache/llama_cpp_python-$SDIST_VERSION.tar.gz"
if [ ! -f "$tarball" ] || [ "$(sha256sum "$tarball" | cut -d' ' -f1)" != "$SDIST_SHA256" ]; then
  rm -f "$tarball"
  dl=$(mktemp -d "$cache/dl.XXXXXX")
  py=${QMOE_PYTHON:-python3}
  say "downloading llama-cpp-python $SDIST_VERSION (sdist) from PyPI"
  if ! "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$SDIST_VERSION" -d "$dl"; then
    rm -rf "$dl"
    echo "llama.cpp build: cannot download the llama-cpp-python $SDIST_VERSION sdist (pip download" \
         "failed; no network?) and $tarball is not cached" >&2
    exit 3
  fi
  mv "$dl/llama_cpp_python-$SDIST_VERSION.tar.gz" "$tarball"
  rm -rf "$dl"
fi
got=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ "$got" != "$SDIST_SHA256" ]; then
  echo "llama.cpp build: $tarball has sha256 $got, not the pinned $SDIST_SHA256" >&2
  exit 1
fi

# 2. The patched tree: one per sdist, so a changed patch recompiles only what
# it changes. A fresh copy is patched aside and only the files whose content
# differs (those of the old and the new patch, qmoed's own sources) are
# copied over; everything else keeps its timestamps.
work="$cache/llama.cpp-$SDIST_VERSION"
src="$work/src"
mkdir -p "$work"
patch_files() { sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p; s|^--- a/\([^[:space:]]*\).*|\1|p' "$1" | sort -u; }
if [ ! -f "$work/applied.patch" ] || ! cmp -s "$here/llama.cpp.patch" "$work/applied.patch" || [ ! -d "$src" ]; then
  say "unpacking and patching llama.cpp ($LLAMA_CPP_COMMIT) into $src"
  rm -rf "$src.new"
  mkdir -p "$src.new"
  tar -xzf "$tarball" -C "$src.new" --strip-components=3 \
    "llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp"
  rm -f "$src.new/.git" # the sdist's submodule pointer leads nowhere
  patch -d "$src.new" -p1 --forward --quiet < "$here/llama.cpp.patch"
  if [ ! -d "$src" ] || [ ! -f "$work/applied.patch" ]; then
    rm -rf "$src"
    mv "$src.new" "$src"
  else
    for f in $( { patch_files "$work/applied.patch"; patch_files "$here/llama.cpp.patch"; } | sort -u); do
      if ! cmp -s "$src.new/$f" "$src/$f"; then
        mkdir -p "$(dirname "$src/$f")"
        cp "$src.new/$f" "$src/$f"
      fi
    done
    rm -rf "$src.new"
  fi
  cp "$here/llama.cpp.patch" "$work/applied.patch"
fi
for f in llama-qmoed.h llama-qmoed.cpp; do
  cmp -s "$here/src/$f" "$src/src/$f" || cp "$here/src/$f" "$src/src/$f"
done

# 3. libqmoe-client. The static library and header are copied into the
# cache under their hash, so reinstalling the same client (a new temporary
# prefix per test run) relinks nothing.
if ! pkg-config --exists qmoe-client; then
  echo "llama.cpp build: pkg-config cannot find qmoe-client (install qmoed's client library, or point" \
       "PKG_CONFIG_PATH at PREFIX/lib/pkgconfig of a 'cmake --install' of qmoed)" >&2
  exit 1
fi
libdir=$(pkg-config --variable=libdir qmoe-client)
incdir=$(pkg-config --variable=includedir qmoe-client)
if [ ! -f "$incdir/qmoe_client.h" ]; then
  echo "llama.cpp build: qmoe-client's includedir $incdir has no qmoe_client.h" >&2
  exit 1
fi
deps=""
for f in $(pkg-config --static --libs qmoe-client); do
  [ "$f" = "-lqmoe-client" ] || deps="$deps;$f"
done
if [ -f "$libdir/libqmoe-client.a" ]; then
  csum=$(cat "$incdir/qmoe_client.h" "$libdir/libqmoe-client.a" | sha256sum | cut -c1-16)
  client="$cache/qmoe-client-$csum"
  if [ ! -d "$client" ]; then
    mkdir -p "$client.tmp/include" "$client.tmp/lib"
    cp "$incdir/qmoe_client.h" "$client.tmp/include/"
    cp "$libdir/libqmoe-client.a" "$client.tmp/lib/"
    rm -rf "$client"
    mv "$client.tmp" "$client"
  fi
  client_inc="$client/include"
  client_libs="$client/lib/libqmoe-client.a$deps"
else
  client_inc="$incdir"
  client_libs="-L$libdir;-lqmoe-client;-Wl,-rpath,$libdir$deps"
fi

# 4. Configure and build only the tools that get installed.
build="$work/build"
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
jobs=${QMOE_LLAMA_JOBS:-$(nproc)}
t0=$(date +%s)
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DQMOED_CLIENT_INCLUDE_DIR="$client_inc" -DQMOED_CLIENT_LIBRARIES="$client_libs" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build" -j"$jobs" --target $TOOLS >"$build.log" 2>&1 ||
  { tail -n 60 "$build.log" >&2; echo "llama.cpp build: failed; the whole log is $build.log" >&2; exit 1; }
tools=$TOOLS
# llama-cli links the whole server; installed when it builds.
if cmake --build "$build" -j"$jobs" --target llama-cli >>"$build.log" 2>&1; then
  tools="$tools llama-cli"
else
  say "llama-cli did not build (see $build.log); the other tools are installed"
fi

# 5. Install.
mkdir -p "$prefix/bin" "$prefix/share/qmoed-llama.cpp"
for t in $tools; do
  install -m 0755 "$build/bin/$t" "$prefix/bin/$t"
done
share="$prefix/share/qmoed-llama.cpp"
install -m 0644 "$src/convert_hf_to_gguf.py" "$share/"
rm -rf "$share/conversion" "$share/gguf-py"
cp -r "$src/conversion" "$src/gguf-py" "$share/"
printf 'llama-cpp-python %s (sha256 %s), ggml-org/llama.cpp@%s, patched by qmoed; CFLAGS %s\n' \
  "$SDIST_VERSION" "$SDIST_SHA256" "$LLAMA_CPP_COMMIT" "$NO_AMX" >"$share/VERSION"
say "installed $tools in $prefix/bin ($(( $(date +%s) - t0 )) s; cache $cache)"
