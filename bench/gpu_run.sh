#!/usr/bin/env bash
# The GPU runbook: everything fastmt measures on a GPU (H100 or H200), from one command on a bare device
# machine (torch 2.11 + triton 3.6 in the image's python3, no network). See bench/README.md for the calls.
#
#   bash bench/gpu_run.sh [CALL|STEP ...]     (no argument: call1)
#   bash bench/gpu_run.sh plan                every call's steps, limits and totals (start-up included)
#   bash bench/gpu_run.sh show STEP           the step's command, one word per line (what a test collects)
#   GPU_RUN_REHEARSAL=1 bash bench/gpu_run.sh call2   the rehearsal on a CPU machine: every step's command in
#                                             its smoke form, the same $OUT layout (CI runs it)
#
# Calls, one device call each (<= 9 minutes of command time), the evidence that matters first:
#   call1   kernel-test bench-kernels          required: is the GPU path correct, do the kernels win
#   call2   train quality profile              required: `make train` cold, its time to BLEU, GPU busy
#   call3   frontier                           required: the HF baseline, the seeds' recipe, s18, default
#   call4   ladder                             optional: the speedup ladder
#   call5   sweep (AdamW settings)             optional (alias sweep-adamw)
#   call6   sweep (Lion settings)              optional (alias sweep-lion)
#   call7   inference kernel-test-slow         optional: export speed, the full (slow) CUDA test grids
# Steps:
#   kernel-test       pytest tests/kernels/*.py -m "not slow": every kernel test that is not a slow full grid,
#                     on CUDA (Lion vs lion-pytorch, mixed-dtype LayerNorm, opcheck, the CUDA grids), the
#                     files in the order training meets them
#   kernel-test-slow  pytest tests/kernels -m slow: the full CUDA grids
#   bench-kernels     python3 -m bench.kernels --groups corpus,ln      (bench/results/kernels-<gpu>.*)
#   train             python3 -m train --auto --run.max_wall_seconds <limit - 60>   (`make train`'s run)
#   quality           python3 -m bench.quality --run runs/default-<RUN_ID>  (bench/results/quality-<gpu>.*)
#   profile           python3 -m bench.profile                         (bench/results/profile-<gpu>/)
#   frontier          python3 -m bench.frontier --budget-s 75          (bench/results/frontier-<gpu>.*)
#   ladder            python3 -m bench.ladder                          (bench/results/ladder-<gpu>.*)
#   sweep             python3 -m bench.sweep --settings ...            (bench/results/sweep-<gpu>.*)
#   inference         python3 -m bench.inference --out bench/results  (CTranslate2 / HF export speed)
#
# Setup (always): a scratch folder from mktemp -d holds the wheels' install, the Triton and HF caches;
# PYTHONPATH names only that install, and only when it succeeded. The carried wheels (.whl/*.whl, from
# `make gpu-wheels`) install offline there; FASTMT_DATA_FILES comes from the carried .data/; the HF
# libraries go offline; nvidia-smi, versions and a check of the wheels' requirements are logged;
# .whl/triton-aot-sm90.tgz (`GPU_AOT=1 make gpu-wheels`) is unpacked into TRITON_CACHE_DIR and checked
# against this machine and this tree (`bench.aot --check`); after each step, how many Triton kernels it
# still compiled here.
#
# Each step runs under its own time limit and log, in its own process group, and the script goes on after
# a failure. No step starts past GPU_RUN_DEADLINE_S (540 s); each gets min(its limit, what is left); after
# every step the results are packed again, so what finished comes back even if the call is cut short:
#   $OUT/results.tgz   bench/results/, this run's logs (runs/gpu_run/<id>/), runs/*/metrics.jsonl,
#                      provenance.json and *.png (files over 2 MiB left out past 15 MiB)
#   $OUT/summary.txt   setup facts, one line per step, the tail of every step's log
# Without $OUT (by hand), both land in runs/gpu_run/.
#
# Environment: PYTHON (default python3; .venv/bin/python in a rehearsal); GPU_RUN_DEADLINE_S;
# LIMIT_<STEP> (seconds, e.g. LIMIT_BENCH_KERNELS); extra arguments, as shell words (quotes kept):
# KERNEL_TEST_ARGS, BENCH_KERNELS_ARGS, TRAIN_ARGS, PROFILE_ARGS, FRONTIER_ARGS, LADDER_ARGS, SWEEP_ARGS,
# INFERENCE_ARGS; SWEEP_SETTINGS, FRONTIER_BUDGET_S, SWEEP_BUDGET_S; FASTMT_GIT_SHA: the commit, recorded in
# results when the copy on the machine has no .git.
set -uo pipefail

