#!/usr/bin/env bash
# Rope-op micro-benchmark, patched vs unpatched ggml on the CPU, measured in one run.
# Needs make build (patched) and bench/build-stock.sh (unpatched). ROUNDS rounds alternate the two
# binaries; prints per-case medians (microseconds per op) and ratios to the unpatched op.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-$(nproc)}
PLIB=$("$ROOT/.venv/bin/python" -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')")
. "$ROOT/native/trees.sh"
SLIB=$BUILD/stock-lib
[ -f "$SLIB/libggml-base.so" ] || { echo "rope_op: error: run bench/build-stock.sh first" >&2; exit 2; }
OUT=$BUILD/bench; mkdir -p "$OUT"
cc -O2 -I"$PSRC/ggml/include" -DGGUFROPE "$ROOT/bench/rope_op.c" -L"$PLIB" -lggml-base -lggml-cpu -lggml -Wl,-rpath,"$PLIB" -o "$OUT/rope_op_patched"
cc -O2 -I"$SSRC/ggml/include" "$ROOT/bench/rope_op.c" -L"$SLIB" -lggml-base -lggml-cpu -lggml -Wl,-rpath,"$SLIB" -o "$OUT/rope_op_stock"
: > "$OUT/rope_op.txt"
for r in $(seq "$ROUNDS"); do
    "$OUT/rope_op_stock" "$THREADS" | sed 's/^/stock /' >> "$OUT/rope_op.txt"
    "$OUT/rope_op_patched" "$THREADS" | sed 's/^/patched /' >> "$OUT/rope_op.txt"
done
python3 - "$OUT/rope_op.txt" <<'PYEOF'
import sys, statistics, collections
s = collections.defaultdict(list)
for line in open(sys.argv[1]):
    build, var, d, t, us = line.split()
    s[(build, var, d, t)].append(float(us))
med = {k: statistics.median(v) for k, v in s.items()}
print(f"{'shape':26s} {'stock plain':>12s} {'patched plain':>14s} {'stock table':>12s} {'patched table':>14s} {'table+logn':>11s}   table+logn / stock table, / stock plain")
for d, t in sorted({(k[2], k[3]) for k in med}, key=lambda x: (int(x[0].split('=')[1]), int(x[1].split('=')[1]))):
    g = lambda b, v: med[(b, v, d, t)]
    print(f"{d + ' ' + t:26s} {g('stock','plain'):12.3f} {g('patched','plain'):14.3f} {g('stock','table'):12.3f} "
          f"{g('patched','table'):14.3f} {g('patched','table+logn'):11.3f}   {g('patched','table+logn')/g('stock','table'):.3f}  {g('patched','table+logn')/g('stock','plain'):.3f}")
spread = max((max(v) - min(v)) / statistics.median(v) for v in s.values())
print(f"(microseconds per op, median of {len(next(iter(s.values())))} rounds; worst relative spread {spread:.1%})")
PYEOF
