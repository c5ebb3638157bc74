#!/usr/bin/env bash
# Submit `python3 -m app train [CONFIG] [key.path=value ...]` as a Ray job to the cluster at
# RAY_ADDRESS (its dashboard, default http://127.0.0.1:8265; a head address like 10.0.0.1:6379 works
# too), uploading this checkout as the job's working directory with runtime_env.yaml:
#
#   RAY_ADDRESS=http://HEAD:8265 bash scripts/submit.sh examples/ppo-tiny.yaml run.iterations=5
#   SUBMIT_FLAGS=--no-wait bash scripts/submit.sh CONFIG ...     # extra `ray job submit` flags
#
# Paths in CONFIG and overrides are read on the cluster, from the uploaded copy: give models, data
# and run.dir as absolute paths on the cluster's file system (runtime_env.yaml leaves models/ and
# data/ out of the upload).
# Token authentication (README "Run on a Ray cluster"): with RAY_AUTH_MODE unset, a token in
# RAY_AUTH_TOKEN, in the file RAY_AUTH_TOKEN_PATH or in ~/.ray/auth_token turns it on for this
# submission, as `ray start` does for the cluster; RAY_AUTH_MODE=disabled sends none.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ge 1 ] && [[ "$1" != *=* ]] && [ ! -f "$1" ]; then
  echo "error: config $1: no such file (paths are relative to the checkout: $(pwd))" >&2
  exit 2
fi
if [ -z "${RAY_AUTH_MODE:-}" ] && { [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] \
    || [ -f "$HOME/.ray/auth_token" ]; }; then
  export RAY_AUTH_MODE=token
fi
# SUBMIT_FLAGS is split on spaces on purpose: it holds zero or more `ray job submit` flags.
# shellcheck disable=SC2086
exec ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" --runtime-env runtime_env.yaml --working-dir . \
  ${SUBMIT_FLAGS:-} -- python3 -m app train "$@"
