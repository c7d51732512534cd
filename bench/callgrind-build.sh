#!/usr/bin/env bash
# Builds ggml (only) twice without AVX-512 -- the patched tree of `make build` and the unpatched
# tree of bench/build-stock.sh -- so that valgrind (which has no AVX-512) can count the rope op's
# instructions: GGML_NATIVE=OFF with AVX2/FMA/F16C/BMI2, no OpenMP, same flags for both.
# Output: build/callgrind/{patched,stock}/bin/libggml*.so, used by bench/rope_op_callgrind.sh;
# with BUILD_LLAMA=1 also libllama.so, used by bench/decode_callgrind.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
JOBS=${JOBS:-$(nproc)}
. "$ROOT/native/trees.sh"
LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
for flavor in patched stock; do
    SRC=$(tree_src $flavor)
    [ -f "$SRC/ggml/CMakeLists.txt" ] || { echo "callgrind-build: error: $SRC missing (make build; bench/build-stock.sh)" >&2; exit 2; }
    # the whole tree is configured (the sdist's ggml/ cannot stand alone), only ggml is built
    cmake -S "$SRC" -B "$BUILD/callgrind/$flavor" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX512=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        "${LAUNCHER[@]}" > "$BUILD/callgrind/$flavor.cmake.log"
    cmake --build "$BUILD/callgrind/$flavor" -j "$JOBS" --target ggml ggml-base ggml-cpu ${BUILD_LLAMA:+llama} > "$BUILD/callgrind/$flavor.build.log"
    echo "built $BUILD/callgrind/$flavor"
done
