#!/usr/bin/env bash
# The README's commands, run as written: every fenced block right after a `<!-- smoke -->` line, line by
# line, from a fresh shell (no inherited environment, no profile) in a fresh copy of the checkout, on the
# toy corpus. Needs the set-up .venv (`make setup`; in CI `make test` ran first) and never installs
# anything. Exit status: the first failing command's. About a minute on 2 CPU cores.
#   FASTMT_SMOKE_VENV=DIR   the environment to link as the copy's .venv (default: <checkout>/.venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${FASTMT_SMOKE_VENV:-$repo/.venv}"
venv="$(cd "$venv" && pwd)"
if [[ ! -x "$venv/bin/fastmt" ]]; then
    echo "readme-smoke: $venv/bin/fastmt is missing: run 'make setup' first" >&2
    exit 1
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/fastmt-readme-smoke.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir "$work/repo" "$work/home"
# a fresh copy: the checkout's files (tracked, plus new ones git does not ignore), mtimes kept
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf -) \
    | tar -xf - -C "$work/repo"
ln -s "$venv" "$work/repo/.venv"
if ! (cd "$work/repo" && make -q setup); then  # `make` would reinstall into the linked environment
    echo "readme-smoke: $venv is older than pyproject.toml: run 'make setup' first" >&2
    exit 1
fi
script="$(awk '/^<!-- smoke -->$/ {want = 1; next}
               want && /^```/ {if (inside) {inside = 0; want = 0} else inside = 1; next}
               inside {print}' "$repo/README.md")"
if [[ -z "$script" ]]; then
    echo "readme-smoke: no <!-- smoke --> block in README.md" >&2
    exit 1
fi
echo "readme-smoke: in $work/repo, from a fresh shell:"
start=$SECONDS
env -i HOME="$work/home" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 TERM=dumb \
    bash --noprofile --norc -euxo pipefail -c "cd '$work/repo'
$script"
echo "readme-smoke: every command passed in $((SECONDS - start)) s"