ALL_STEPS=(kernel-test bench-kernels train quality profile frontier ladder sweep inference kernel-test-slow)
declare -A DEFAULT_LIMIT=([kernel-test]=250 [bench-kernels]=220 [train]=310 [quality]=20 [profile]=150
                          [frontier]=460 [ladder]=480 [sweep]=480 [inference]=240 [kernel-test-slow]=220)
CALLS=(call1 call2 call3 call4 call5 call6 call7)
REQUIRED_CALLS=3  # call1..call3 carry the evidence; the rest are optional
declare -A STEP_GROUPS=([call1]="kernel-test bench-kernels" [call2]="train quality profile" [call3]="frontier"
                        [call4]="ladder" [call5]="sweep" [call6]="sweep" [call7]="inference kernel-test-slow")
declare -A CALL_WHAT=([call1]="kernel tests + kernel benchmarks" [call2]="make train cold, its time to BLEU, the profile"
                      [call3]="the frontier with the HF baseline" [call4]="the speedup ladder"
                      [call5]="the AdamW sweep" [call6]="the Lion sweep"
                      [call7]="inference export speed, the slow CUDA grids")
SWEEP_ADAMW=adamw-base,adamw-8e-4,adamw-3e-4,adamw-2k   # 4 x (75 s + 30 s grace) fits the sweep's 480 s
SWEEP_LION=lion-1e-4,lion-1.5e-4,lion-7e-5,lion-wd0.3
declare -A CALL_SWEEP=([call5]=$SWEEP_ADAMW [call6]=$SWEEP_LION)
DEADLINE_S=${GPU_RUN_DEADLINE_S:-540}
SETUP_S=40            # the setup's share of a call (pip install, unpacking, nvidia-smi, versions), planned
PACK_RESERVE_S=20     # kept back from the last step for the final pack
STARTUP_S=120         # a fresh machine's start and the transfers, per call (estimated; the plan counts it)
TRAIN_RESERVE_S=60    # of the train step: the final evaluation, the test split, the `done` record, the plot
PYTEST_RESERVE_S=40   # of a pytest step: the test in flight when its deadline passes, the summary, JUnit
MAX_TGZ_BYTES=$((15 * 1024 * 1024))
BIG_FILE_BYTES=$((2 * 1024 * 1024))
REHEARSAL=${GPU_RUN_REHEARSAL:-0}
[[ $REHEARSAL == 0 || $REHEARSAL == "" ]] && REHEARSAL=0

usage() { sed -n '2,30p' "$0"; exit 2; }

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ $REHEARSAL != 0 && -x .venv/bin/python ]]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi

