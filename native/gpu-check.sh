#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: prove the patch on it and print a short report.
#
#   native/gpu-check.sh
#
# 1. make build CUDA=1 (the GPU's architecture, from nvidia-smi)
# 2. test-backend-ops -o ROPE / ROPE_SET_ROWS, CUDA vs CPU (native/test-backend-ops.sh)
# 3. the tiny-model reference tests with every layer on the GPU (GGUFROPE_TEST_NGL=99)
# 4. SmolLM2-135M-Instruct with ntk-mixed + log-n, every layer on the GPU, greedy, at n_ctx 16384
#    and 32768; the first 32 tokens at 16384 are compared with a CPU run of the same prompt
# The report goes to stdout and build/gpu-check/report.txt.
#
# On a lent machine that cannot build (no network for the sdist, minutes of device time), the CUDA
# libraries can be cross-built elsewhere (native/gpu-lent.sh says how) and given here:
#   PREBUILT=DIR    skip step 1: the Python package already loads DIR's patched CUDA libllama and
#                   libggml*, and DIR/test-backend-ops is the patched tree's, built with them
#   STEPS="2 3"     run only these steps (default "1 2 3 4"); REPORT=FILE another report file
#   CPU_REF=DIR     DIR/gen-cpu-16384.txt, gen-cpu-32768.txt: the same greedy runs on a CPU build of
#                   another machine, compared with the GPU's too
#   PY=python       the interpreter (default .venv/bin/python)
#
#   native/gpu-check.sh --inputs DIR   (no GPU needed) only write step 4's inputs to DIR: the set
#                   file smollm2-mixed-logn.gguf and prompt-16384.txt, prompt-32768.txt
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-.venv/bin/python}

# step 4's inputs (also native/gpu-lent.sh cpuref's, for its CPU reference runs)
inputs() {
    local model
    model=$($PY -m ggufrope.models) || return 1
    $PY -m ggufrope set "$model" --method mixed --b 0.625 --logn -o "$1/smollm2-mixed-logn.gguf" > /dev/null || return 1
    $PY - "$1" <<'PYEOF'
import sys
from ggufrope.corpus import demo_text, load_text
out = sys.argv[1]
open(f"{out}/prompt-16384.txt", "w").write(demo_text())                        # ~12,500 tokens
open(f"{out}/prompt-32768.txt", "w").write(load_text("areopagitica"))          # ~24,400 tokens
PYEOF
}
if [ "${1:-}" = --inputs ]; then
    [ -n "${2:-}" ] && mkdir -p "$2" || { echo "usage: native/gpu-check.sh --inputs DIR" >&2; exit 2; }
    inputs "$2" || { echo "gpu-check: error: could not write step 4's inputs" >&2; exit 1; }
    exit 0
fi

OUT=build/gpu-check
mkdir -p "$OUT"
REPORT=${REPORT:-$OUT/report.txt}
: > "$REPORT"
STEPS=" ${STEPS:-1 2 3 4} "
step() { [[ $STEPS == *" $1 "* ]]; }
say() { echo "$*" | tee -a "$REPORT"; }

nvidia-smi -L >/dev/null 2>&1 || { echo "gpu-check: error: no NVIDIA GPU (nvidia-smi -L failed)" >&2; exit 2; }
say "# ggufrope GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
say "GPU: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -n1)"
say "nvcc: $(nvcc --version | tail -n1)"

# 1. build
if [ -n "${PREBUILT:-}" ]; then
    say "build: prebuilt in $PREBUILT; the Python package loads $($PY -c 'import llama_cpp.llama_cpp as l; print(l._lib._name)')"
elif step 1; then
    if ! make build CUDA=1 > "$OUT/build.log" 2>&1; then
        say "build: FAILED (see $OUT/build.log)"; tail -n 30 "$OUT/build.log"; exit 1
    fi
    say "build: $(tail -n1 "$OUT/build.log")"
fi

