#!/usr/bin/env bash
# Build the patched llama.cpp tools from the tree native/build.sh patched, into build/tools/bin:
#   llama-server  llama-cli  llama-perplexity  llama-bench  ggml-rpc-server (llama.cpp's rpc-server)
#
#   native/tools.sh              CPU build (default)
#   CUDA=1 native/tools.sh       CUDA build (-DGGML_CUDA=on), CUDA_ARCH as for native/build.sh
#   UI=1 native/tools.sh         also build llama-server's web UI from its sources in the tree
#                                (tools/ui: npm ci + npm run build; needs node, npm and the npm registry)
#
# Static binaries (no dependency on the Python package's shared libraries), one persistent CMake build
# directory per flavor (build/cmake-tools-<flavor>): after a patch change only the files it touches and
# their dependents are recompiled. Without UI=1 the server is built without its web UI (the HTTP API,
# OpenAI-compatible, is complete); nothing is downloaded (no prebuilt UI).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
. "$ROOT/native/trees.sh"
LLAMA=$PSRC
CUDA=${CUDA:-0}
UI=${UI:-0}
TOOLS=(llama-server llama-cli llama-perplexity llama-bench ggml-rpc-server)

die() { echo "tools: error: $*" >&2; exit 2; }
say() { echo "tools: $*" >&2; }

[ -f "$LLAMA/CMakeLists.txt" ] || die "no patched tree at $LLAMA (run: make build)"
grep -q ggml_rope_set_logn "$LLAMA/ggml/include/ggml.h" || die "$LLAMA is not patched (run: make build)"

ARGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE="${GGML_NATIVE:-ON}" -DGGML_RPC=ON
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF
      -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
FLAVOR=cpu
if [ "$CUDA" = 1 ]; then
    command -v nvcc >/dev/null || die "CUDA=1 but nvcc is not on PATH"
    ARGS+=(-DGGML_CUDA=on "-DCMAKE_CUDA_ARCHITECTURES=$(cuda_arch)")
    FLAVOR=cuda
fi
if [ "$UI" = 1 ]; then
    command -v npm >/dev/null || die "UI=1 needs npm (and node) on PATH"
    ARGS+=(-DLLAMA_BUILD_UI=ON)
else
    ARGS+=(-DLLAMA_BUILD_UI=OFF)
fi

OUT=$BUILD/cmake-tools-$FLAVOR
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
say "configuring $OUT ($FLAVOR, $([ "$UI" = 1 ] && echo "with the web UI" || echo "no web UI"))"
cmake -S "$LLAMA" -B "$OUT" "${GEN[@]}" "${ARGS[@]}" >"$BUILD/cmake-tools-$FLAVOR.configure.log" 2>&1 \
    || { tail -n 30 "$BUILD/cmake-tools-$FLAVOR.configure.log" >&2; die "cmake configure failed (log: $BUILD/cmake-tools-$FLAVOR.configure.log)"; }
t0=$(date +%s)
cmake --build "$OUT" --target "${TOOLS[@]}" -j "$(nproc)" || die "build failed (see the output above)"
mkdir -p "$BUILD/tools/bin"
for t in "${TOOLS[@]}"; do
    cp -f "$OUT/bin/$t" "$BUILD/tools/bin/$t.tmp" && mv -f "$BUILD/tools/bin/$t.tmp" "$BUILD/tools/bin/$t"
done
say "patched tools ($FLAVOR) in $BUILD/tools/bin: ${TOOLS[*]} ($(( $(date +%s) - t0 )) s)"
