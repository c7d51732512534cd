#!/usr/bin/env bash
# Rope-op instruction counts, patched vs unpatched ggml, under valgrind's callgrind: a measure
# that the noise of a shared 2-core VM cannot touch (issue 5). Needs bench/callgrind-build.sh
# (both ggml trees built without AVX-512, which valgrind lacks).
#
# For every LLaMA shape (head_dim 64/128, 1/512 tokens, 32 heads, positions 8000.. straddling
# L = 8192) and variant (plain rope; with the freq-factor table, which is how the NTK methods
# reach the op; table + log-n, patched only), bench/rope_op.c computes the node N times in
# one thread, and callgrind counts the instructions executed inside ggml_compute_forward_rope*
# (--toggle-collect): instructions per op = total / N. Prints the counts and the ratios
# patched / stock.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
CG=$BUILD/callgrind
OUT=$CG/out; mkdir -p "$OUT"
command -v valgrind >/dev/null || { echo "rope_op_callgrind: error: valgrind not found (apt install valgrind)" >&2; exit 2; }
for flavor in patched stock; do
    [ -f "$CG/$flavor/bin/libggml-cpu.so" ] || { echo "rope_op_callgrind: error: run bench/callgrind-build.sh first" >&2; exit 2; }
done
. "$ROOT/native/trees.sh"
cc -O2 -I"$PSRC/ggml/include" -DGGUFROPE "$ROOT/bench/rope_op.c" -L"$CG/patched/bin" -lggml-base -lggml-cpu -lggml \
    -Wl,-rpath,"$CG/patched/bin" -o "$OUT/rope_op_patched"
cc -O2 -I"$SSRC/ggml/include" "$ROOT/bench/rope_op.c" -L"$CG/stock/bin" -lggml-base -lggml-cpu -lggml \
    -Wl,-rpath,"$CG/stock/bin" -o "$OUT/rope_op_stock"
: > "$OUT/counts.txt"
for d in 64 128; do
    for t in 1 512; do
        n=$([ "$t" = 1 ] && echo 200 || echo 4)
        for flavor in stock patched; do
            vs="0 1"; [ $flavor = patched ] && vs="0 1 2"
            for v in $vs; do
                f=$OUT/cg.$flavor.$d.$t.$v
                valgrind --tool=callgrind --callgrind-out-file="$f" --toggle-collect='ggml_compute_forward_rope*' \
                    "$OUT/rope_op_$flavor" 1 "$d" "$t" "$v" "$n" > /dev/null 2> "$f.log"
                ir=$(awk '/^totals:/ {print $2}' "$f")
                echo "$flavor $v $d $t $n $ir" >> "$OUT/counts.txt"
            done
        done
    done
done
python3 - "$OUT/counts.txt" <<'PYEOF'
import sys
c = {}
for line in open(sys.argv[1]):
    flavor, v, d, t, n, ir = line.split()
    c[(flavor, int(v), int(d), int(t))] = int(ir) / int(n)
print(f"{'shape':24s} {'stock plain':>12s} {'patched plain':>14s} {'stock table':>12s} {'patched table':>14s} "
      f"{'table+logn':>11s}   patched plain / stock plain, table+logn / stock table")
for d in (64, 128):
    for t in (1, 512):
        g = lambda f, v: c[(f, v, d, t)]
        print(f"head_dim={d} n_tokens={t:<4d}  {g('stock', 0):12.0f} {g('patched', 0):14.0f} {g('stock', 1):12.0f} "
              f"{g('patched', 1):14.0f} {g('patched', 2):11.0f}   {g('patched', 0) / g('stock', 0):.4f}  "
              f"{g('patched', 2) / g('stock', 1):.4f}")
print("(instructions per rope op inside ggml_compute_forward_rope*, callgrind, 1 thread; 32 heads)")
PYEOF
