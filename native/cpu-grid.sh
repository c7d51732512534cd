#!/usr/bin/env bash
# native/cpu-grid.sh: the grid cells docs/results.md still lacks (native/grid-jobs.txt, as stage 2 of
# native/gpu-lent.sh runs them on a lent GPU: `gpu-lent.sh jobs`, tune jobs left out) on this CPU,
# one at a time, in the file's order, with --any-build: a cell resumes the samples of every build's
# partial file and answers only the rest. A Gemma 3 4xL vt sample is 24-40 minutes on 2 cores, so
# run it in the background:
#
#   nohup native/cpu-grid.sh > build/cpu-grid.log 2>&1 &
#
# Every POLL seconds (default 60) a partial file that changed (a sample answered) is committed, so a
# session that is cut off leaves its samples in git. When a cell's unit lands, the reports are
# rewritten (python -m ggufrope.evaluation.publish, as make results-v2-report), the cell's row
# leaves native/grid-jobs.txt, and the three are committed together, so the tests that hold the
# reports and the job list to the cache pass at every commit; the prose of docs/results.md is left
# to a person. Only these paths are committed (whatever else is staged stays out).
# Settings (tests/test_gpu_lent.py sets them): COMMIT=0 commits nothing; PUBLISH=0 rewrites no
# report; JOBS=N runs the first N jobs only; GRID_JOBS (one gpu-lent job a line) instead of
# `gpu-lent.sh jobs`; CACHE (default docs/results/cache), JOBS_FILE (native/grid-jobs.txt), OUT (where
# eval compare writes its report, build/cpu-grid), SCORE_FROM (default L/2, as gpu-lent).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
CACHE=${CACHE:-docs/results/cache}
JOBS_FILE=${JOBS_FILE:-native/grid-jobs.txt}
OUT=${OUT:-$ROOT/build/cpu-grid}
COMMIT=${COMMIT:-1}
POLL=${POLL:-60}
say() { echo "cpu-grid: $(date -u +%FT%TZ) $*"; }

commit() {  # commit MESSAGE PATH...
    local msg=$1
    shift
    if git add -A -- "$@" && git commit -q -m "$msg" -- "$@"; then
        say "committed: ${msg%%$'\n'*}"
    else
        say "commit failed (left uncommitted): ${msg%%$'\n'*}"
    fi
}

describe() {  # describe FILE...: one line on each unit or partial file of the cache (the commit message)
    "$PY" - "$@" <<'PY'
import json, sys
from ggufrope.evaluation.cache import build_id
for f in sys.argv[1:]:
    try:
        o = json.load(open(f))
    except OSError:
        print(f"{f.rsplit('/', 1)[-1]} removed (its unit is stored)")
        continue
    if "key" not in o:  # not a unit (model-sha256.json, the cache's memo of model hashes)
        continue
    k = o["key"]
    cell = f"{k['method']}{' + log n' if k.get('logn') else ''} {k.get('task', k['kind'])} at n_ctx {k['n_ctx']}"
    res = o.get("result", o)
    rows = list(res["rows"].values()) if isinstance(res["rows"], dict) else res["rows"]
    scores = " ".join(f"{r.get('score', 0):g}" for r in rows)
    where = f"{build_id(o.get('build'))}"
    if f.endswith(".partial"):
        print(f"{cell}: {len(rows)} samples in its partial file ({where}), {o.get('wall_s', 0) / 60:.1f} min; scores {scores}")
    else:
        print(f"{cell} done: score {res.get('score')} ({scores}), {res.get('wall_s', 0) / 60:.1f} min; "
              f"samples per build {res.get('sample_builds') or where}")
PY
}

commit_partials() {
    [ "$COMMIT" = 1 ] || return 0
    local f files=()
    while IFS= read -r f; do  # a removed one goes with its unit's commit
        [[ $f == *.partial && -e $f ]] && files+=("$f")
    done < <(git status --porcelain --untracked-files=all -- "$CACHE" | cut -c4-)
    [ ${#files[@]} -gt 0 ] || return 0
    commit "results: $(describe "${files[@]}" | paste -sd ';' | sed 's/;/; /g')" "${files[@]}"
}

if [ -n "${GRID_JOBS:-}" ]; then
    mapfile -t jobs < <(head -n "${JOBS:-1000}" <<< "$GRID_JOBS")
else
    mapfile -t jobs < <(bash native/gpu-lent.sh jobs | grep -v '^@[a-z0-9]* tune ' | head -n "${JOBS:-1000}")
fi
[ ${#jobs[@]} -gt 0 ] || { say "no grid jobs left in $JOBS_FILE"; exit 0; }
for job in "${jobs[@]}"; do
    name=smollm2 args=$job
    if [[ $job == @* ]]; then name=${job%% *} name=${name#@} args=${job#* }; fi
    model=$("$PY" -m ggufrope.models --model "$name") || { say "no model $name"; exit 2; }
    L=$("$PY" -c 'import sys; from ggufrope.evaluation.decoder import n_ctx_orig_of; print(n_ctx_orig_of(sys.argv[1]))' "$model") || exit 2
    # the row of native/grid-jobs.txt this job came from: METHOD LOGN TRIALS
    row=$(sed -E 's/.*--methods ([^ ]+) --logn ([^ ]+) .*--trials ([0-9]+).*/\1 \2 \3/' <<< "$args")
    say "job: $name $args"
    # shellcheck disable=SC2086  # args: the job's flags, split as gpu-lent splits them
    "$PY" -m ggufrope eval compare "$model" --cache "$CACHE" --score-from "${SCORE_FROM:-$((L / 2))}" --any-build -q \
        $args --out "$OUT" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep "$POLL" & wait $!
        commit_partials
    done
    wait "$pid"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        commit_partials
        say "job failed (exit $rc): $args"
        exit "$rc"
    fi
    if [ "${PUBLISH:-1}" = 1 ]; then
        "$PY" -m ggufrope.evaluation.publish > /dev/null || { say "publish failed"; exit 2; }
    fi
    grep -vxF "$row" "$JOBS_FILE" > "$JOBS_FILE.tmp"
    [ $? -le 1 ] && mv "$JOBS_FILE.tmp" "$JOBS_FILE" || { say "cannot rewrite $JOBS_FILE"; exit 2; }  # 1: no row left
    say "unit landed; '$row' leaves $JOBS_FILE"
    [ "$COMMIT" = 1 ] || continue
    mapfile -t landed < <(git status --porcelain --untracked-files=all -- "$CACHE" | cut -c4-)
    reports=()
    [ "${PUBLISH:-1}" = 1 ] && reports=(docs/results docs/results.md)
    commit "results: $(describe "${landed[@]}" | grep ' done: ' | paste -sd ';')
${reports:+Reports rewritten (make results-v2-report); }'$row' leaves $JOBS_FILE. Command: native/cpu-grid.sh" \
        "${landed[@]}" "${reports[@]}" "$JOBS_FILE"
done
say "done"
