#!/bin/sh
# bench/qmoe_cpu/ggml/build.sh - builds llama.cpp's ggml (CPU library only) from
# the source the llama-cpp-python sdist on PyPI carries, and the MUL_MAT_ID
# harness ggml_moe_bench.c around it, for bench/qmoe_cpu/run.py --ggml.
#
#   sh bench/qmoe_cpu/ggml/build.sh [WORKDIR]    (default /tmp/qmoe-ggml)
#
# Pinned: llama-cpp-python 0.3.16, sdist sha256 below (checked). ggml is
# configured for this CPU (GGML_NATIVE=ON: what llama.cpp users build), static,
# no OpenMP (its own thread pool), no BLAS / accelerator backends. Nothing
# from ggml is copied into this repository; the harness only calls its API.
set -eu
VER=0.3.16
SHA=34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6
W=${1:-/tmp/qmoe-ggml}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$W"
TGZ="$W/llama_cpp_python-$VER.tar.gz"
if [ ! -f "$TGZ" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$W"
fi
echo "$SHA  $TGZ" | sha256sum -c -
if [ ! -d "$W/llama_cpp_python-$VER" ]; then
    tar -xzf "$TGZ" -C "$W"
fi
G="$W/llama_cpp_python-$VER/vendor/llama.cpp/ggml"
# The sdist leaves out ggml.pc.in, which ggml's CMakeLists configures (a
# pkg-config file we do not use): an empty one lets it configure.
[ -f "$G/ggml.pc.in" ] || : >"$G/ggml.pc.in"
cmake -S "$G" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF -DGGML_BLAS=OFF \
    -DGGML_METAL=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF >"$W/cmake.log"
cmake --build "$W/build" --target ggml-cpu ggml-base -j "${JOBS:-2}" >"$W/build.log"
LIBS=$(find "$W/build" -name 'libggml-cpu.a' -o -name 'libggml-base.a' | sort -r | tr '\n' ' ')
cc -O2 -std=c11 -D_GNU_SOURCE -I"$G/include" "$HERE/ggml_moe_bench.c" $LIBS -lstdc++ -lm \
    -lpthread -o "$W/ggml_moe_bench"
echo "$W/ggml_moe_bench (llama-cpp-python $VER, sha256 $SHA)"
