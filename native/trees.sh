# Sourced by the bench and native scripts (after ROOT and BUILD are set): the two llama.cpp trees of the one pinned
# llama-cpp-python sdist. PSRC is the patched tree of `make build` (native/build.sh), SSRC the
# unpatched one of bench/build-stock.sh; `tree_src patched|stock` prints the one named.
# VERSION is the one native/build.sh pins (set there only).
VERSION=$(sed -n 's/^VERSION=//p' "$ROOT/native/build.sh")
[ -n "$VERSION" ] || { echo "trees.sh: native/build.sh sets no VERSION" >&2; exit 2; }
PSRC=$BUILD/src/llama_cpp_python-$VERSION/vendor/llama.cpp
SSRC=$BUILD/stock-src/llama_cpp_python-$VERSION/vendor/llama.cpp
tree_src() {
    case $1 in
        patched) echo "$PSRC" ;;
        stock)   echo "$SSRC" ;;
        *)       echo "trees.sh: unknown tree $1" >&2; return 2 ;;
    esac
}
# `cuda_arch` prints CMAKE_CUDA_ARCHITECTURES for a CUDA build: $CUDA_ARCH when set, else the compute
# capability of the first GPU that nvidia-smi lists (8.9 -> 89), else a list of common ones.
cuda_arch() {
    local a=${CUDA_ARCH:-}
    [ -n "$a" ] || a=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '. ' || true)
    echo "${a:-75;80;86;89;90}"
}
