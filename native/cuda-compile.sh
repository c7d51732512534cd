#!/usr/bin/env bash
# Compile the patched CUDA sources that carry the change (ggml-cuda/rope.cu: the log-n kernels;
# ggml-cuda/ggml-cuda.cu: the fusion checks) with nvcc, without a GPU and without linking.
#
#   native/cuda-compile.sh            CUDA_ARCH=90 by default (e.g. CUDA_ARCH="80;90")
#
# Needs the patched tree made by native/build.sh (make build). When the CUDA toolkit lacks the
# cuBLAS headers (common.cuh includes cublas_v2.h), they are taken from the nvidia-cublas wheel on
# the package registry (headers only; nothing is linked). Prints one line per compiled file.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
VENV=${VENV:-$ROOT/.venv}
. "$ROOT/native/trees.sh"
LLAMA=$PSRC
CUDA_ARCH=${CUDA_ARCH:-90}
CUBLAS_WHEEL_VERSION=13.10.0.20
OUT=$BUILD/cuda-compile

die() { echo "cuda-compile: error: $*" >&2; exit 2; }

command -v nvcc >/dev/null || die "nvcc not found"
[ -f "$LLAMA/ggml/src/ggml-cuda/rope.cu" ] || die "no patched tree at $LLAMA (run: make build)"
grep -q log_n_ctx_logn "$LLAMA/ggml/src/ggml-cuda/rope.cu" || die "$LLAMA is not patched"

INC=()
NVCC_INC=$(dirname "$(command -v nvcc)")/../include
if [ ! -f "$NVCC_INC/cublas_v2.h" ]; then
    HDR=$BUILD/cuda-include/nvidia/cu13/include
    if [ ! -f "$HDR/cublas_v2.h" ]; then
        echo "cuda-compile: cuBLAS headers missing from the CUDA toolkit; taking them from nvidia-cublas $CUBLAS_WHEEL_VERSION" >&2
        mkdir -p "$BUILD/dl" "$BUILD/cuda-include"
        WHL=$(ls "$BUILD"/dl/nvidia_cublas-$CUBLAS_WHEEL_VERSION-*.whl 2>/dev/null | head -n1 || true)
        if [ -z "$WHL" ]; then
            "$VENV/bin/python" -m pip download --quiet --no-deps "nvidia-cublas==$CUBLAS_WHEEL_VERSION" -d "$BUILD/dl" \
                || die "could not download nvidia-cublas $CUBLAS_WHEEL_VERSION"
            WHL=$(ls "$BUILD"/dl/nvidia_cublas-$CUBLAS_WHEEL_VERSION-*.whl | head -n1)
        fi
        (cd "$BUILD/cuda-include" && "$VENV/bin/python" -m zipfile -e "$WHL" . >/dev/null 2>&1 || true)
        [ -f "$HDR/cublas_v2.h" ] || unzip -q -o "$WHL" 'nvidia/cu13/include/*' -d "$BUILD/cuda-include"
    fi
    [ -f "$HDR/cublas_v2.h" ] || die "no cublas_v2.h"
    INC=(-I "$HDR")
fi

ARCHS=()
IFS=';' read -ra A <<< "$CUDA_ARCH"
for a in "${A[@]}"; do ARCHS+=(-gencode "arch=compute_$a,code=sm_$a"); done

mkdir -p "$OUT"
for src in rope.cu ggml-cuda.cu; do
    t0=$(date +%s)
    nvcc -std=c++17 "${ARCHS[@]}" -O3 --use_fast_math -DNDEBUG -Xcompiler -fPIC \
        -I "$LLAMA/ggml/include" -I "$LLAMA/ggml/src" -I "$LLAMA/ggml/src/ggml-cuda" "${INC[@]}" \
        -c "$LLAMA/ggml/src/ggml-cuda/$src" -o "$OUT/${src%.cu}.o" \
        || die "nvcc failed on $src"
    echo "cuda-compile: $src OK (sm_${CUDA_ARCH}, $(( $(date +%s) - t0 )) s, $(stat -c %s "$OUT/${src%.cu}.o") bytes)"
done
