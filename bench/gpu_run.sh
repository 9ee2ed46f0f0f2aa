#!/usr/bin/env bash
# The GPU runbook: everything fastmt measures on a GPU (H100 or H200), in packets of one device call each, from
# one command on a bare device machine (torch 2.11 + triton 3.6 in the image's python3, no network). A session
# lent a GPU has 15 minutes of device time in all: the packets, their steps and limits are bench/packets.py's
# one table. See bench/README.md ("A 15-minute GPU session").
#
#   bash bench/gpu_run.sh packet1             every session's first call (<= 300 s): `make train` cold to BLEU,
#                                             its record, the kernel tests on the device, training path first
#   bash bench/gpu_run.sh packet2             only when packet 1 came back clean (<= 240 s): the HF baseline,
#                                             same split, same wall budget, compared with packet 1's run
#   bash bench/gpu_run.sh next                the first packet with no landed result for the current code
#   bash bench/gpu_run.sh plan                every packet's steps and limits, the session's arithmetic (900 s)
#   bash bench/gpu_run.sh PACKET|STEP ...     any packet (`plan` lists them) or step on its own
#   bash bench/gpu_run.sh show STEP [PACKET]  the step's command, one word per line (what a test collects)
#   GPU_RUN_REHEARSAL=1 bash bench/gpu_run.sh packet1   the rehearsal on a CPU machine: every step in its smoke
#                                             form (the train step compiled with Inductor on the CPU, the `fast`
#                                             preset's structure at a tiny size), the same $OUT layout (CI runs it)
# Back on the CPU machine: `python3 -m bench.packets land /work/.device/N` puts a call's results under
# bench/results/ and appends its record to bench/results/packets.jsonl (commit both).
#
# Steps:
#   train             python3 -m train --auto --run.max_wall_seconds <limit - 35>: `make train`'s run, truly cold
#                     (empty Triton and Inductor caches; the AOT cache is unpacked by the later `aot` step), with
#                     nvidia-smi sampling the GPU's utilization beside it
#   quality           python3 -m bench.quality --add-thresholds 10,15: the run's time-to-BLEU record and numbers
#                     (the wall split setup/compile/train/eval/checkpoints, step ms, host ms a step, MFU, graphs a
#                     step, GPU busy share, steps/s, tokens/s, recompiles after warm-up, graph breaks, peak memory;
#                     null where the run did not record one); exits 1 on a recompile after warm-up or a graph break
#   aot               unpack .whl/triton-aot-sm90.tgz into the Triton cache and check its keys (bench.aot --check)
#   kernel-test       pytest of bench.packets.kernel_test_files(), -m "not slow": the LayerNorm N=1 cases first
#                     (bench.packets.KERNEL_TESTS_FIRST), then the training path's kernels, Lion after them, no
#                     CPU-only test; each outcome streamed to a file as it finishes
#   peers             python3 -m bench.peers --preset fast --max-wall-seconds <packet 1's train budget>
#   compare           python3 -m bench.quality --compare: BLEU at equal wall time, seconds to common thresholds
#   train-cold, train-warm  the compile-warm packet: `train`'s job cut short (--run.max_steps), twice in one call,
#                     the second with the caches the first filled: compile seconds cold and warm (issue 43)
#   peers-eole        python3 -m bench.peers --peer eole: eole on the same split, its own recipe (issue 44)
#   batch-sweep       python3 -m bench.batch_sweep: tokens a step x lr/warm-up, seconds to BLEU 15 and 20 (issue 42)
#   bench-kernels, frontier, profile, ladder, sweep, kernel-test-slow, inference: the queue's benchmarks
#
# Each step runs under its own time limit and log, in its own process group, and the script goes on after
# a failure. No step starts past the deadline (GPU_RUN_DEADLINE_S; default: the packets' command time); each
# gets min(its limit, what is left after a minimum share for the steps after it). After every step the
# results are packed again, so what finished comes back even if the call is cut short:
#   $OUT/results.tgz   the files this run wrote under bench/results/ (its packet-record.json among them), this
#                      run's logs (runs/gpu_run/<id>/), runs/*/metrics.jsonl, provenance.json and *.png (files
#                      over 2 MiB left out past 15 MiB)
#   $OUT/summary.txt   setup facts, one line per step, the packet's record (every number), the tails of the logs
# and the script checks that $OUT is within what a device call brings back (bench.packets check-out). An OUT it
# cannot write (a file, a link to nothing, a folder it cannot make or write) is refused before any step (exit 2).
# Without $OUT (by hand), both land in runs/gpu_run/.
#
# Environment: PYTHON (default python3; .venv/bin/python in a rehearsal); GPU_RUN_DEADLINE_S;
# LIMIT_<STEP> (seconds, e.g. LIMIT_KERNEL_TEST); extra arguments, as shell words (quotes kept):
# KERNEL_TEST_ARGS, BENCH_KERNELS_ARGS, TRAIN_ARGS, PEERS_ARGS, PROFILE_ARGS, FRONTIER_ARGS, LADDER_ARGS,
# SWEEP_ARGS, INFERENCE_ARGS, BATCH_SWEEP_ARGS; FASTMT_GIT_SHA: the commit, recorded in results when the copy on the machine
# has no .git.
set -uo pipefail
{  # the whole script is read before any of it runs: an edit of this file during a run cannot change the run

PACK_RESERVE_S=15     # kept back from the last step for the final pack (bench.packets.PACK_S)
PYTEST_RESERVE_S=40   # at most this much of a pytest step's limit is kept for the test in flight and the summary
LATER_SHARE_S=30      # a step leaves at least min(this, their limit) to each step after it
MAX_TGZ_BYTES=$((15 * 1024 * 1024))
BIG_FILE_BYTES=$((2 * 1024 * 1024))
REHEARSAL=${GPU_RUN_REHEARSAL:-0}
[[ $REHEARSAL == 0 || $REHEARSAL == "" ]] && REHEARSAL=0

usage() { sed -n '2,20p' "$0"; exit 2; }

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

# ---------------------------------------------------------------------------------------------
# The packets' table (bench/packets.py): steps, limits, the packet's own arguments per step
# ---------------------------------------------------------------------------------------------
declare -A PACKET_STEPS=() PACKET_S=() STEP_ARGS=() STEP_LIMIT=() DEFAULT_LIMIT=()
PACKETS=()
KTEST_FILES=()
KTEST_FIRST=()
TRAIN_RESERVE_S=35
SETUP_S=25
table=$("$PY" -m bench.packets table) || { echo "gpu_run: python3 -m bench.packets table failed (with $PY)" >&2; exit 2; }
while IFS= read -r line; do
    read -r kind a b c rest <<<"$line"
    case $kind in
        PACKET) PACKETS+=("$a"); PACKET_STEPS[$a]=""; PACKET_S[$a]=$rest; SETUP_S=$b ;;
        STEP) PACKET_STEPS[$a]+="$b "; STEP_LIMIT[$a:$b]=$c; STEP_ARGS[$a:$b]=$rest ;;
        LIMIT) DEFAULT_LIMIT[$a]=$b ;;
        KTEST) read -r -a KTEST_FILES <<<"${line#KTEST }" ;;
        KFIRST) read -r -a KTEST_FIRST <<<"${line#KFIRST }" ;;
        RESERVE) TRAIN_RESERVE_S=$b ;;
    esac
