#!/usr/bin/env bash
# The GPU proof in one command on a lent, air-gapped GPU machine: install the wheelhouse offline (under 30 s), run
# the quick plan of benchmarks/gpu_suite.py (at most 8 minutes on one H100), and leave report.md, report.json,
# logs.tar.gz and console.log in $OUT (the device tool brings them back; report.* are rewritten after every step, so
# a run cut short still returns what it measured). README, "On a GPU", says how to build the wheels and call it.
#
#   BRISK_COMMIT=abc1234 bash benchmarks/gpu_window.sh                          # the whole quick plan
#   BRISK_COMMIT=abc1234 bash benchmarks/gpu_window.sh --steps e2e,served_120b  # a rerun of some steps
#
# (arguments after the script's name are gpu_suite.py's). The caller writes its commit into the command
# (BRISK_COMMIT=$(git rev-parse --short HEAD), expanded where the command is written): the copy on the lent machine
# has no .git, and the env step reports BRISK_COMMIT instead.
#
# environment: OUT (where the four files go; default /tmp/brisk-gpu-window), WHEELS (default .whl: the wheelhouse
# that `tools/wheelhouse.sh --have tools/gpu_image_packages.txt --out .whl` built and the device tool carried),
# BRISK_COMMIT (the checkout's commit, for the report).
#
# Before the suite: the processes holding GPU memory are listed, brisk's own among them (a previous run's leftovers)
# ended, and
# brisk's own imports are checked against the installed packages; where one fails the script stops there (exit 3).
set -uo pipefail

start=$SECONDS
out=${OUT:-/tmp/brisk-gpu-window}
wheels=${WHEELS:-.whl}
site=/tmp/brisk-site   # the wheelhouse's packages, ahead of the image's on the path
work=/tmp/brisk-suite  # models, logs and raw results: only logs.tar.gz of them goes to $out
limit=540              # seconds for the suite: its window is 480; the device tool's command limit is 600

window() {
    echo "gpu_window.sh: processes on the GPU before the suite (a previous run's leftovers hold its memory):"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
    # A step killed at the device tool's limit runs on, holding its memory (dummy 120b: ~65 GB): ended before the
    # suite starts, so a rerun on the warm machine gets the whole GPU.
    local leftovers="" pid
    for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | grep -E '^[0-9]+$'); do
        # brisk's own only (the suite, its steps' processes, a served engine): whatever else holds the GPU is not
        # this script's to end
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE 'gpu_suite|suite_offline|brisk|pytest'; then
            leftovers="$leftovers $pid"
        fi
    done
    if [ -n "$leftovers" ]; then
        echo "gpu_window.sh: ending them: $(echo $leftovers)"
        kill -9 $leftovers 2>/dev/null
        for _ in $(seq 40); do  # until the driver has their memory back (at most ~20 s)
            local holding
            holding=" $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | tr '\n' ' ')"
            local left=0
            for pid in $leftovers; do [[ $holding == *" $pid "* ]] && left=1; done
            [ "$left" -eq 0 ] && break
            sleep 0.5
        done
    fi
    unset TRITON_INTERPRET  # set by a CPU test habit, every kernel would run in the interpreter and every step time out
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
    python3 -c "import pydantic, msgspec, zmq, fastapi, xgrammar, openai_harmony, jsonschema" || {
        echo "gpu_window.sh: brisk's dependencies do not import (above): the suite would only fail; not run."
        echo "gpu_window.sh: rebuild the wheelhouse (tools/wheelhouse.sh, README: On a GPU) and carry it as $wheels"
        return 3
    }
    echo "gpu_window.sh: commit ${BRISK_COMMIT:-unknown (BRISK_COMMIT not set)}"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
    # SIGTERM at the limit: the suite ends the running step's processes and keeps its report; SIGKILL 15 s later
    timeout --kill-after=15 "$limit" python3 benchmarks/gpu_suite.py --quick --out "$out" --work "$work" "$@"
    local status=$?
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then  # the device tool reads 124/137 as its own time-out
        echo "gpu_window.sh: the suite was stopped at its own $limit s limit (report.* hold what it measured)"
        status=2
    fi
    echo "gpu_window.sh: exit $status after $((SECONDS - start)) s; $out holds: $(ls "$out" | tr '\n' ' ')"
    return $status
}

mkdir -p "$out" "$work"
window "$@" 2>&1 | tee -a "$out/console.log"
exit "${PIPESTATUS[0]}"