words() {  # words NAME VALUE: the shell words of VALUE (quotes kept, nothing expanded) into array NAME
    local -n _into=$1
    _into=()
    [[ -n ${2// /} ]] || return 0
    mapfile -t -d '' _into < <("$PY" -c 'import shlex, sys; sys.stdout.write("\0".join(shlex.split(sys.argv[1])))' "$2")
}

limit_of() {  # the step's limit in seconds: LIMIT_<STEP> or the default
    local var=LIMIT_${1//-/_}
    var=${var^^}
    echo "${!var:-${DEFAULT_LIMIT[$1]}}"
}

# ---------------------------------------------------------------------------------------------
# The plan: every call's steps, their limits and the totals (start-up included)
# ---------------------------------------------------------------------------------------------
print_plan() {
    local call step n=0 command total running=0 required=0
    echo "gpu_run plan: each call is one device call on a bare machine; command time = setup ${SETUP_S} s +"
    echo "the steps' limits + pack ${PACK_RESERVE_S} s (the script stops starting steps at ${DEADLINE_S} s);"
    echo "start-up ${STARTUP_S} s per call (machine start and transfers, estimated)"
    for call in "${CALLS[@]}"; do
        n=$((n + 1))
        local kind=optional
        ((n <= REQUIRED_CALLS)) && kind=required
        echo
        echo "$call ($kind): ${CALL_WHAT[$call]}"
        printf '  %-18s %5d s\n' setup "$SETUP_S"
        command=$((SETUP_S + PACK_RESERVE_S))
        for step in ${STEP_GROUPS[$call]}; do
            printf '  %-18s %5d s\n' "$step" "$(limit_of "$step")"
            command=$((command + $(limit_of "$step")))
        done
        printf '  %-18s %5d s\n' pack "$PACK_RESERVE_S"
        total=$((command + STARTUP_S))
        running=$((running + total))
        ((n <= REQUIRED_CALLS)) && required=$running
        echo "  $call command ${command} s ($(minutes "$command") min), with start-up ${total} s ($(minutes "$total") min);" \
             "running total ${running} s ($(minutes "$running") min)"
    done
    echo
    echo "calls 1-${REQUIRED_CALLS} (required) total ${required} s ($(minutes "$required") min) with start-up," \
         "of a session's ~45 min of device time"
    echo "all calls total ${running} s ($(minutes "$running") min)"
}

minutes() { printf '%d.%d' $(($1 / 60)) $(($1 % 60 * 10 / 60)); }

# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
STEPS=()
MODE=run
SHOW_STEP=
while (($#)); do
    arg=$1
    shift
    case $arg in
        plan) MODE=plan ;;
        show) MODE=show; SHOW_STEP=${1:-}; shift || true
              [[ -n $SHOW_STEP && -n ${DEFAULT_LIMIT[$SHOW_STEP]+x} ]] \
                  || { echo "gpu_run: show STEP: one of ${ALL_STEPS[*]} (got '$SHOW_STEP')" >&2; exit 2; } ;;
        all) STEPS+=("${ALL_STEPS[@]}") ;;
        -h | --help) usage ;;
        sweep-adamw) SWEEP_SETTINGS=${SWEEP_SETTINGS:-$SWEEP_ADAMW}; STEPS+=(sweep) ;;
        sweep-lion) SWEEP_SETTINGS=${SWEEP_SETTINGS:-$SWEEP_LION}; STEPS+=(sweep) ;;
        call[1-7])
            [[ -n ${CALL_SWEEP[$arg]+x} ]] && SWEEP_SETTINGS=${SWEEP_SETTINGS:-${CALL_SWEEP[$arg]}}
            read -r -a group <<<"${STEP_GROUPS[$arg]}"; STEPS+=("${group[@]}") ;;
        *) [[ -n ${DEFAULT_LIMIT[$arg]+x} ]] || { echo "gpu_run: unknown step '$arg'" >&2; usage; }
           STEPS+=("$arg") ;;
    esac
done
if [[ $MODE == plan ]]; then print_plan; exit 0; fi
for var in KERNEL_TEST_ARGS BENCH_KERNELS_ARGS TRAIN_ARGS PROFILE_ARGS FRONTIER_ARGS LADDER_ARGS SWEEP_ARGS INFERENCE_ARGS; do
    # before anything runs: a value the shell could not split (an open quote) would otherwise lose its words
    "$PY" -c 'import shlex, sys; shlex.split(sys.argv[1])' "${!var:-}" 2>/dev/null \
        || { echo "gpu_run: $var=${!var} is not valid shell words (an unclosed quote?): fix its quoting" >&2; exit 2; }
