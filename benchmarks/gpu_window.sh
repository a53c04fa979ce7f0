#!/usr/bin/env bash
# The GPU proof in one command on a lent, air-gapped GPU machine: install the wheelhouse offline (under 30 s), run
# the quick plan of benchmarks/gpu_suite.py (at most 8 minutes on one H100), and leave report.md, report.json,
# logs.tar.gz and console.log in $OUT (the device tool brings them back; report.* are rewritten after every step, so
# a run cut short still returns what it measured). README, "On a GPU", says how to build the wheels and call it.
#
#   bash benchmarks/gpu_window.sh                          # the whole quick plan
#   bash benchmarks/gpu_window.sh --steps e2e,served_120b  # a rerun of some steps (gpu_suite.py's arguments)
#
# environment: OUT (where the four files go; default /tmp/brisk-gpu-window), WHEELS (default .whl: the wheelhouse
# that `tools/wheelhouse.sh --have tools/gpu_image_packages.txt --out .whl` built and the device tool carried).
set -uo pipefail

start=$SECONDS
out=${OUT:-/tmp/brisk-gpu-window}
wheels=${WHEELS:-.whl}
site=/tmp/brisk-site   # the wheelhouse's packages, ahead of the image's on the path
work=/tmp/brisk-suite  # models, logs and raw results: only logs.tar.gz of them goes to $out
limit=540              # seconds for the suite: its window is 480; the device tool's command limit is 600

window() {
    shopt -s nullglob
    local packages=("$wheels"/*.whl)
    if ((${#packages[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "${packages[@]}" || { echo "gpu_window.sh: installing $wheels failed"; return 1; }
        echo "gpu_window.sh: installed ${#packages[@]} wheels from $wheels in $((SECONDS - start)) s"
    else
        echo "gpu_window.sh: no wheels in $wheels: the image's packages alone (the env step lists what is missing)"
    fi
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
    # SIGTERM at the limit: the suite ends the running step's processes and keeps its report; SIGKILL 15 s later
    timeout --kill-after=15 "$limit" python3 benchmarks/gpu_suite.py --quick --out "$out" --work "$work" "$@"
    local status=$?
    echo "gpu_window.sh: exit $status after $((SECONDS - start)) s; $out holds: $(ls "$out" | tr '\n' ' ')"
    return $status
}

mkdir -p "$out" "$work"
window "$@" 2>&1 | tee -a "$out/console.log"
exit "${PIPESTATUS[0]}"
