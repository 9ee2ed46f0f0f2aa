#!/usr/bin/env bash
# The GPU runbook: everything fastmt measures on a GPU, from one command on a bare device machine
# (torch 2.11 + triton 3.6 in the image's python3, no network). See bench/README.md for the call.
#
#   bash bench/gpu_run.sh [STEP|GROUP ...]     (no argument: call1)
#
# Groups, one device call each (<= 9 minutes), most important first:
#   call1        kernel-test bench-kernels                  is the GPU path correct, do the kernels win
#   call2        train quality profile                      `make train`'s run: time to BLEU, compile, GPU busy
#   call3        frontier ladder                            the HF baseline, the seeds' recipe, s18, default
#   sweep-adamw  sweep (the AdamW settings)                 the optimiser sweep on wall time to BLEU
#   sweep-lion   sweep (the Lion settings)
# Steps:
#   kernel-test     pytest tests/kernels -m "gpu and not slow"  (the CUDA grids; the rest runs in CI, interpreted)
#   bench-kernels   python3 -m bench.kernels --groups corpus,ln ...  (bench/results/kernels-<gpu>.*)
#   train           python3 -m train --auto --run.name default-<RUN_ID> ...   (what `make train` runs)
#   quality         python3 -m bench.quality --run runs/default-<RUN_ID>  (bench/results/quality-<gpu>.*)
#   profile         python3 -m bench.profile ...                 (bench/results/profile-<gpu>/, warm compile)
#   frontier        python3 -m bench.frontier --budget-s ...     (bench/results/frontier-<gpu>.*)
#   ladder          python3 -m bench.ladder ...                  (bench/results/ladder-<gpu>.*)
#   sweep           python3 -m bench.sweep --settings ...        (bench/results/sweep-<gpu>.*)
#
# Setup (always): install the carried wheels (.whl/*.whl, from `make gpu-wheels`) offline into
# /tmp/site and put it first on PYTHONPATH; export FASTMT_DATA_FILES from the carried .data/; set the
# Hugging Face libraries offline; print nvidia-smi, versions and a check of the carried wheels'
# requirements against the image; unpack .whl/triton-aot-sm90.tgz (our kernels compiled for sm_90 on a CPU
# machine, `GPU_AOT=1 make gpu-wheels`) into TRITON_CACHE_DIR, say whether its cache key matches this
# machine's, and after each step how many Triton kernels the step still compiled here.
#
# Each step runs under its own time limit with its own log, and the script goes on after a failure.
# Limits fit one 10-minute device call: the whole script stops starting steps at GPU_RUN_DEADLINE_S
# (default 570 s), each step gets min(its limit, what is left), and after every step the results
# are packed again, so what finished comes back even if the call is cut short:
#   $OUT/results.tgz   bench/results/, this run's logs (runs/gpu_run/<id>/), runs/*/metrics.jsonl,
#                      provenance.json and *.png; files over 2 MiB are left out if the tarball would
#                      pass 15 MiB (the device returns 8 files of at most 16 MiB)
#   $OUT/summary.txt   setup facts, one line per step, the tail of every step's log
# Without $OUT (by hand), both land in runs/gpu_run/.
#
# Environment: PYTHON (default python3); GPU_RUN_DEADLINE_S; LIMIT_<STEP> to change a step's limit
# in seconds (LIMIT_KERNEL_TEST, LIMIT_BENCH_KERNELS, LIMIT_TRAIN, LIMIT_PROFILE, LIMIT_FRONTIER, LIMIT_LADDER,
# LIMIT_SWEEP); BENCH_KERNELS_ARGS, TRAIN_ARGS, PROFILE_ARGS, FRONTIER_ARGS, LADDER_ARGS, SWEEP_ARGS,
# KERNEL_TEST_ARGS: extra arguments; SWEEP_SETTINGS: the sweep's settings (comma-separated);
# FASTMT_GIT_SHA: the commit, recorded in results when the copy on the machine has no .git.
set -uo pipefail

