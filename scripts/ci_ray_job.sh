#!/usr/bin/env bash
# CI step: start a Ray head with virtual GPUs on this machine, run the tiny PPO experiment
# (examples/ppo-tiny.yaml, 3 iterations) through `ray job submit`, check its outputs, stop Ray.
#
#   scripts/ci_ray_job.sh            # RUN_DIR=/some/dir ITERATIONS=3 CPUS=2 GPUS=4 override
#
# Free ports are picked so the step does not collide with another local Ray (e.g. the test suite's),
# and the head runs with --block in the background and is stopped by its process id: that stops
# exactly this cluster, where `ray stop` would stop every Ray instance of the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERATIONS=${ITERATIONS:-3}
CPUS=${CPUS:-2}
GPUS=${GPUS:-4}
RUN_DIR=${RUN_DIR:-$(mktemp -d)/ppo-tiny}
PYTHON=${PYTHON:-python3}

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GCS_PORT=$(free_port)
DASHBOARD_PORT=$(free_port)
export RAY_ADDRESS="127.0.0.1:${GCS_PORT}"
# A throw-away local cluster: no token authentication between its CLI, job server and workers.
export RAY_AUTH_MODE=disabled

ray start --head --block --port "$GCS_PORT" --num-cpus "$CPUS" --num-gpus "$GPUS" \
  --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" --disable-usage-stats &
HEAD_PID=$!
stop_cluster() {  # SIGTERM makes `ray start --block` stop the processes it started
  kill -TERM "$HEAD_PID" 2>/dev/null || true
  wait "$HEAD_PID" 2>/dev/null || true
  # `ray stop` would also forget the cluster; otherwise a later plain ray.init() tries to join it.
  local current=/tmp/ray/ray_current_cluster
  if [ -f "$current" ] && grep -q ":${GCS_PORT}\$" "$current"; then rm -f "$current"; fi
}
trap stop_cluster EXIT
for _ in $(seq 120); do  # wait for the job server (the dashboard) to answer
  "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${DASHBOARD_PORT}/api/version', timeout=2)" \
    2>/dev/null && break
  kill -0 "$HEAD_PID" 2>/dev/null || { echo "ray start failed" >&2; exit 1; }
  sleep 1
done

# The job runs `python -m app train` from an uploaded copy of this directory; it joins the head
# (RAY_ADDRESS is set inside the job) and uses its GPUs as virtual ones (cluster.virtual_gpus).
ray job submit --address "http://127.0.0.1:${DASHBOARD_PORT}" --working-dir . \
  --runtime-env-json '{"excludes": ["runs", ".git", "*.png", "wandb"]}' \
  -- "$PYTHON" -m app train examples/ppo-tiny.yaml "run.iterations=${ITERATIONS}" \
  tracking.wandb=false "run.dir=${RUN_DIR}"

"$PYTHON" - "$RUN_DIR" "$ITERATIONS" <<'PY'
import json, sys
from pathlib import Path
run_dir, iterations = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
assert [r["iteration"] for r in rows] == list(range(iterations)), rows
assert all(r.get("rollout/reward_mean") is not None for r in rows)
assert (run_dir / "plan.json").is_file() and (run_dir / "gantt.png").is_file()
assert (run_dir / "checkpoints" / f"iter_{iterations}" / "checkpoint.json").is_file()
print(f"ray job ok: {iterations} iterations in {run_dir}")
PY
