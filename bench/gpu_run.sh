#!/usr/bin/env bash
# The GPU runbook is bench/runbook.py (`python3 -m bench.packets run ARGS`; see its docstring): $PYTHON, else in a rehearsal .venv/bin/python, else python3.
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}; [[ -z ${PYTHON:-} && ${GPU_RUN_REHEARSAL:-0} != 0 && -x .venv/bin/python ]] && py=$PWD/.venv/bin/python
exec "$py" -m bench.packets run "$@"