ALL_STEPS=(kernel-test bench-kernels train quality profile frontier ladder sweep)
declare -A DEFAULT_LIMIT=([kernel-test]=240 [bench-kernels]=300 [train]=300 [quality]=30 [profile]=200
                          [frontier]=420 [ladder]=120 [sweep]=540)
declare -A STEP_GROUPS=([call1]="kernel-test bench-kernels" [call2]="train quality profile" [call3]="frontier ladder"
                   [sweep-adamw]="sweep" [sweep-lion]="sweep")
SWEEP_ADAMW=adamw-base,adamw-8e-4,adamw-3e-4,adamw-warm5,adamw-2k,adamw-8k
SWEEP_LION=lion-1e-4,lion-1.5e-4,lion-7e-5,lion-wd0.3,lion-b0.95,lion-warm5
DEADLINE_S=${GPU_RUN_DEADLINE_S:-570}
PACK_RESERVE_S=20     # kept back from the last step for the final pack
MAX_TGZ_BYTES=$((15 * 1024 * 1024))
BIG_FILE_BYTES=$((2 * 1024 * 1024))

usage() { sed -n '2,25p' "$0"; exit 2; }

STEPS=()
for arg in "$@"; do
    case $arg in
        all) STEPS+=("${ALL_STEPS[@]}") ;;
        -h | --help) usage ;;
        sweep-adamw) SWEEP_SETTINGS=${SWEEP_SETTINGS:-$SWEEP_ADAMW}; STEPS+=(sweep) ;;
        sweep-lion) SWEEP_SETTINGS=${SWEEP_SETTINGS:-$SWEEP_LION}; STEPS+=(sweep) ;;
        call1 | call2 | call3) read -r -a group <<<"${STEP_GROUPS[$arg]}"; STEPS+=("${group[@]}") ;;
        *) [[ -n ${DEFAULT_LIMIT[$arg]+x} ]] || { echo "gpu_run: unknown step '$arg'" >&2; usage; }
           STEPS+=("$arg") ;;
    esac
