#!/bin/sh
# The image's entry point: `brisk serve` with the model and options from the environment, then the
# arguments given to `docker run` (or a Kubernetes `args:`), which win over the environment.
#   BRISK_MODEL       model directory or hub id (unset: the bundled demo model)
#   BRISK_HOST/PORT   where to listen (0.0.0.0:8000)
#   BRISK_EXTRA_ARGS  further `brisk serve` flags, split on whitespace (e.g. "--tp_size 2 --max_batch_size 64")
set -eu
# shellcheck disable=SC2086 # BRISK_EXTRA_ARGS is a list of flags: word splitting is what it wants
exec brisk serve ${BRISK_MODEL:+"$BRISK_MODEL"} --host "${BRISK_HOST:-0.0.0.0}" --port "${BRISK_PORT:-8000}" \
    ${BRISK_EXTRA_ARGS:-} "$@"