done
((${#STEPS[@]})) || { read -r -a STEPS <<<"${STEP_GROUPS[call1]}"; }

RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)
DATA_FILES=()
read_data_files() {  # DATA_FILES from the carried .data/FILES (absolute paths); warnings on stdout
    DATA_FILES=()
    [[ -f .data/FILES ]] || return 0
    local f
    while IFS= read -r f; do
        [[ -n $f ]] || continue
        if [[ -f .data/$f ]]; then DATA_FILES+=("$ROOT/.data/$f"); else echo "WARNING: .data/$f is listed but missing"; fi
    done <.data/FILES
}

# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------
has_pytest_timeout() { "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; }
triton_entries() { find "${TRITON_CACHE_DIR:-/nonexistent}" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }

# the kernel-test files in the order of what a training run meets first (a step cut at its deadline has run
# these): Lion and LayerNorm, the packed attention of the `fast` preset, the padded one, the dispatcher, the
# launcher, the rounding rule, the sm_90a code generation (CPU work); any other file after them
KERNEL_TEST_ORDER=(test_lion.py test_layernorm.py test_packed_attention.py test_sequence_attention.py test_attention.py
                   test_launch.py test_lowp_emulation.py test_lion_codegen.py test_layernorm_codegen.py
                   test_attention_codegen.py)
kernel_test_files() {
    local f seen=" ${KERNEL_TEST_ORDER[*]} "
    for f in "${KERNEL_TEST_ORDER[@]}"; do [[ -f tests/kernels/$f ]] && echo "tests/kernels/$f"; done
    for f in tests/kernels/test_*.py; do [[ $seen == *" ${f##*/} "* ]] || echo "$f"; done
}

mentions() {  # mentions FLAG WORD...: is FLAG among the words (as FLAG or FLAG=VALUE)?
    local flag=$1 w
    shift
    for w in "$@"; do [[ $w == "$flag" || $w == "$flag="* ]] && return 0; done
    return 1
}

pytest_command() {  # pytest_command LIMIT JUNIT SELECTION-ARGS...: pytest that ends, with its summary, in time
    local limit=$1 junit=$2
    shift 2
    # bench/pytest_stop.py: stop between tests at the deadline, and on SIGTERM stop as Ctrl-C does: the
    # summary and the JUnit file are written either way. FASTMT_AUTOTUNE=0: the tests' (and bench.aot's) policy
    CMD=(env FASTMT_AUTOTUNE=0 "$PY" -m pytest -q -p bench.pytest_stop
         "--stop-after-s=$((limit > 2 * PYTEST_RESERVE_S ? limit - PYTEST_RESERVE_S : limit / 2))")
    has_pytest_timeout && CMD+=(--timeout=120)  # a hung test fails alone
    CMD+=(-rfE --durations=15 "--junitxml=$junit" "$@")
}

step_command() {  # fills CMD for step $1 given its time limit $2
    local step=$1 limit=$2 extra=() smoke=() data_arg=() out_arg=() files=()
    ((${#DATA_FILES[@]})) && data_arg=(--data-files "${DATA_FILES[@]}")
    if [[ $REHEARSAL != 0 ]]; then out_arg=(--out "$WORK/bench/results"); fi
    case $step in
        kernel-test)  # every kernel test but the slow full grids: on CUDA each one runs there
            words extra "${KERNEL_TEST_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(-k "validation or dispatch")
            mapfile -t files < <(kernel_test_files)
            pytest_command "$limit" "$WORK/$LOGDIR/kernel-test.xml" "${files[@]}" -m "not slow" "${smoke[@]}" "${extra[@]}" ;;
        kernel-test-slow)  # the full CUDA grids (every dtype x width x flag, every shape)
            words extra "${KERNEL_TEST_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--collect-only)
            pytest_command "$limit" "$WORK/$LOGDIR/kernel-test-slow.xml" tests/kernels -m slow "${smoke[@]}" "${extra[@]}" ;;
        bench-kernels)
            words extra "${BENCH_KERNELS_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --only layernorm "${out_arg[@]}")
            # leave room for the worker's grace period and the writing of the outputs
            local budget=$((limit > 150 ? limit - 75 : limit / 2))
            CMD=("$PY" -m bench.kernels --groups corpus,ln --budget-s "$budget" "${data_arg[@]}" "${smoke[@]}" "${extra[@]}") ;;
        train)  # what `make train` runs on CUDA, from a cold compile cache, ending in time for its test and plot
            words extra "${TRAIN_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--run.out_dir "$WORK/runs" --data.dataset toy --data.toy_rows 1200
                                           --data.valid_size 100 --data.test_size 100
                                           --run.epochs 1)
            # fastmt refuses a flag given twice: TRAIN_ARGS's own --run.max_wall_seconds, --preset, data... win
            local own=()
            mentions --preset "${extra[@]}" || mentions --config "${extra[@]}" || own+=(--auto)
            mentions --run.progress "${extra[@]}" || own+=(--run.progress false)
            mentions --run.max_wall_seconds "${extra[@]}" \
                || own+=(--run.max_wall_seconds "$((limit > 2 * TRAIN_RESERVE_S ? limit - TRAIN_RESERVE_S : limit / 2))")
            mentions --data-files "${extra[@]}" || mentions --data.dataset "${extra[@]}" || own+=("${data_arg[@]}")
            CMD=("$PY" -m train "${own[@]}" --run.name "default-$RUN_ID" "${smoke[@]}" "${extra[@]}") ;;
        quality)  # this invocation's own run (a run name is never reused)
            CMD=("$PY" -m bench.quality --run "$WORK/runs/default-$RUN_ID" "${out_arg[@]}") ;;
        profile)  # after `train`: its compile is the warm-cache compile
            words extra "${PROFILE_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke "${out_arg[@]}")
            CMD=("$PY" -m bench.profile "${data_arg[@]}" "${smoke[@]}" "${extra[@]}") ;;
        frontier)
            words extra "${FRONTIER_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --budget-s 3 --work-dir "$WORK/runs" "${out_arg[@]}")
            CMD=("$PY" -m bench.frontier --budget-s "${FRONTIER_BUDGET_S:-75}" --grace-s 25 "${data_arg[@]}"
                 "${smoke[@]}" "${extra[@]}") ;;
        ladder)
            words extra "${LADDER_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke "${out_arg[@]}")
            CMD=("$PY" -m bench.ladder "${data_arg[@]}" --budget-s $((limit > 60 ? limit - 30 : limit / 2))
                 --cap-s 30 --steps 10 --warmup 3 "${smoke[@]}" "${extra[@]}") ;;
        sweep)  # the first evaluation (graph captures, decode tuning) must fit the grace
            words extra "${SWEEP_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --budget-s 3 --work-dir "$WORK/runs" "${out_arg[@]}")
            CMD=("$PY" -m bench.sweep --budget-s "${SWEEP_BUDGET_S:-75}" --grace-s 30
                 --settings "${SWEEP_SETTINGS:-$SWEEP_ADAMW}" "${data_arg[@]}" "${smoke[@]}" "${extra[@]}") ;;
        inference)
            words extra "${INFERENCE_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--sentences 16 --train-steps 20)
            CMD=("$PY" -m bench.inference --out "$WORK/bench/results" "${smoke[@]}" "${extra[@]}") ;;
    esac
}

