#!/usr/bin/env bash
# Prepare the payload a bare GPU device machine needs (run on a CPU machine with PyPI access):
#   .whl/   the wheels the GPU image lacks, for its Python 3.12 on x86_64 (installed offline there
#           by bench/gpu_run.sh: pip --no-index --no-deps --target <its mktemp -d scratch folder>)
#   .data/  the training data (no network there), listed in .data/FILES, checksums in .data/SHA256SUMS
# Both folders are git-ignored and travel with the device call as `carry: [".whl", ".data"]`.
#
#   make gpu-wheels            (or: bash bench/gpu_wheels.sh)
#
# Carried: datasets and lion-pytorch (not in the image), dill and multiprocess (datasets' needs the image
# lacks), fsspec (datasets pins fsspec<=2026.9.0; the image's is likely newer). Versions come from ONE
# resolution for the GPU's platform (pip --dry-run --report), so they agree; bench/gpu_run.sh checks them.
#
# Environment:
#   PYTHON             interpreter whose pip is used (default: .venv/bin/python, else python3)
#   DATASETS_SPEC      default datasets==5.2.0 (what the CPU machines run, shared/ENV.md)
#   LION_SPEC          default lion-pytorch==0.2.5
#   GPU_WHEELS_EXTRA   more distributions to carry, space-separated (e.g. pyarrow if the image's is too old)
#   GPU_WHEELS_PEERS   1: also eole (EOLE_SPEC, default eole==0.6.4) and its run-time set into .whl/peers/
#                      (~21 MB; only the peers-eole step installs them)
#   FASTMT_DATA_FILES  data files to copy (':'-separated); default the stand-in corpus
#                      ../shared/data/opus_mt_testsets/en-it/train.jsonl
#   GPU_AOT            1 (default): also compile our Triton kernels for sm_90 (bench/aot.py, plans kernel-test
#                      and train) into .whl/triton-aot-sm90.tgz. Needs CPython 3.12 (Triton's cache key hashes
#                      libtriton, which differs per CPython build): the first time it builds .cache/aot-py312
#                      with torch 2.11 + triton 3.6 (~5 GB). 0: skip (the kernels compile on the device).
#   GPU_AOT_PYTHON     a CPython 3.12 with torch 2.11, triton 3.6, einops, numpy<2.4, sentencepiece, pytest
#                      and hypothesis to compile with, instead of .cache/aot-py312
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DATASETS_SPEC=${DATASETS_SPEC:-datasets==5.2.0}
LION_SPEC=${LION_SPEC:-lion-pytorch==0.2.5}
# shellcheck disable=SC2206  # word splitting of a space-separated list is intended
CARRY=(datasets dill multiprocess fsspec ${GPU_WHEELS_EXTRA:-})
STANDIN=../shared/data/opus_mt_testsets/en-it/train.jsonl
MAX_WHEELS_MB=16    # well under the 64 MiB a device call carries, data included
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

say() { echo "gpu_wheels: $*"; }
die() { echo "gpu_wheels: ERROR: $*" >&2; exit 1; }

for d in .whl .data; do
    git check-ignore -q "$d/x" 2>/dev/null || die "$d/ is not git-ignored: add '$d/' to .gitignore first"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# -- 1. resolve versions for the GPU's platform (metadata only) ---------------------------------
say "resolving $DATASETS_SPEC for cp312 manylinux x86_64 with $PY ($("$PY" -m pip --version | cut -d' ' -f1-2))"
if ! "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$tmp/report.json" \
        "${PLATFORM[@]}" --target "$tmp/target" "$DATASETS_SPEC" >"$tmp/resolve.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$tmp/resolve.log" >&2 || true
    die "pip could not resolve $DATASETS_SPEC (network? index?)"