done <<<"$table"
# a rehearsal runs on a CPU, which is slower than the GPU every limit was sized for: its limits are scaled
SCALE=1
[[ $REHEARSAL != 0 ]] && SCALE=${GPU_RUN_REHEARSAL_SCALE:-4}

limit_of() {  # limit_of STEP [PACKET]: LIMIT_<STEP>, else the packet's limit for it, else the step's default
    local var=LIMIT_${1//-/_}
    var=${var^^}
    if [[ -n ${!var:-} ]]; then echo "${!var}"
    elif [[ -n ${2:-} && -n ${STEP_LIMIT[$2:$1]+x} ]]; then echo "$((STEP_LIMIT[$2:$1] * SCALE))"
    else echo "$((DEFAULT_LIMIT[$1] * SCALE))"
    fi
}

# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
RUN=()          # "packet:step" pairs in order ("-:step" for a step named on its own)
PACKETS_RUN=()
MODE=run
SHOW_STEP=
SHOW_PACKET=-
while (($#)); do
    arg=$1
    shift
    case $arg in
        plan) exec "$PY" -m bench.packets plan ;;
        next) exec "$PY" -m bench.packets next ;;
        show) MODE=show; SHOW_STEP=${1:-}; shift || true
              [[ -n $SHOW_STEP && -n ${DEFAULT_LIMIT[$SHOW_STEP]+x} ]] \
                  || { echo "gpu_run: show STEP [PACKET]: STEP one of ${!DEFAULT_LIMIT[*]} (got '$SHOW_STEP')" >&2; exit 2; }
              if [[ -n ${1:-} && -n ${PACKET_STEPS[$1]+x} ]]; then SHOW_PACKET=$1; shift; fi ;;
        -h | --help) usage ;;
        *)
            if [[ -n ${PACKET_STEPS[$arg]+x} ]]; then
                PACKETS_RUN+=("$arg")
                for s in ${PACKET_STEPS[$arg]}; do RUN+=("$arg:$s"); done
            elif [[ -n ${DEFAULT_LIMIT[$arg]+x} ]]; then
                RUN+=("-:$arg")
            else
                echo "gpu_run: unknown packet or step '$arg' (packets: ${PACKETS[*]}; steps: ${!DEFAULT_LIMIT[*]})" >&2
                usage
            fi ;;
    esac
