#!/usr/bin/env bash
# End-to-end instruction counts of llama_decode, patched vs unpatched llama.cpp, under callgrind
# (issue 5): SmolLM2-135M Q4_1, one thread, flash attention on, a prefill of N tokens at
# positions P0.. (default 8192 = L, every row beyond L so log-n is active) and D single-token
# decodes after it. --dump-after=llama_decode writes one count per llama_decode call, so the
# prefill and each decode are counted separately in one run (model loading is not counted).
#
# Configurations: stock (unpatched tree, plain rope), patched with method none, patched with
# ntk-mixed (k = 2, b = 0.625) + log-n (kv overrides). Needs bench/callgrind-build.sh and
# `BUILD_LLAMA=1 bench/callgrind-build.sh` (libllama of both trees without AVX-512).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
CG=$BUILD/callgrind
OUT=$CG/out-decode; mkdir -p "$OUT"
N=${N:-128}; P0=${P0:-8192}; D=${D:-4}
[ "$D" -ge 1 ] || { echo "decode_callgrind: error: D must be >= 1 (the decode count is a mean over D calls)" >&2; exit 2; }
. "$ROOT/native/trees.sh"
MODEL=${MODEL:-$("$ROOT/.venv/bin/python" -m ggufrope.models)}
command -v valgrind >/dev/null || { echo "decode_callgrind: error: valgrind not found" >&2; exit 2; }
for flavor in patched stock; do
    [ -f "$CG/$flavor/bin/libllama.so" ] || { echo "decode_callgrind: error: run BUILD_LLAMA=1 bench/callgrind-build.sh first" >&2; exit 2; }
done
for flavor in patched stock; do
    SRC=$(tree_src $flavor)
    cc -O2 -I"$SRC/include" -I"$SRC/ggml/include" "$ROOT/bench/decode_callgrind.c" -L"$CG/$flavor/bin" \
        -lllama -lggml -lggml-base -Wl,-rpath,"$CG/$flavor/bin" -o "$OUT/decode_$flavor"
done
run() {  # name binary args...
    local name=$1; shift
    rm -f "$OUT/cg.$name".*
    valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$name.%p" --collect-atstart=no \
        --toggle-collect=llama_decode --dump-after=llama_decode "$@" "$MODEL" "$N" "$P0" "$D" "${EXTRA[@]}" \
        > "$OUT/$name.out" 2> "$OUT/$name.log"
    cat "$OUT/$name.out"
    # one file per dump, in call order (the final dump at exit has no decode in it)
    for f in $(ls "$OUT"/cg."$name".* | sort -V); do
        awk -v n="$name" '/^totals:/ {print n, $2}' "$f"
    done >> "$OUT/counts.txt"
}
: > "$OUT/counts.txt"
EXTRA=();                          run stock "$OUT/decode_stock"
EXTRA=();                          run none "$OUT/decode_patched"
EXTRA=(ntk-mixed 2 0.625 1);       run mixed_logn "$OUT/decode_patched"
python3 - "$OUT/counts.txt" "$N" "$P0" "$D" <<'PYEOF'
import sys, collections
c = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, ir = line.split()
    c[name].append(int(ir))
N, P0, D = sys.argv[2:]
D = int(D)
for k in c:
    c[k] = [x for x in c[k] if x > 0][: 1 + D]  # prefill, then the D decodes
mean = lambda v: sum(v) / len(v)
print(f"llama_decode instructions, N = {N} prefill tokens at positions {P0}.., then {D} decodes (1 thread, FA on)")
print(f"{'':18s} {'prefill':>15s} {'decode (mean)':>15s}")
for k in ("stock", "none", "mixed_logn"):
    v = c[k]
    print(f"{k:18s} {v[0]:15d} {mean(v[1:]):15.0f}")
for k in ("none", "mixed_logn"):
    pf = c[k][0] / c["stock"][0]
    dc = mean(c[k][1:]) / mean(c["stock"][1:])
    print(f"{k} / stock: prefill {pf:.5f}, decode {dc:.5f}")
PYEOF