fi
mapfile -t PINS < <("$PY" - "$tmp/report.json" "${CARRY[@]}" <<'EOF'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
report = json.load(open(sys.argv[1]))
resolved = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
for name in sys.argv[2:]:
    if norm(name) not in resolved:
        sys.exit(f"{name} is not in the resolution of datasets' dependencies: {sorted(resolved)}")
    print(f"{norm(name)}=={resolved[norm(name)]}")
EOF
)
say "carrying: ${PINS[*]} $LION_SPEC"

# -- 2. download exactly those wheels into a fresh folder ---------------------------------------
mkdir -p "$tmp/whl"
if ! "$PY" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$tmp/whl" "${PINS[@]}" "$LION_SPEC" \
        >"$tmp/download.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$tmp/download.log" >&2 || true
    die "pip download failed"
fi
dups=$(find "$tmp/whl" -type f -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
[[ -z $dups ]] || die "more than one version of: $dups"
rm -rf .whl
mkdir -p .whl
mv "$tmp"/whl/*.whl .whl/

# -- 3. show what the wheels need, for the check against the image --------------------------------
for w in .whl/*.whl; do
    reqs=$(unzip -p "$w" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | paste -sd';' - || true)
    printf '  %-48s %6s KB  needs: %s\n' "$(basename "$w")" "$(( $(stat -c %s "$w") / 1024 ))" "${reqs:--}"
done
whl_kb=$(du -sk .whl | cut -f1)
(( whl_kb <= MAX_WHEELS_MB * 1024 )) || die ".whl/ is ${whl_kb} KB, over ${MAX_WHEELS_MB} MB"

# -- 3b. eole for the peers-eole packet (GPU_WHEELS_PEERS=1): .whl/peers/, installed by that step only ---------
# eole declares a heavy set its training path does not import; issue 44 measured its run-time set (below),
# resolved together and downloaded with eole and torch-optimi without their declared dependencies.
if [[ ${GPU_WHEELS_PEERS:-0} == 1 ]]; then
    EOLE_SPEC=${EOLE_SPEC:-eole==0.6.4}
    EOLE_RUNTIME=(pyonmttok pydantic fastapi uvicorn dill opentelemetry-api truststore)
    say "resolving eole's run-time set for cp312: ${EOLE_RUNTIME[*]}"
    "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$tmp/peers.json" "${PLATFORM[@]}" \
        --target "$tmp/peers-target" "${EOLE_RUNTIME[@]}" >"$tmp/peers.log" 2>&1 \
        || { grep -v "is ignored: it is neither" "$tmp/peers.log" >&2; die "pip could not resolve eole's run-time set"; }
    mapfile -t PEER_PINS < <("$PY" - "$tmp/peers.json" <<'EOF'
import json, sys
for i in json.load(open(sys.argv[1]))["install"]:
    print(f"{i['metadata']['name']}=={i['metadata']['version']}")
EOF
)
    mkdir -p "$tmp/peers"
    "$PY" -m pip download --quiet --no-deps "${PLATFORM[@]}" -d "$tmp/peers" "$EOLE_SPEC" torch-optimi "${PEER_PINS[@]}" \
        >"$tmp/peers-download.log" 2>&1 \
        || { grep -v "is ignored: it is neither" "$tmp/peers-download.log" >&2; die "pip download of eole's wheels failed"; }
    mkdir -p .whl/peers
    mv "$tmp"/peers/*.whl .whl/peers/
    say "carrying for peers-eole: $(cd .whl/peers && echo *.whl) ($(du -sk .whl/peers | cut -f1) KB)"
fi

# -- 4. training data -------------------------------------------------------------------------------
declare -a SRC=()
if [[ -n ${FASTMT_DATA_FILES:-} ]]; then
    IFS=: read -r -a SRC <<<"$FASTMT_DATA_FILES"
elif [[ -f $STANDIN ]]; then
    SRC=("$STANDIN")
fi
rm -rf .data
mkdir -p .data
: >.data/FILES
if ((${#SRC[@]} == 0)); then
    say "WARNING: no data (set FASTMT_DATA_FILES; the stand-in $STANDIN is absent): training steps will need the Hub"
else
    for f in "${SRC[@]}"; do
        [[ -f $f ]] || die "data file $f does not exist"
        base=$(basename "$f")
        [[ ! -e .data/$base ]] || die "two data files are named $base"
        cp "$f" ".data/$base"
        chmod 644 ".data/$base"
        echo "$base" >>.data/FILES
    done
    (cd .data && xargs -d '\n' sha256sum <FILES >SHA256SUMS)
fi

# -- 5. Triton kernels compiled ahead of time for sm_90 (optional) -----------------------------------
find_python312() {  # a CPython 3.12 that runs: python3.12 on PATH (a pyenv shim may not), else pyenv's own
    local c
    for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        [[ -n $c ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$c"; return 0; }
    done
    return 1
}

AOT_PY=${GPU_AOT_PYTHON:-}
if [[ -z $AOT_PY && ${GPU_AOT:-1} == 1 ]]; then
    if [[ ! -x .cache/aot-py312/bin/python ]] && ! PY312=$(find_python312); then
        say "WARNING: no python3.12 here (the GPU image's CPython): no AOT Triton cache; the kernels compile on" \
            "the device inside the packets' limits (GPU_AOT=0 skips this step without the warning)"
    else
        if [[ ! -x .cache/aot-py312/bin/python ]]; then
            t0=$SECONDS
            say "building .cache/aot-py312 with $PY312 (torch 2.11.0, triton 3.6.0 for CPython 3.12: the GPU image's; ~5 GB of downloads the first time)"
            "$PY312" -m venv .cache/aot-py312
            .cache/aot-py312/bin/pip install -q "torch==2.11.0" "triton==3.6.0" "numpy<2.4" einops sentencepiece \
                pytest hypothesis 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
            say "built .cache/aot-py312 in $((SECONDS - t0)) s"
        fi
        AOT_PY=.cache/aot-py312/bin/python
    fi
fi
if [[ -n $AOT_PY ]]; then
    "$AOT_PY" -c 'import sys, triton; assert sys.version_info[:2] == (3, 12) and triton.__version__ == "3.6.0", (sys.version, triton.__version__)' \
        || die "GPU_AOT_PYTHON=$AOT_PY is not CPython 3.12 with triton 3.6.0 (the GPU image's): its cache would never hit"
    say "compiling our Triton kernels for sm_90 with $AOT_PY (bench/aot.py; minutes on 2 cores)"
    rm -rf "$tmp/aot" && mkdir -p "$tmp/aot"
    t0=$SECONDS
    env -u TRITON_INTERPRET TRITON_STORE_BINARY_ONLY=1 PYTHONPATH="$PWD" "$AOT_PY" -m bench.aot --plan kernel-test \
        --plan train --out "$tmp/aot" --json "$tmp/aot-units.json" | sed 's/^/  /'
    tar -czf .whl/triton-aot-sm90.tgz -C "$tmp/aot" .
    say "compiled in $((SECONDS - t0)) s; carrying .whl/triton-aot-sm90.tgz ($(( $(stat -c %s .whl/triton-aot-sm90.tgz) / 1024 )) KB)"
fi

# -- 6. sizes ---------------------------------------------------------------------------------------
data_kb=$(du -sk .data | cut -f1)
whl_kb=$(du -sk .whl | cut -f1)
mb() { echo "$(( $1 / 1024 )).$(( $1 % 1024 * 10 / 1024 )) MB"; }
say "$(find .whl -type f -name '*.whl' | wc -l) wheels, $(mb "$whl_kb") in .whl/;" \
    "$(wc -l <.data/FILES) data file(s), $(mb "$data_kb") in .data/"
total_kb=$(( whl_kb + data_kb ))
(( total_kb < 48 * 1024 )) || say "WARNING: .whl + .data = ${total_kb} KB; the device call carries 64 MiB with the working tree"
say "done: carry [\".whl\", \".data\"] with bench/gpu_run.sh (bench/README.md)"