done
((${#STEPS[@]})) || { read -r -a STEPS <<<"${STEP_GROUPS[call1]}"; }

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
LOGDIR=runs/gpu_run/$RUN_ID
mkdir -p "$LOGDIR"
SUMMARY=$LOGDIR/summary.txt
DEST=${OUT:-$ROOT/runs/gpu_run}
mkdir -p "$DEST"
declare -A STATUS=() SECS=()

log() { echo "[gpu_run +$((SECONDS))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE_S - SECONDS - PACK_RESERVE_S)); }

# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------
setup() {
    log "steps: ${STEPS[*]} | deadline ${DEADLINE_S}s | logs $LOGDIR | results -> $DEST"
    export PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
    export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
    export HF_HOME=${HF_HOME:-/tmp/hf-home}
    local site=/tmp/site wheels=()
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]})); then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "${wheels[@]}" >"$LOGDIR/setup-pip.log" 2>&1; then
            log "installed ${#wheels[@]} carried wheels into $site: $(cd .whl && echo *.whl)"
        else
            log "WARNING: installing .whl/*.whl failed (setup-pip.log): $(tail -n 2 "$LOGDIR/setup-pip.log" | tr '\n' ' ')"
        fi
        export PYTHONPATH=$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
    else
        log "WARNING: no .whl/*.whl: run 'make gpu-wheels' on a CPU machine and carry .whl (datasets, lion-pytorch are missing here)"
        export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    fi

    DATA_FILES=()
    if [[ -f .data/FILES ]]; then
        local f
        while IFS= read -r f; do
            [[ -n $f ]] || continue
            if [[ -f .data/$f ]]; then DATA_FILES+=("$ROOT/.data/$f"); else log "WARNING: .data/$f is listed but missing"; fi
        done <.data/FILES
        if [[ -f .data/SHA256SUMS ]]; then
            (cd .data && sha256sum --quiet -c SHA256SUMS) >>"$SUMMARY" 2>&1 || log "WARNING: .data checksums differ"
        fi
    fi
    if ((${#DATA_FILES[@]})); then
        FASTMT_DATA_FILES=$(IFS=:; echo "${DATA_FILES[*]}")  # the OS path separator, as data/config.py reads it
        export FASTMT_DATA_FILES
        log "data: FASTMT_DATA_FILES=$FASTMT_DATA_FILES ($(du -ch "${DATA_FILES[@]}" | tail -n 1 | cut -f1))"
    else
        log "WARNING: no .data/FILES: ladder, profile and training have no local data and no network"
    fi

    if [[ -z ${FASTMT_GIT_SHA:-} ]]; then
        FASTMT_GIT_SHA=$(git rev-parse HEAD 2>/dev/null || echo unknown)
        export FASTMT_GIT_SHA
    fi
    log "git: $FASTMT_GIT_SHA$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"

    # our Triton kernels compiled ahead of time for sm_90 (bench/aot.py): a warm cache if the keys match
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
    mkdir -p "$TRITON_CACHE_DIR"
    if [[ -f .whl/triton-aot-sm90.tgz ]]; then
        tar -xzf .whl/triton-aot-sm90.tgz -C "$TRITON_CACHE_DIR" 2>>"$LOGDIR/setup-aot.log"
        log "triton cache: $(triton_entries) kernels compiled ahead of time in $TRITON_CACHE_DIR;" \
            "$(env -u TRITON_INTERPRET "$PY" -m bench.aot --check "$TRITON_CACHE_DIR/AOT-KEYS.json" 2>&1 | tail -n 1)"
    else
        log "triton cache: no .whl/triton-aot-sm90.tgz (GPU_AOT=1 make gpu-wheels builds it): every kernel compiles here"
    fi

    {
        echo "---- nvidia-smi"
        nvidia-smi 2>&1 || echo "nvidia-smi failed"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
            --format=csv 2>&1 || true
        echo "---- versions and carried wheels"
        "$PY" - <<'EOF' 2>&1
import importlib.metadata as md
import platform, sys
print(f"python {platform.python_version()} at {sys.executable}")
try:
    import torch, triton
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
          f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
except Exception as e:  # noqa: BLE001
    print(f"torch/triton import failed: {e!r}")
for name in ("numpy", "pyarrow", "pandas", "fsspec", "huggingface-hub", "xxhash", "dill", "multiprocess",
             "datasets", "lion-pytorch", "sentencepiece", "sacrebleu", "einops", "matplotlib", "pytest",
             "pytest-timeout", "hypothesis"):
    try:
        dist = md.distribution(name)
        print(f"  {name:<16} {dist.version:<12} {dist.locate_file('')}")
    except md.PackageNotFoundError:
        print(f"  {name:<16} MISSING")
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:
    sys.exit("packaging is missing: requirements not checked")
env = dict(default_environment(), extra="")
problems = 0
for name in ("datasets", "lion-pytorch", "dill", "multiprocess", "fsspec"):
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        continue
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            print(f"  REQUIREMENT MISSING: {name} needs {req}"); problems += 1; continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            print(f"  REQUIREMENT MISMATCH: {name} needs {req}, found {req.name} {have}"); problems += 1
print(f"carried wheels' requirements: {'all met' if not problems else f'{problems} problem(s)'}")
for mod in ("datasets", "lion_pytorch"):
    try:
        __import__(mod)
        print(f"import {mod}: ok")
    except Exception as e:  # noqa: BLE001
        print(f"import {mod}: FAILED {e!r}")
EOF
    } >"$LOGDIR/setup-env.log" 2>&1
    cat "$LOGDIR/setup-env.log" >>"$SUMMARY"
    grep -A1 -E "^name, driver_version" "$LOGDIR/setup-env.log" | sed 's/^/  /'
    grep -E "^torch |^python |REQUIREMENT|requirements:|^import " "$LOGDIR/setup-env.log" | sed 's/^/  /'
}

# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------
has_flag() { grep -q -- "\"$2\"" "$1" 2>/dev/null; }   # does the module's source define this option?
triton_entries() { find "${TRITON_CACHE_DIR:-/nonexistent}" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }

step_command() {  # fills CMD for step $1 given its time limit $2
    local step=$1 limit=$2 extra=()
    local data_arg=()
    ((${#DATA_FILES[@]})) && data_arg=(--data-files "${DATA_FILES[@]}")
    case $step in
        kernel-test)  # the CUDA grids, whose compile units bench/aot.py's kernel-test plan counts; the
            # interpreter runs the rest in CI. KERNEL_TEST_ARGS="-m 'not slow'" widens it to `make kernel-test`.
            read -r -a extra <<<"${KERNEL_TEST_ARGS:-}"
            CMD=("$PY" -m pytest -q tests/kernels -m "gpu and not slow" --timeout=600 -rfE --durations=15
                 "--junitxml=$ROOT/$LOGDIR/kernel-test.xml" "${extra[@]}") ;;
        bench-kernels)
            read -r -a extra <<<"${BENCH_KERNELS_ARGS:-}"
            # leave room for the worker's grace period and the writing of the outputs
            local budget=$((limit > 150 ? limit - 75 : limit / 2))
            CMD=("$PY" -m bench.kernels --groups corpus,ln --budget-s "$budget" "${data_arg[@]}" "${extra[@]}") ;;
        train)  # what `make train` runs on CUDA, from a cold compile cache
            read -r -a extra <<<"${TRAIN_ARGS:-}"
            CMD=("$PY" -m train --auto --run.name "default-$RUN_ID" --run.progress false "${data_arg[@]}" "${extra[@]}") ;;
        quality)
            # this invocation's own run (a run name is never reused: a second call2 would get default-2)
            CMD=("$PY" -m bench.quality --run "runs/default-$RUN_ID") ;;
        profile)  # after `train`: its compile is the warm-cache compile
            read -r -a extra <<<"${PROFILE_ARGS:-}"
            CMD=("$PY" -m bench.profile "${data_arg[@]}" "${extra[@]}") ;;
        frontier)
            read -r -a extra <<<"${FRONTIER_ARGS:-}"
            CMD=("$PY" -m bench.frontier --budget-s "${FRONTIER_BUDGET_S:-75}" --grace-s 25 "${data_arg[@]}"
                 "${extra[@]}") ;;
        ladder)
            read -r -a extra <<<"${LADDER_ARGS:-}"
            CMD=("$PY" -m bench.ladder "${data_arg[@]}" --budget-s $((limit > 60 ? limit - 30 : limit / 2))
                 --cap-s 20 --steps 10 --warmup 3 "${extra[@]}") ;;
        sweep)
            read -r -a extra <<<"${SWEEP_ARGS:-}"
            CMD=("$PY" -m bench.sweep --budget-s "${SWEEP_BUDGET_S:-75}" --grace-s 10
                 --settings "${SWEEP_SETTINGS:-$SWEEP_ADAMW}" "${data_arg[@]}" "${extra[@]}") ;;
    esac
}

