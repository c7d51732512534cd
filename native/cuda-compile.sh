#!/usr/bin/env bash
# Compile the patched CUDA sources that carry the log-n change with nvcc and run what can run
# without a GPU (no device and no CUDA driver are needed):
#
#   ggml-cuda/rope.cu (the log-n kernels)  -> $OUT/rope.o for sm_$CUDA_ARCH, and the PTX the kernels
#       were compiled from, $OUT/rope.compute_<arch>.ptx: tests/test_cuda_compile.py reads the
#       rope_norm / rope_neox parameter lists and what the kernels do with the log-n parameter
#   ggml-cuda/ggml-cuda.cu (the fusion checks), compiled inside native/cuda_fusion_check.cu (which
#       includes it and adds a main), linked against the installed libggml-base / libggml-cpu and run:
#       the backend's own ggml_cuda_can_fuse() decides RMS_NORM+MUL+ROPE(+VIEW+SET_ROWS) and
#       ROPE+VIEW+SET_ROWS graphs with and without log-n ($OUT/cuda_fusion_check.txt). The rest of the
#       CUDA backend stays unresolved at link time (-no-pie, --unresolved-symbols=ignore-all) and is
#       never called.
#
#   native/cuda-compile.sh            CUDA_ARCH=90 by default (e.g. CUDA_ARCH="80;90")
#   LLAMA_TREE=DIR CUDA_COMPILE_OUT=DIR native/cuda-compile.sh   another llama.cpp tree / output dir
#                                     (default: the patched tree of make build, build/cuda-compile)
#
# Needs the patched tree and library made by native/build.sh (make build). When the CUDA toolkit
# lacks the cuBLAS headers (common.cuh includes cublas_v2.h), they are taken from the nvidia-cublas
# wheel on the package registry (headers only; nothing is linked). Prints one line per step. Exit
# status: 0 ok, 1 a fusion decision is not the expected one (the outputs are all there), 2 an error.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
VENV=${VENV:-$ROOT/.venv}
. "$ROOT/native/trees.sh"
LLAMA=${LLAMA_TREE:-$PSRC}
CUDA_ARCH=${CUDA_ARCH:-90}
CUBLAS_WHEEL_VERSION=13.1.1.3
OUT=${CUDA_COMPILE_OUT:-$BUILD/cuda-compile}

die() { echo "cuda-compile: error: $*" >&2; exit 2; }

command -v nvcc >/dev/null || die "nvcc not found"
[ -f "$LLAMA/ggml/src/ggml-cuda/rope.cu" ] || die "no patched tree at $LLAMA (run: make build)"
LIB=$("$VENV/bin/python" -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')") \
    || die "llama_cpp is not installed in $VENV (run: make build)"

INC=()
NVCC_INC=$(dirname "$(command -v nvcc)")/../include
if [ ! -f "$NVCC_INC/cublas_v2.h" ]; then
    HDR=$BUILD/cuda-include/nvidia/cu13/include
    if [ ! -f "$HDR/cublas_v2.h" ]; then
        echo "cuda-compile: cuBLAS headers missing from the CUDA toolkit; taking them from nvidia-cublas $CUBLAS_WHEEL_VERSION" >&2
        mkdir -p "$BUILD" && DL=$(mktemp -d "$BUILD/cublas-dl.XXXXXX")
        "$VENV/bin/python" -m pip download --quiet --no-deps "nvidia-cublas==$CUBLAS_WHEEL_VERSION" -d "$DL" \
            || { rm -rf "$DL"; die "could not download nvidia-cublas $CUBLAS_WHEEL_VERSION"; }
        # the headers only (about 1 MB of a 400 MB wheel); the wheel is not kept
        "$VENV/bin/python" - "$DL"/nvidia_cublas-*.whl "$BUILD/cuda-include" <<'PY' || { rm -rf "$DL"; die "could not unpack the cuBLAS headers"; }
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("nvidia/cu13/include/")])
PY
        rm -rf "$DL"
    fi
    [ -f "$HDR/cublas_v2.h" ] || die "no cublas_v2.h"
    INC=(-I "$HDR")
fi

ARCHS=()
IFS=';' read -ra A <<< "$CUDA_ARCH"
for a in "${A[@]}"; do ARCHS+=(-gencode "arch=compute_$a,code=sm_$a"); done

NVCC=(nvcc -std=c++17 "${ARCHS[@]}" -O3 --use_fast_math -DNDEBUG -Xcompiler -fPIC
      -I "$LLAMA/ggml/include" -I "$LLAMA/ggml/src" -I "$LLAMA/ggml/src/ggml-cuda" "${INC[@]}")

mkdir -p "$OUT"
rm -f "$OUT"/rope.o "$OUT"/rope.*.ptx "$OUT"/cuda_fusion_check "$OUT"/cuda_fusion_check.o "$OUT"/cuda_fusion_check.txt
KEEP=$(mktemp -d "$OUT/keep.XXXXXX")
trap 'rm -rf "$KEEP"' EXIT

# 1. rope.cu, keeping the PTX (one file per arch; nvcc names it rope.ptx when there is one arch)
t0=$(date +%s)
"${NVCC[@]}" --keep --keep-dir "$KEEP" -c "$LLAMA/ggml/src/ggml-cuda/rope.cu" -o "$OUT/rope.o" || die "nvcc failed on rope.cu"
if [ "${#A[@]}" = 1 ]; then
    cp "$KEEP/rope.ptx" "$OUT/rope.compute_${A[0]}.ptx"
else
    for a in "${A[@]}"; do cp "$KEEP/rope.compute_$a.ptx" "$OUT/"; done
fi
echo "cuda-compile: rope.cu OK (sm_${CUDA_ARCH}, $(( $(date +%s) - t0 )) s, $(stat -c %s "$OUT/rope.o") bytes, PTX kept)"

# 2. ggml-cuda.cu inside the fusion check, linked and run on the host
t0=$(date +%s)
"${NVCC[@]}" -c "$ROOT/native/cuda_fusion_check.cu" -o "$OUT/cuda_fusion_check.o" \
    || die "nvcc failed on ggml-cuda.cu (in native/cuda_fusion_check.cu)"
echo "cuda-compile: ggml-cuda.cu OK (sm_${CUDA_ARCH}, in native/cuda_fusion_check.cu, $(( $(date +%s) - t0 )) s)"
nvcc -o "$OUT/cuda_fusion_check" "$OUT/cuda_fusion_check.o" -L "$LIB" -lggml-base -lggml-cpu \
    -Xcompiler -no-pie -Xlinker --unresolved-symbols=ignore-all -Xlinker -rpath,"$LIB" \
    || die "could not link native/cuda_fusion_check.cu"
"$OUT/cuda_fusion_check" > "$OUT/cuda_fusion_check.txt" 2>&1 || {
    cat "$OUT/cuda_fusion_check.txt" >&2
    echo "cuda-compile: error: the CUDA fusion decisions are not the expected ones (native/cuda_fusion_check.cu)" >&2
    exit 1
}
echo "cuda-compile: fusion decisions OK ($(grep -c '^ok: ' "$OUT/cuda_fusion_check.txt") cases, $OUT/cuda_fusion_check.txt)"
