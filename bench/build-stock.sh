#!/usr/bin/env bash
# Build the UNPATCHED llama.cpp of the same pinned llama-cpp-python sdist (shared libraries, the
# flags native/build.sh uses) into build/stock-lib, for side-by-side benchmarks: point
# llama-cpp-python at it with LLAMA_CPP_LIB_PATH=build/stock-lib. Also builds its ggml-rpc-server into
# build/stock-bin (the RPC tests: an unpatched server must be declined) and, when WITH_TESTS=1, its
# test-backend-ops (the rope micro-benchmark). CUDA=1: a CUDA build (CUDA_ARCH as for native/build.sh), for
# the GPU runtime comparison (bench/runtime_cost.py -ngl -1).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
. "$ROOT/native/trees.sh"
SDIST=$BUILD/dl/llama_cpp_python-$VERSION.tar.gz
[ -f "$SDIST" ] || { echo "build-stock: error: $SDIST missing (run: make build)" >&2; exit 2; }
SRC=$BUILD/stock-src
if [ ! -f "$SSRC/CMakeLists.txt" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && tar -xzf "$SDIST" -C "$SRC"
fi
LLAMA=$SSRC
if grep -q ggml_rope_set_logn "$LLAMA/ggml/include/ggml.h"; then
    echo "build-stock: error: $LLAMA is patched" >&2; exit 2
fi
TESTS=${WITH_TESTS:-0}
CUDA_ARGS=(); CMAKE_DIR=$BUILD/cmake-stock
if [ "${CUDA:-0}" = 1 ]; then
    command -v nvcc >/dev/null || { echo "build-stock: error: CUDA=1 but nvcc is not on PATH" >&2; exit 2; }
    CUDA_ARGS=(-DGGML_CUDA=on "-DCMAKE_CUDA_ARCHITECTURES=$(cuda_arch)"); CMAKE_DIR=$BUILD/cmake-stock-cuda
fi
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$CMAKE_DIR" "${GEN[@]}" "${CUDA_ARGS[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_BUILD_TESTS=$([ "$TESTS" = 1 ] && echo ON || echo OFF) -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF >/dev/null
TARGETS=(--target llama ggml ggml-rpc-server)
[ "$TESTS" = 1 ] && TARGETS+=(test-backend-ops)
cmake --build "$CMAKE_DIR" "${TARGETS[@]}" -j "$(nproc)"
mkdir -p "$BUILD/stock-lib"
cp -a "$CMAKE_DIR"/bin/lib*.so* "$BUILD/stock-lib/"
mkdir -p "$BUILD/stock-bin"
cp -f "$CMAKE_DIR/bin/ggml-rpc-server" "$BUILD/stock-bin/ggml-rpc-server"
echo "build-stock: unpatched llama.cpp ($VERSION) in $BUILD/stock-lib"