run_step() {
    local step=$1 var limit remaining rc t0
    var=LIMIT_${step//-/_}
    var=${var^^}
    limit=${!var:-${DEFAULT_LIMIT[$step]}}
    remaining=$(left)
    if ((remaining < 30)); then
        STATUS[$step]="skipped (${remaining}s left before the deadline)"
        SECS[$step]=0
        log "SKIP $step: ${remaining}s left before the deadline"
        return
    fi
    ((limit > remaining)) && limit=$remaining
    step_command "$step" "$limit"
    log "START $step (limit ${limit}s): ${CMD[*]}"
    t0=$SECONDS
    local cached
    cached=$(triton_entries)
    timeout --signal=TERM --kill-after=15 "$limit" "${CMD[@]}" >"$LOGDIR/$step.log" 2>&1
    rc=$?
    SECS[$step]=$((SECONDS - t0))
    log "$step compiled $(( $(triton_entries) - cached )) Triton kernels here (not in the cache; ours and Inductor's)"
    case $rc in
        0) STATUS[$step]=ok ;;
        124 | 137) STATUS[$step]="TIMEOUT after ${limit}s (rc $rc)" ;;
        *) STATUS[$step]="FAILED (rc $rc)" ;;
    esac
    log "END $step: ${STATUS[$step]} in ${SECS[$step]}s -> $LOGDIR/$step.log"
    tail -n 12 "$LOGDIR/$step.log" | sed 's/^/    /'
}