# 2. test-backend-ops
if step 2; then
    if [ -n "${PREBUILT:-}" ]; then
        ( st=0; for op in ROPE ROPE_SET_ROWS; do
              echo "== test-backend-ops test -o $op -b CUDA0"; timeout 300 "$PREBUILT/test-backend-ops" test -o $op -b CUDA0 || st=1
          done; exit $st ) > "$OUT/test-backend-ops.log" 2>&1
    else
        CUDA=1 native/test-backend-ops.sh -b CUDA0 > "$OUT/test-backend-ops.log" 2>&1
    fi
    tbo=$?
    say "test-backend-ops (exit $tbo):"
    grep -E "tests passed|Backend CUDA0|FAIL" "$OUT/test-backend-ops.log" | sort | uniq -c | head -n 20 | tee -a "$REPORT"
    # the NMSE plain RoPE needs at large positions, next to the NTK cases' (the tolerance is set from it)
    grep -E 'ROPE\(.*method=none.*n_ctx=65536' "$OUT/test-backend-ops.log" | head -n 4 | tee -a "$REPORT"
fi

# 3. tiny-model reference tests on the GPU
if step 3; then
    GGUFROPE_TEST_NGL=99 timeout 600 $PY -m pytest -q -p no:cacheprovider tests/test_reference_forward.py tests/test_patched_model.py \
        tests/test_dynamic.py > "$OUT/tiny.log" 2>&1
    say "tiny-model reference on GPU (exit $?): $(tail -n1 "$OUT/tiny.log")"
fi
step 4 || exit 0

# 4. the real model, all layers on the GPU
inputs "$OUT" || { say "model: FAILED"; exit 1; }
for n in 16384 32768; do
    /usr/bin/time -f "%e s" -o "$OUT/time-gpu-$n" $PY -m ggufrope generate "$OUT/smollm2-mixed-logn.gguf" \
        --n-ctx $n -f "$OUT/prompt-$n.txt" -n 32 --gpu-layers -1 > "$OUT/gen-gpu-$n.txt" 2> "$OUT/gen-gpu-$n.log"
    say "generate n_ctx $n, all layers on GPU (exit $?, $(cat "$OUT/time-gpu-$n")): $(grep '\[ggufrope\] prompt' "$OUT/gen-gpu-$n.log")"
    say "  output: $(head -c 200 "$OUT/gen-gpu-$n.txt" | tr '\n' ' ')"
done
$PY -m ggufrope generate "$OUT/smollm2-mixed-logn.gguf" --n-ctx 16384 -f "$OUT/prompt-16384.txt" -n 32 \
    --gpu-layers 0 > "$OUT/gen-cpu-16384.txt" 2> "$OUT/gen-cpu-16384.log"
$PY - "$OUT" "${CPU_REF:-}" <<'PYEOF' | tee -a "$REPORT"
import os, sys
out, ref = sys.argv[1], sys.argv[2]
pairs = [(16384, "CPU (this build, --gpu-layers 0)", f"{out}/gen-cpu-16384.txt")]
if ref:
    pairs += [(n, f"CPU build of another machine ({ref})", f"{ref}/gen-cpu-{n}.txt") for n in (16384, 32768)]
for n, what, path in pairs:
    if not os.path.exists(path):
        print(f"GPU vs {what} at n_ctx {n}: no {path}")
        continue
    g, c = open(f"{out}/gen-gpu-{n}.txt").read(), open(path).read()
    if g == c:
        print(f"GPU vs {what}, first 32 greedy tokens at n_ctx {n}: identical")
    else:
        i = next((i for i, (a, b) in enumerate(zip(g, c)) if a != b), min(len(g), len(c)))
        print(f"GPU vs {what}, first 32 greedy tokens at n_ctx {n}: differ from character {i}: "
              f"GPU {g[i:i+40]!r} / CPU {c[i:i+40]!r}")
PYEOF
say "report: $REPORT"
