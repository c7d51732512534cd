#!/usr/bin/env bash
# Build llama.cpp's test-backend-ops from the patched tree (made by native/build.sh) and run it for
# the rope ops: ROPE (upstream's cases plus the ggufrope ones: NTK-family tables, log-n, positions
# < 512 and < 65536) and ROPE_SET_ROWS (the CUDA fusion).
#
#   native/test-backend-ops.sh [args...]     CPU build (CPU is the reference: nothing to compare)
#   CUDA=1 native/test-backend-ops.sh        CUDA build: every case is compared CUDA vs CPU
#
# Extra args go to test-backend-ops (e.g. "perf" for the rope micro-benchmark: MODE=perf).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
. "$ROOT/native/trees.sh"
LLAMA=$PSRC
CUDA=${CUDA:-0}
MODE=${MODE:-test}

die() { echo "test-backend-ops: error: $*" >&2; exit 2; }
[ -f "$LLAMA/tests/test-backend-ops.cpp" ] || die "no patched tree at $LLAMA (run: make build)"
grep -q test_rope_ntk "$LLAMA/tests/test-backend-ops.cpp" || die "$LLAMA lacks the ggufrope test cases (patches/0003)"

ARGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF)
FLAVOR=cpu
if [ "$CUDA" = 1 ]; then
    ARGS+=(-DGGML_CUDA=on "-DCMAKE_CUDA_ARCHITECTURES=$(cuda_arch)")
    FLAVOR=cuda
fi
OUT=$BUILD/cmake-tests-$FLAVOR
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$LLAMA" -B "$OUT" "${GEN[@]}" "${ARGS[@]}" >/dev/null
cmake --build "$OUT" --target test-backend-ops -j "$(nproc)"

BIN=$OUT/bin/test-backend-ops
status=0
for op in ROPE ROPE_SET_ROWS; do
    echo "== test-backend-ops $MODE -o $op $*"
    "$BIN" "$MODE" -o "$op" "$@" || status=1
done
exit $status
