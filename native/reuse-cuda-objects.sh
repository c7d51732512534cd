#!/usr/bin/env bash
# CMAKE_CUDA_COMPILER_LAUNCHER for the stock CUDA build of native/gpu-lent.sh: a CUDA source that is
# the same file in the stock and the patched tree (all but $REUSE_EXCEPT, the ones the patch series
# changes) compiles to the same object in both, since the patch adds only declarations to the
# headers they include (ggml.h: ggml_rope_set_logn; ggml-backend-impl.h:
# ggml_backend_dev_rope_logn); so its object is copied from the patched build ($REUSE_FROM) instead
# of compiled again (the patched build's CUDA part took most of an hour on a 2-core machine).
# Every other compile runs as given.
#   REUSE_FROM=DIR REUSE_EXCEPT="ggml-cuda.cu rope.cu" native/reuse-cuda-objects.sh nvcc ARGS...
set -u
src="" out="" dep=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        -c) src=${args[i + 1]} ;;
        -o) out=${args[i + 1]} ;;
        -MF) dep=${args[i + 1]} ;;
    esac
done
base=$(basename "$src")
if [ -n "$src" ] && [ -n "$out" ] && [[ " ${REUSE_EXCEPT:-} " != *" $base "* ]] && [ -f "${REUSE_FROM:-/nonexistent}/$out" ] \
   && cmp -s "$src" "$REUSE_SRC/${src#"$STOCK_SRC"/}"; then
    cp "$REUSE_FROM/$out" "$out" && { [ -z "$dep" ] || echo "$out: $src" > "$dep"; } && exit 0
fi
exec "$@"