if [[ $MODE == show ]]; then  # the command as the step would run it (default limit, no setup)
    WORK=$ROOT
    LOGDIR=runs/gpu_run/$RUN_ID
    read_data_files >/dev/null
    step_command "$SHOW_STEP" "$(limit_of "$SHOW_STEP")"
    printf '%s\n' "${CMD[@]}"
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# Scratch space, logs, results
# ---------------------------------------------------------------------------------------------
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fastmt-gpu-run.XXXXXX") || { echo "gpu_run: mktemp -d failed" >&2; exit 2; }
trap 'rm -rf "$SCRATCH"' EXIT
if [[ $REHEARSAL != 0 ]]; then
    WORK=$SCRATCH/work   # runs/ and bench/results/ of the rehearsal: the checkout stays as it is
    mkdir -p "$WORK/bench/results" "$WORK/runs"
else
    WORK=$ROOT
fi
LOGDIR=runs/gpu_run/$RUN_ID   # relative to WORK
mkdir -p "$WORK/$LOGDIR"
SUMMARY=$WORK/$LOGDIR/summary.txt
DEST=${OUT:-$ROOT/runs/gpu_run}
mkdir -p "$DEST"
declare -A STATUS=() SECS=()

log() { echo "[gpu_run +$((SECONDS))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE_S - SECONDS - PACK_RESERVE_S)); }

# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------
setup() {
    log "steps: ${STEPS[*]} | deadline ${DEADLINE_S}s | logs $WORK/$LOGDIR | results -> $DEST" \
        "$([[ $REHEARSAL != 0 ]] && echo "| REHEARSAL on $(uname -n): smoke forms, $PY")"
    export PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
    export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
    export HF_HOME=$SCRATCH/hf-home
    [[ -n ${PYTHONPATH:-} ]] && log "PYTHONPATH=$PYTHONPATH from the environment is dropped (only this run's folders)"
    unset PYTHONPATH
    local site=$SCRATCH/site wheels=()
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]})); then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "${wheels[@]}" >"$WORK/$LOGDIR/setup-pip.log" 2>&1; then
            export PYTHONPATH=$site
            log "installed ${#wheels[@]} carried wheels into $site (PYTHONPATH): $(cd .whl && echo *.whl)"
        else
            log "WARNING: installing .whl/*.whl failed (setup-pip.log; PYTHONPATH left unset): $(tail -n 2 "$WORK/$LOGDIR/setup-pip.log" | tr '\n' ' ')"
        fi
    else
        log "WARNING: no .whl/*.whl: run 'make gpu-wheels' on a CPU machine and carry .whl (datasets, lion-pytorch are missing here)"
    fi

    local warning
    read_data_files >"$SCRATCH/data-warnings"
    while IFS= read -r warning; do log "$warning"; done <"$SCRATCH/data-warnings"
    if ((${#DATA_FILES[@]})); then
        if [[ -f .data/SHA256SUMS ]]; then
            (cd .data && sha256sum --quiet -c SHA256SUMS) >>"$SUMMARY" 2>&1 || log "WARNING: .data checksums differ"
        fi
        FASTMT_DATA_FILES=$(IFS=:; echo "${DATA_FILES[*]}")  # the OS path separator, as data/config.py reads it
        export FASTMT_DATA_FILES
        log "data: FASTMT_DATA_FILES=$FASTMT_DATA_FILES ($(du -ch "${DATA_FILES[@]}" | tail -n 1 | cut -f1))"
    elif [[ $REHEARSAL != 0 ]]; then
        log "data: none (rehearsal: the steps' smoke forms use the generated toy corpus)"
    else
        log "WARNING: no .data/FILES: ladder, profile and training have no local data and no network"
    fi

    if [[ -z ${FASTMT_GIT_SHA:-} ]]; then
        FASTMT_GIT_SHA=$(git rev-parse HEAD 2>/dev/null || echo unknown)
        export FASTMT_GIT_SHA
    fi
    log "git: $FASTMT_GIT_SHA$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"

    # our Triton kernels compiled ahead of time for sm_90 (bench/aot.py): a warm cache if the keys match
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$SCRATCH/triton-cache}
    mkdir -p "$TRITON_CACHE_DIR"
    if [[ -f .whl/triton-aot-sm90.tgz ]]; then
        tar -xzf .whl/triton-aot-sm90.tgz -C "$TRITON_CACHE_DIR" 2>>"$WORK/$LOGDIR/setup-aot.log"
        log "triton cache: $(triton_entries) kernels compiled ahead of time in $TRITON_CACHE_DIR;" \
            "$(env -u TRITON_INTERPRET "$PY" -m bench.aot --check "$TRITON_CACHE_DIR/AOT-KEYS.json" 2>&1 | tail -n 1)"
    else
        log "triton cache: no .whl/triton-aot-sm90.tgz (GPU_AOT=1 make gpu-wheels builds it): every kernel compiles here"
    fi
    has_pytest_timeout || log "WARNING: pytest-timeout is missing: no per-test timeout (the steps' deadlines still hold)"

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
             "pytest-timeout", "hypothesis", "transformers", "ctranslate2"):
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
import importlib.util
for mod in ("datasets", "lion_pytorch"):  # found, not imported: lion_pytorch's triton path may call exit()
    print(f"module {mod}: {'found' if importlib.util.find_spec(mod) else 'MISSING'}")
EOF
    } >"$WORK/$LOGDIR/setup-env.log" 2>&1
    cat "$WORK/$LOGDIR/setup-env.log" >>"$SUMMARY"
    grep -A1 -E "^name, driver_version" "$WORK/$LOGDIR/setup-env.log" | sed 's/^/  /'
    grep -E "^torch |^python |REQUIREMENT|requirements:|^module " "$WORK/$LOGDIR/setup-env.log" | sed 's/^/  /'
}

