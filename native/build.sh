#!/usr/bin/env bash
# Build the patched llama-cpp-python into the project's virtual environment.
#
#   native/build.sh            CPU build (default)
#   CUDA=1 native/build.sh     CUDA build (-DGGML_CUDA=on), CUDA_ARCH="90" or a list "80;86;89;90"
#
# Steps: download the pinned llama-cpp-python sdist (sha256 checked), unpack it into a scratch
# tree, apply patches/*.patch to its vendor/llama.cpp (each checked first, a clear error names the
# patch that does not apply), then pip-install it into $VENV with a persistent CMake build dir
# (build/cmake-<flavor>, ccache when present). Nothing is rebuilt when the patches, the version and
# the CMake flags are unchanged and the installed library is the patched one.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
BUILD=${BUILD:-$ROOT/build}
. "$ROOT/native/trees.sh"
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
CUDA=${CUDA:-0}

die() { echo "build: error: $*" >&2; exit 2; }
say() { echo "build: $*" >&2; }

[ -x "$PY" ] || die "no virtual environment at $VENV (run: make venv)"
command -v cmake >/dev/null || die "cmake not found (apt-get install cmake, or pip install cmake)"

CMAKE_ARGS="-DGGML_NATIVE=${GGML_NATIVE:-ON} -DGGML_RPC=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
FLAVOR=cpu
if [ "$CUDA" = 1 ]; then
    command -v nvcc >/dev/null || die "CUDA=1 but nvcc is not on PATH"
    CUDA_ARCH=$(cuda_arch)
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
    FLAVOR=cuda
fi

KEY=$( (echo "$VERSION $CMAKE_ARGS"; cat "$ROOT"/patches/*.patch) | sha256sum | cut -d' ' -f1)
STAMP=$VENV/.ggufrope-build
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && \
   "$PY" -c "import llama_cpp.llama_cpp as l; l._lib.llama_ggufrope_version" 2>/dev/null; then
    say "patched llama-cpp-python $VERSION ($FLAVOR) is up to date"
    exit 0
fi

# 1. the pinned sdist
SDIST=$BUILD/dl/llama_cpp_python-$VERSION.tar.gz
mkdir -p "$BUILD/dl"
if [ ! -f "$SDIST" ] || [ "$(sha256sum "$SDIST" | cut -d' ' -f1)" != "$SHA256" ]; then
    say "downloading llama-cpp-python $VERSION (sdist, ~77 MB)"
    rm -f "$SDIST"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD/dl" \
        || die "could not download llama-cpp-python $VERSION from the package registry"
fi
[ "$(sha256sum "$SDIST" | cut -d' ' -f1)" = "$SHA256" ] || die "sha256 mismatch for $SDIST (expected $SHA256)"

# 2. unpack and patch a scratch tree; tar keeps the archive's mtimes, so only patched files look new
SRC=$BUILD/src/llama_cpp_python-$VERSION
TMP=$BUILD/src/.tmp-$$
trap 'rm -rf "$TMP"' EXIT
rm -rf "$TMP" && mkdir -p "$TMP"
tar -xzf "$SDIST" -C "$TMP"
LLAMA=$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp
for p in "$ROOT"/patches/*.patch; do
    patch -d "$LLAMA" -p1 --forward --dry-run --quiet < "$p" >/dev/null \
        || die "patch $(basename "$p") does not apply to llama-cpp-python $VERSION (vendor/llama.cpp)"
    patch -d "$LLAMA" -p1 --forward --quiet --no-backup-if-mismatch < "$p" >/dev/null
done
# files patched now or by an earlier series must look newer than their objects
PATCHED=$(grep -h '^+++ b/' "$ROOT"/patches/*.patch | sed 's|^+++ b/||' | sort -u)
OLD_PATCHED=$(cat "$BUILD/src/.patched-files" 2>/dev/null || true)
for f in $PATCHED $OLD_PATCHED; do
    [ -f "$LLAMA/$f" ] && touch "$LLAMA/$f"
done
rm -rf "$SRC" && mv "$TMP/llama_cpp_python-$VERSION" "$SRC"
echo "$PATCHED" > "$BUILD/src/.patched-files"

# 3. build and install
say "building patched llama-cpp-python $VERSION ($FLAVOR): $CMAKE_ARGS"
"$PY" -m pip install --quiet "scikit-build-core>=0.9" >/dev/null
CMAKE_ARGS="$CMAKE_ARGS" "$PY" -m pip install --no-build-isolation --force-reinstall --no-cache-dir \
    -C build-dir="$BUILD/cmake-$FLAVOR" "$SRC" \
    || die "pip install of the patched llama-cpp-python failed (see the output above)"

V=$("$PY" -c "import llama_cpp.llama_cpp as l; f = l._lib.llama_ggufrope_version; f.restype = __import__('ctypes').c_char_p; print(f().decode())") \
    || die "the installed llama_cpp library is not the patched one"
echo "$KEY" > "$STAMP"
say "installed patched llama-cpp-python $VERSION ($FLAVOR), ggufrope patch $V"