# ---------------------------------------------------------------------------------------------
# Packing: one tarball + summary.txt (the device returns at most 8 files of 16 MiB)
# ---------------------------------------------------------------------------------------------
pack() {
    local list=$LOGDIR/.pack-list tgz=$DEST/results.tgz size
    {
        find bench/results -type f 2>/dev/null
        find "$LOGDIR" -type f ! -name '.pack-list' 2>/dev/null
        find runs -mindepth 2 -maxdepth 2 -type f \( -name metrics.jsonl -o -name provenance.json -o -name '*.png' \) \
            ! -path 'runs/gpu_run/*' 2>/dev/null
    } | sort -u >"$list"
    tar -czf "$tgz.tmp" -T "$list" 2>>"$LOGDIR/pack.log"
    size=$(stat -c %s "$tgz.tmp" 2>/dev/null || echo 0)
    if ((size > MAX_TGZ_BYTES)); then
        local kept=$LOGDIR/.pack-kept
        : >"$kept"
        while IFS= read -r f; do
            if (($(stat -c %s "$f") > BIG_FILE_BYTES)); then
                echo "left out of results.tgz (over $((BIG_FILE_BYTES / 1048576)) MiB): $f" >>"$LOGDIR/pack.log"
            else
                echo "$f" >>"$kept"
            fi
        done <"$list"
        tar -czf "$tgz.tmp" -T "$kept" 2>>"$LOGDIR/pack.log"
        size=$(stat -c %s "$tgz.tmp" 2>/dev/null || echo 0)
    fi
    mv -f "$tgz.tmp" "$tgz"
    cp -f "$SUMMARY" "$DEST/summary.txt"
    PACKED_BYTES=$size
}

finish() {
    {
        echo
        echo "==== steps"
        for s in "${STEPS[@]}"; do printf '  %-14s %-40s %6ss\n' "$s" "${STATUS[$s]:-not run}" "${SECS[$s]:-0}"; done
        for s in "${STEPS[@]}"; do
            [[ -f $LOGDIR/$s.log ]] || continue
            echo
            echo "==== tail of $s.log"
            if [[ $s == bench-kernels ]] && grep -q "== bench.kernels summary" "$LOGDIR/$s.log"; then
                sed -n '/== bench.kernels summary/,$p' "$LOGDIR/$s.log" | tail -n 60
            else
                tail -n 30 "$LOGDIR/$s.log"
            fi
        done
        echo
        [[ -f $LOGDIR/pack.log ]] && cat "$LOGDIR/pack.log"
    } >>"$SUMMARY"
    pack
    echo "[gpu_run +${SECONDS}s] packed $DEST/results.tgz ($((PACKED_BYTES / 1024)) KB) and $DEST/summary.txt" | tee -a "$SUMMARY"
    cp -f "$SUMMARY" "$DEST/summary.txt"
    sed -n '/^==== steps/,$p' "$SUMMARY" | tail -n 120
}

DATA_FILES=()
CMD=()
PACKED_BYTES=0
setup
pack
for step in "${STEPS[@]}"; do
    run_step "$step"
    pack
done
finish
for s in "${STEPS[@]}"; do
    [[ ${STATUS[$s]:-} == ok ]] || exit 1
done
exit 0