run_step() {
    local step=$1 limit remaining rc t0
    limit=$(limit_of "$step")
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
    # TERM at the limit (pytest writes its summary, the frontier and sweep kill their contestants' process
    # groups), KILL 15 s later; `timeout` signals its whole process group, the step's children included
    timeout --signal=TERM --kill-after=15 "$limit" "${CMD[@]}" >"$WORK/$LOGDIR/$step.log" 2>&1 </dev/null
    rc=$?
    SECS[$step]=$((SECONDS - t0))
    log "$step compiled $(( $(triton_entries) - cached )) Triton kernels here (not in the cache; ours and Inductor's)"
    case $rc in
        0) STATUS[$step]=ok ;;
        124 | 137) STATUS[$step]="TIMEOUT after ${limit}s (rc $rc)" ;;
        *) STATUS[$step]="FAILED (rc $rc)" ;;
    esac
    log "END $step: ${STATUS[$step]} in ${SECS[$step]}s -> $LOGDIR/$step.log"
    tail -n 12 "$WORK/$LOGDIR/$step.log" | sed 's/^/    /'
}

# ---------------------------------------------------------------------------------------------
# Packing: one tarball + summary.txt (the device returns at most 8 files of 16 MiB)
# ---------------------------------------------------------------------------------------------
pack() {
    local list=$SCRATCH/pack-list tgz=$DEST/results.tgz size
    {
        cd "$WORK" || return
        find bench/results -type f 2>/dev/null
        find "$LOGDIR" -type f 2>/dev/null
        find runs -mindepth 2 -maxdepth 2 -type f \( -name metrics.jsonl -o -name provenance.json -o -name '*.png' \) \
            ! -path 'runs/gpu_run/*' 2>/dev/null
    } | sort -u >"$list"
    tar -C "$WORK" -czf "$tgz.tmp" -T "$list" 2>>"$SCRATCH/pack.log"
    size=$(stat -c %s "$tgz.tmp" 2>/dev/null || echo 0)
    if ((size > MAX_TGZ_BYTES)); then
        local kept=$SCRATCH/pack-kept
        : >"$kept"
        while IFS= read -r f; do
            if (($(stat -c %s "$WORK/$f") > BIG_FILE_BYTES)); then
                echo "left out of results.tgz (over $((BIG_FILE_BYTES / 1048576)) MiB): $f" >>"$SCRATCH/pack.log"
            else
                echo "$f" >>"$kept"
            fi
        done <"$list"
        tar -C "$WORK" -czf "$tgz.tmp" -T "$kept" 2>>"$SCRATCH/pack.log"
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
        for s in "${STEPS[@]}"; do printf '  %-16s %-40s %6ss\n' "$s" "${STATUS[$s]:-not run}" "${SECS[$s]:-0}"; done
        for s in "${STEPS[@]}"; do
            [[ -f $WORK/$LOGDIR/$s.log ]] || continue
            echo
            echo "==== tail of $s.log"
            if [[ $s == bench-kernels ]] && grep -q "== bench.kernels summary" "$WORK/$LOGDIR/$s.log"; then
                sed -n '/== bench.kernels summary/,$p' "$WORK/$LOGDIR/$s.log" | tail -n 60
            else
                tail -n 30 "$WORK/$LOGDIR/$s.log"
            fi
        done
        echo
        [[ -f $SCRATCH/pack.log ]] && cat "$SCRATCH/pack.log"
    } >>"$SUMMARY"
    pack
    echo "[gpu_run +${SECONDS}s] packed $DEST/results.tgz ($((PACKED_BYTES / 1024)) KB) and $DEST/summary.txt" | tee -a "$SUMMARY"
    cp -f "$SUMMARY" "$DEST/summary.txt"
    sed -n '/^==== steps/,$p' "$SUMMARY" | tail -n 120
}

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