done
for var in KERNEL_TEST_ARGS BENCH_KERNELS_ARGS TRAIN_ARGS PEERS_ARGS PROFILE_ARGS FRONTIER_ARGS LADDER_ARGS SWEEP_ARGS INFERENCE_ARGS BATCH_SWEEP_ARGS; do
    # before anything runs: a value the shell could not split (an open quote) would otherwise lose its words
    "$PY" -c 'import shlex, sys; shlex.split(sys.argv[1])' "${!var:-}" 2>/dev/null \
        || { echo "gpu_run: $var=${!var} is not valid shell words (an unclosed quote?): fix its quoting" >&2; exit 2; }
done
if [[ $MODE == run ]] && ((${#RUN[@]} == 0)); then
    echo "gpu_run: name a packet (every session starts with packet1; 'next' says which) or a step" >&2
    usage
fi

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

mentions() {  # mentions FLAG WORD...: is FLAG among the words (as FLAG or FLAG=VALUE)?
    local flag=$1 w
    shift
    for w in "$@"; do [[ $w == "$flag" || $w == "$flag="* ]] && return 0; done
    return 1
}

pytest_command() {  # pytest_command LIMIT NAME SELECTION-ARGS...: pytest that ends, with its summary, in time
    local limit=$1 name=$2 margin
    shift 2
    # the test in flight when the stop passes, the summary and the JUnit file get `margin` seconds: a quarter of
    # the limit, at least 8 s, at most PYTEST_RESERVE_S (a 70 s step stops starting tests at 53 s)
    margin=$((limit / 4))
    ((margin < 8)) && margin=8
    ((margin > PYTEST_RESERVE_S)) && margin=$PYTEST_RESERVE_S
    # bench/pytest_stop.py: stop between tests at the deadline, on SIGTERM stop as Ctrl-C does (summary and JUnit
    # written), every finished test's outcome streamed to <name>.outcomes.jsonl. FASTMT_AUTOTUNE=0: the tests'
    # (and bench.aot's) policy
    CMD=(env FASTMT_AUTOTUNE=0 "$PY" -m pytest -q -p bench.pytest_stop "--stop-after-s=$((limit - margin))"
         "--outcomes=$WORK/$LOGDIR/$name.outcomes.jsonl")
    # a hung test ends the session (its thread dumps the stacks and exits): the outcomes file keeps the rest
    has_pytest_timeout && CMD+=(--timeout=$((limit / 2 > 120 ? 120 : limit / 2)) --timeout-method=thread)
    CMD+=(-rfE --durations=15 "--junitxml=$WORK/$LOGDIR/$name.xml" "$@")
}

latest_run() {  # latest_run PREFIX: the newest runs/PREFIX-* folder with a metrics.jsonl (this machine's)
    local d best=
    for d in "$WORK"/runs/"$1"-*/; do
        [[ -f $d/metrics.jsonl ]] || continue
        [[ -z $best || $d -nt $best ]] && best=$d
    done
    echo "${best%/}"
}

committed_packet1_run() {  # the run folder of the newest landed packet1 (bench/results/packets.jsonl), checked
    "$PY" -m bench.packets last-run packet1 2>/dev/null
}

step_command() {  # fills CMD for step $1 of packet $2 ("-": on its own) given its time limit $3
    local step=$1 packet=$2 limit=$3 extra=() own=() smoke=() data_arg=() out_arg=()
    words own "${STEP_ARGS[$packet:$step]:-}"
    ((${#DATA_FILES[@]})) && data_arg=(--data-files "${DATA_FILES[@]}")
    if [[ $REHEARSAL != 0 ]]; then out_arg=(--out "$WORK/bench/results"); fi
    case $step in
        kernel-test)  # the GPU kernel tests but the slow full grids, training path first
            words extra "${KERNEL_TEST_ARGS:-}"
            if ((${#KTEST_FILES[@]} == 0)); then  # never a bare pytest: it would collect the whole tree
                CMD=(sh -c 'echo "gpu_run: bench.packets found no tests/kernels files"; exit 2'); return
            fi
            [[ $REHEARSAL != 0 ]] && smoke=(-k "validation or dispatch")
            local first=() pattern
            for pattern in "${KTEST_FIRST[@]}"; do first+=("--first=$pattern"); done  # the LayerNorm N=1 cases first
            pytest_command "$limit" kernel-test "${first[@]}" "${KTEST_FILES[@]}" -m "not slow" "${own[@]}" "${smoke[@]}" "${extra[@]}" ;;
        kernel-test-slow)  # the full CUDA grids (every dtype x width x flag, every shape)
            words extra "${KERNEL_TEST_ARGS:-}"
            if ((${#KTEST_FILES[@]} == 0)); then
                CMD=(sh -c 'echo "gpu_run: bench.packets found no tests/kernels files"; exit 2'); return
            fi
            [[ $REHEARSAL != 0 ]] && smoke=(--collect-only)
            pytest_command "$limit" kernel-test-slow "${KTEST_FILES[@]}" -m slow "${own[@]}" "${smoke[@]}" "${extra[@]}" ;;
        bench-kernels)
            words extra "${BENCH_KERNELS_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --only layernorm "${out_arg[@]}")
            # leave room for the worker's grace period and the writing of the outputs
            local budget=$((limit > 150 ? limit - 75 : limit / 2))
            mentions --groups "${own[@]}" "${extra[@]}" || own=(--groups corpus,ln "${own[@]}")
            CMD=("$PY" -m bench.kernels --budget-s "$budget" "${data_arg[@]}" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        train | train-cold | train-warm)  # what `make train` runs on CUDA, from cold caches (train-warm: the caches
            # train-cold filled in this call), ending in time for its test and plot
            words extra "${TRAIN_ARGS:-}"
            local mine=() run_name=default-$RUN_ID
            [[ $step == train-cold ]] && run_name=cold-$RUN_ID
            [[ $step == train-warm ]] && run_name=warm-$RUN_ID
            if [[ $REHEARSAL != 0 ]]; then
                # the `fast` preset's structure (packed streams, regional compile, reduce-overhead, bf16) at a tiny
                # size, compiled by Inductor on the CPU: a recompile after warm-up or a graph break fails `quality`
                smoke=(--preset fast --run.device cpu --run.compile true --model.d_model 64 --model.n_heads 4
                       --model.d_ff 128 --model.enc_layers 2 --model.dec_layers 2 --data.dataset toy
                       --data.toy_rows 1200 --data.valid_size 40 --data.test_size 20 --data.vocab_size 500
                       --data.max_tokens 1024 --data.num_workers 0 --run.epochs 2 --run.max_batches_per_epoch 4
                       --eval.max_sentences 10 --eval.batch_size 16 --run.out_dir "$WORK/runs")
            fi
            # fastmt refuses a flag given twice: TRAIN_ARGS's own --run.max_wall_seconds, --preset, data... win
            mentions --preset "${extra[@]}" "${smoke[@]}" || mentions --config "${extra[@]}" || mine+=(--auto)
            mentions --run.progress "${extra[@]}" || mine+=(--run.progress false)
            mentions --run.max_wall_seconds "${extra[@]}" \
                || mine+=(--run.max_wall_seconds "$((limit > 2 * TRAIN_RESERVE_S ? limit - TRAIN_RESERVE_S : limit / 2))")
            mentions --data-files "${extra[@]}" || mentions --data.dataset "${extra[@]}" "${smoke[@]}" \
                || mine+=("${data_arg[@]}")
            CMD=("$PY" -m train "${mine[@]}" --run.name "$run_name" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        quality)  # this invocation's own run (a run name is never reused)
            CMD=("$PY" -m bench.quality --run "$WORK/runs/default-$RUN_ID" --gpu-samples "$WORK/$LOGDIR/train-gpu.csv"
                 --require-stable-graphs "${own[@]}" "${out_arg[@]}") ;;
        aot)
            CMD=(true) ;;  # done in run_step (it changes this shell's Triton cache)
        peers)  # the HF baseline under packet 1's training wall budget, on the same split
            words extra "${PEERS_ARGS:-}"
            local budget=$(($(limit_of train packet1) - TRAIN_RESERVE_S))
            [[ $REHEARSAL != 0 ]] && smoke=(--preset tiny --data.dataset toy --data.toy_rows 1200 --data.valid_size 100
                                           --data.test_size 100 --max-steps 4 --batch-size 16 --eval.max_sentences 20)
            local mine=()
            mentions --preset "${extra[@]}" "${smoke[@]}" || mine+=(--preset fast)
            mentions --data-files "${extra[@]}" || mentions --data.dataset "${extra[@]}" "${smoke[@]}" \
                || mine+=("${data_arg[@]}")
            CMD=("$PY" -m bench.peers "${mine[@]}" --max-wall-seconds "$budget" --name "hf-$RUN_ID"
                 --out-dir "$WORK/runs" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        peers-eole)  # issue 44: eole (OpenNMT-py's successor) on the same split, its own recipe (bench/peers.py)
            words extra "${PEERS_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--preset tiny --data.dataset toy --data.toy_rows 1200 --data.valid_size 100
                                           --data.test_size 100 --max-steps 4 --batch-size 16 --eval.max_sentences 20)
            local mine=()
            mentions --preset "${extra[@]}" "${smoke[@]}" || mine+=(--preset fast)
            mentions --data-files "${extra[@]}" || mentions --data.dataset "${extra[@]}" "${smoke[@]}" \
                || mine+=("${data_arg[@]}")
            local peers_path=()  # eole's wheels (make gpu-wheels GPU_WHEELS_PEERS=1), installed for this step only
            [[ -n $(compgen -G ".whl/peers/*.whl") ]] \
                && peers_path=(env "PYTHONPATH=${SCRATCH:-<scratch>}/site-peers${PYTHONPATH:+:$PYTHONPATH}")
            CMD=("${peers_path[@]}" "$PY" -m bench.peers --peer eole "${mine[@]}"
                 --max-wall-seconds "$((limit > 60 ? limit - 40 : limit / 2))"
                 --name "eole-$RUN_ID" --out-dir "$WORK/runs" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        batch-sweep)  # issue 42: tokens a step x lr/warm-up, seconds to valid BLEU 15 and 20 (bench/batch_sweep.py)
            words extra "${BATCH_SWEEP_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke)
            CMD=("$PY" -m bench.batch_sweep "${data_arg[@]}" --work-dir "$WORK/runs" --out "$WORK/bench/results"
                 "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        compare)  # packet 1's run on this machine, else the newest landed one, against this call's HF run
            local a
            a=$(latest_run default)
            [[ -n $a ]] || a=$(committed_packet1_run)
            CMD=("$PY" -m bench.quality --compare "${a:-<no packet1 run: run packet1 first>}" "$WORK/runs/hf-$RUN_ID"
                 "${out_arg[@]}") ;;
        profile)  # after `train`: its compile is the warm-cache compile
            words extra "${PROFILE_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke "${out_arg[@]}")
            CMD=("$PY" -m bench.profile "${data_arg[@]}" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        frontier)
            words extra "${FRONTIER_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --budget-s 3 --work-dir "$WORK/runs" "${out_arg[@]}")
            CMD=("$PY" -m bench.frontier "${data_arg[@]}" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        ladder)
            words extra "${LADDER_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke "${out_arg[@]}")
            CMD=("$PY" -m bench.ladder "${data_arg[@]}" --budget-s $((limit > 60 ? limit - 30 : limit / 2))
                 --cap-s 30 --steps 10 --warmup 3 "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        sweep)  # the first evaluation (graph captures, decode tuning) must fit the grace
            words extra "${SWEEP_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--smoke --budget-s 3 --work-dir "$WORK/runs" "${out_arg[@]}")
            mentions --settings "${own[@]}" "${extra[@]}" || own=(--settings adamw-base,adamw-8e-4,adamw-3e-4 "${own[@]}")
            CMD=("$PY" -m bench.sweep "${data_arg[@]}" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
        inference)
            words extra "${INFERENCE_ARGS:-}"
            [[ $REHEARSAL != 0 ]] && smoke=(--sentences 16 --train-steps 20)
            CMD=("$PY" -m bench.inference --out "$WORK/bench/results" "${own[@]}" "${smoke[@]}" "${extra[@]}") ;;
    esac
}

if [[ $MODE == show ]]; then  # the command as the step would run it (default limit, no setup)
    WORK=$ROOT
    LOGDIR=runs/gpu_run/$RUN_ID
    read_data_files >/dev/null
    step_command "$SHOW_STEP" "$SHOW_PACKET" "$(limit_of "$SHOW_STEP" "$SHOW_PACKET")"
    printf '%s\n' "${CMD[@]}"
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# OUT: what comes back. Refused before any step when the runbook could not write there (a file, a link to
# nothing, a folder that cannot be made or written): the device time would be spent and nothing come back
# ---------------------------------------------------------------------------------------------
DEST=${OUT:-$ROOT/runs/gpu_run}
out_refused() { echo "gpu_run: OUT=$DEST $1: nothing would come back; give OUT a folder this user can write" >&2; exit 2; }
if [[ -L $DEST && ! -e $DEST ]]; then out_refused "is a symbolic link to nothing (to $(readlink -- "$DEST"))"
elif [[ -e $DEST && ! -d $DEST ]]; then out_refused "is not a folder"
elif ! mkdir -p -- "$DEST" 2>/dev/null; then out_refused "cannot be created ($(mkdir -p -- "$DEST" 2>&1 | sed 's/^mkdir: //'))"
fi
probe=$(mktemp "$DEST/.gpu_run-probe.XXXXXX" 2>/dev/null) || out_refused "is not writable"
rm -f -- "$probe"

# ---------------------------------------------------------------------------------------------
# Scratch space, logs, results
# ---------------------------------------------------------------------------------------------
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fastmt-gpu-run.XXXXXX") || { echo "gpu_run: mktemp -d failed" >&2; exit 2; }
SAMPLER=
trap '[[ -n $SAMPLER ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT
if [[ $REHEARSAL != 0 ]]; then
    WORK=$SCRATCH/work   # runs/ and bench/results/ of the rehearsal: the checkout stays as it is
    mkdir -p "$WORK/bench/results" "$WORK/runs"
else
    WORK=$ROOT
fi
LOGDIR=runs/gpu_run/$RUN_ID   # relative to WORK
mkdir -p "$WORK/$LOGDIR" "$WORK/bench/results"
SUMMARY=$WORK/$LOGDIR/summary.txt
touch "$SCRATCH/started"   # what this run writes under bench/results is what is newer than this
declare -A STATUS=() SECS=()
CACHES=

# the deadline: the packets' command time (or setup + the loose steps' limits + the pack)
if [[ -z ${GPU_RUN_DEADLINE_S:-} ]]; then
    DEADLINE_S=$SETUP_S
    for item in "${RUN[@]}"; do DEADLINE_S=$((DEADLINE_S + $(limit_of "${item#*:}" "${item%%:*}"))); done
    DEADLINE_S=$((DEADLINE_S + PACK_RESERVE_S))
else
    DEADLINE_S=$GPU_RUN_DEADLINE_S
fi

log() { echo "[gpu_run +$((SECONDS))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE_S - SECONDS - PACK_RESERVE_S)); }

# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------
unpack_aot() {  # our Triton kernels compiled ahead of time for sm_90 (bench/aot.py): a warm cache if the keys match
    [[ $CACHES == *aot* ]] && return 0
    if [[ -f .whl/triton-aot-sm90.tgz ]]; then
        tar -xzf .whl/triton-aot-sm90.tgz -C "$TRITON_CACHE_DIR" 2>>"$WORK/$LOGDIR/setup-aot.log"
        log "triton cache: $(triton_entries) kernels compiled ahead of time in $TRITON_CACHE_DIR;" \
            "$(env -u TRITON_INTERPRET "$PY" -m bench.aot --check "$TRITON_CACHE_DIR/AOT-KEYS.json" 2>&1 | tail -n 1)"
        CACHES+=" aot"
    else
        log "triton cache: no .whl/triton-aot-sm90.tgz (make gpu-wheels builds it): every kernel compiles here"
    fi
}

setup() {
    log "run: ${RUN[*]} | deadline ${DEADLINE_S}s | logs $WORK/$LOGDIR | results -> $DEST" \
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
        if [[ $REHEARSAL == 0 ]]; then
            FASTMT_DATA_FILES=$(IFS=:; echo "${DATA_FILES[*]}")  # the OS path separator, as data/config.py reads it
            export FASTMT_DATA_FILES
            log "data: FASTMT_DATA_FILES=$FASTMT_DATA_FILES ($(du -ch "${DATA_FILES[@]}" | tail -n 1 | cut -f1))"
        else
            DATA_FILES=()  # the rehearsal's smoke forms train on the generated toy corpus, never on both
            log "data: .data/ is here but the rehearsal uses the generated toy corpus"
        fi
    elif [[ $REHEARSAL != 0 ]]; then
        log "data: none (rehearsal: the steps' smoke forms use the generated toy corpus)"
    else
        log "WARNING: no .data/FILES: training and the benchmarks have no local data and no network"
    fi

    if [[ -z ${FASTMT_GIT_SHA:-} ]]; then
        FASTMT_GIT_SHA=$(git rev-parse HEAD 2>/dev/null || echo unknown)
        export FASTMT_GIT_SHA
    fi
    log "git: $FASTMT_GIT_SHA$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"

    # cold caches: Triton's and Inductor's in this run's own scratch folder, empty (a warm machine's rerun too)
    export TRITON_CACHE_DIR=$SCRATCH/triton-cache TORCHINDUCTOR_CACHE_DIR=$SCRATCH/inductor-cache
    mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
    CACHES=cold
    local item trains=0
    for item in "${RUN[@]}"; do [[ ${item#*:} == train* || ${item#*:} == peers* || ${item#*:} == batch-sweep ]] && trains=1; done
    if ((trains)); then
        log "caches: Triton and Inductor empty for the training (the AOT cache is unpacked by the aot step)"
    else
        unpack_aot
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

start_sampler() {  # nvidia-smi's utilization every 500 ms into $1, beside the step (nothing without nvidia-smi)
    SAMPLER=
    command -v nvidia-smi >/dev/null || return 0
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500 \
        >"$1" 2>/dev/null &
    SAMPLER=$!
}

stop_sampler() {
    [[ -n $SAMPLER ]] || return 0
    kill "$SAMPLER" 2>/dev/null
    wait "$SAMPLER" 2>/dev/null
    SAMPLER=
}

run_step() {  # run_step PACKET STEP LATER: LATER = the minimum shares of the steps after it
    local packet=$1 step=$2 later=$3 limit remaining rc t0 key
    key=$step
    [[ $packet != - ]] && key="$packet:$step"
    limit=$(limit_of "$step" "$packet")
    remaining=$(left)
    if ((remaining < 15)); then
        STATUS[$key]="skipped (${remaining}s left before the deadline)"
        SECS[$key]=0
        log "SKIP $key: ${remaining}s left before the deadline"
        return
    fi
    ((limit > remaining - later)) && limit=$((remaining - later))
    ((limit < 15)) && limit=15
    t0=$SECONDS
    if [[ $step == aot ]]; then
        unpack_aot
        STATUS[$key]=ok
        SECS[$key]=$((SECONDS - t0))
        return
    fi
    if [[ $step == peers-eole && -n $(compgen -G ".whl/peers/*.whl") ]]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site-peers" \
            .whl/peers/*.whl >"$WORK/$LOGDIR/setup-pip-peers.log" 2>&1 \
            && log "installed $(ls .whl/peers/*.whl | wc -l) wheels of .whl/peers into $SCRATCH/site-peers for $key" \
            || log "WARNING: installing .whl/peers/*.whl failed (setup-pip-peers.log)"
    fi
    step_command "$step" "$packet" "$limit"
    log "START $key (limit ${limit}s): ${CMD[*]}"
    local cached term kill_after
    cached=$(triton_entries)
    [[ $step == train* || $step == peers* || $step == batch-sweep ]] && start_sampler "$WORK/$LOGDIR/$step-gpu.csv"
    # TERM before the limit (pytest writes its summary, the frontier and sweep kill their contestants' process
    # groups), KILL at the limit; `timeout` signals its whole process group, the step's children included
    kill_after=$((limit > 40 ? 10 : 3))
    term=$((limit - kill_after))
    timeout --signal=TERM --kill-after="$kill_after" "$term" "${CMD[@]}" >"$WORK/$LOGDIR/$step.log" 2>&1 </dev/null
    rc=$?
    stop_sampler
    SECS[$key]=$((SECONDS - t0))
    log "$key compiled $(( $(triton_entries) - cached )) Triton kernels here (not in the cache; ours and Inductor's)"
    case $rc in
        0) STATUS[$key]=ok ;;
        124 | 137) STATUS[$key]="TIMEOUT after ${limit}s (rc $rc)" ;;
        *) STATUS[$key]="FAILED (rc $rc)" ;;
    esac
    if [[ -f $WORK/$LOGDIR/$step.outcomes.jsonl ]]; then
        log "$key outcomes (streamed, kept whatever stopped the step): $("$PY" -m bench.pytest_stop "$WORK/$LOGDIR/$step.outcomes.jsonl")"
    fi
    log "END $key: ${STATUS[$key]} in ${SECS[$key]}s -> $LOGDIR/$step.log"
    tail -n 12 "$WORK/$LOGDIR/$step.log" | sed 's/^/    /'
}

# ---------------------------------------------------------------------------------------------
# Packing: one tarball + summary.txt, checked against what a device call brings back
# ---------------------------------------------------------------------------------------------
pack() {
    local list=$SCRATCH/pack-list tgz=$DEST/results.tgz size
    {
        cd "$WORK" || return
        find bench/results -type f -newer "$SCRATCH/started" 2>/dev/null
        find "$LOGDIR" -type f 2>/dev/null
        find runs -mindepth 2 -maxdepth 2 -type f \( -name metrics.jsonl -o -name provenance.json -o -name '*.png' \) \
            -newer "$SCRATCH/started" ! -path 'runs/gpu_run/*' 2>/dev/null
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
    if ((size > MAX_TGZ_BYTES)); then  # still too big: the records and the summary, nothing else
        grep -E '(\.md|\.json|\.jsonl|\.csv|summary\.txt|\.xml)$' "$list" >"$SCRATCH/pack-small" || true
        echo "results.tgz kept only records and logs: $size bytes was over $MAX_TGZ_BYTES" >>"$SCRATCH/pack.log"
        tar -C "$WORK" -czf "$tgz.tmp" -T "$SCRATCH/pack-small" 2>>"$SCRATCH/pack.log"
        size=$(stat -c %s "$tgz.tmp" 2>/dev/null || echo 0)
    fi
    if mv -f "$tgz.tmp" "$tgz" 2>>"$SCRATCH/pack.log" && cp -f "$SUMMARY" "$DEST/summary.txt" 2>>"$SCRATCH/pack.log"; then
        PACKED_BYTES=$size
        PACK_FAILED=
    else
        PACK_FAILED="$(tail -n 1 "$SCRATCH/pack.log")"
    fi
}

record() {  # the packet's record: bench/results/packet-record.json (one per packet run; the last packet's here)
    local packet=$1 item steps=() quality outcomes=()
    for item in "${RUN[@]}"; do
        [[ ${item%%:*} == "$packet" ]] || continue
        steps+=(--step "${item#*:}=${STATUS[$item]:-not run}=${SECS[$item]:-0}")
    done
    steps=("${steps[@]// /_}")
    quality=$(ls -t "$WORK"/bench/results/quality-*.json 2>/dev/null | head -n 1)
    [[ -n $quality && $quality -nt $SCRATCH/started ]] || quality=
    [[ $packet == packet1 ]] || quality=  # packet 1's quality step writes it; no other packet's record carries it
    [[ -f $WORK/$LOGDIR/kernel-test.outcomes.jsonl ]] && outcomes=(--outcomes "$WORK/$LOGDIR/kernel-test.outcomes.jsonl")
    local runs=()  # the compile-warm packet: its cold and warm runs' wall splits
    [[ -f $WORK/runs/cold-$RUN_ID/metrics.jsonl ]] && runs+=(--cold-run "$WORK/runs/cold-$RUN_ID")
    [[ -f $WORK/runs/warm-$RUN_ID/metrics.jsonl ]] && runs+=(--warm-run "$WORK/runs/warm-$RUN_ID")
    "$PY" -m bench.packets record --packet "$packet" "${steps[@]}" ${quality:+--quality "$quality"} "${outcomes[@]}" "${runs[@]}" \
        --caches "$CACHES" --out "$WORK/bench/results/packet-record.json" >>"$SUMMARY" 2>&1 \
        || log "WARNING: the packet record could not be written (see above)"
}

finish() {
    local p
    for p in "${PACKETS_RUN[@]}"; do record "$p"; done
    {
        echo
        echo "==== steps"
        for s in "${RUN[@]}"; do
            local key=${s#-:}
            printf '  %-24s %-40s %6ss\n' "$key" "${STATUS[$key]:-not run}" "${SECS[$key]:-0}"
        done
        if [[ -f $WORK/bench/results/packet-record.json ]]; then
            echo
            echo "==== packet record (every number; bench/results/packet-record.json)"
            cat "$WORK/bench/results/packet-record.json"
        fi
        for s in "${RUN[@]}"; do
            s=${s#*:}
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
    local problems
    problems=$("$PY" -m bench.packets check-out "$DEST" 2>&1) || log "WARNING: what comes back is over the device's limits: $problems"
    if [[ -n $PACK_FAILED ]]; then
        echo "gpu_run: could not write $DEST/results.tgz or summary.txt: $PACK_FAILED" | tee -a "$SUMMARY" >&2
        exit 2
    fi
    echo "[gpu_run +${SECONDS}s] packed $DEST/results.tgz ($((PACKED_BYTES / 1024)) KB) and $DEST/summary.txt" | tee -a "$SUMMARY"
    cp -f "$SUMMARY" "$DEST/summary.txt"
    sed -n '/^==== steps/,$p' "$SUMMARY" | tail -n 120
}

CMD=()
PACKED_BYTES=0
PACK_FAILED=
setup
pack
n=${#RUN[@]}
for ((i = 0; i < n; i++)); do
    later=0
    for ((j = i + 1; j < n; j++)); do
        l=$(limit_of "${RUN[j]#*:}" "${RUN[j]%%:*}")
        later=$((later + (l < LATER_SHARE_S ? l : LATER_SHARE_S)))
    done
    run_step "${RUN[i]%%:*}" "${RUN[i]#*:}" "$later"
    pack
done
finish
for s in "${RUN[@]}"; do
    [[ ${STATUS[${s#-:}]:-} == ok ]] || exit 1
done
exit 0
}
