#!/usr/bin/env bash
# CI step: the README's "Run on a Ray cluster" on a throw-away local cluster, with token
# authentication ON as on a shared cluster:
#   1. `ray start --head` with Ray's default resources (on a machine without GPUs: no GPU, so the
#      job's virtual GPUs are CPU slots) and a token only this cluster and this script know;
#   2. a request without the token is refused (authentication is really on);
#   3. the README's exact `ray job submit` line, read from README.md: only the dashboard address is
#      this cluster's, and overrides are appended (ITERATIONS iterations, no W&B, RUN_DIR);
#   4. the run's outputs are checked, `python3 -m app report` draws them; the cluster is stopped.
#
#   scripts/ci_ray_job.sh            # RUN_DIR=/some/dir ITERATIONS=3 GPUS=4 (advertise N GPUs) override
#
# Other Ray instances on the machine (the test suite's, a developer's `ray start`) are left alone:
# every port is picked free, the dashboard agent's and the metrics export's included (two local
# clusters on the agent's default 52365 make the job server answer "No available agent to submit
# job"); the cluster keeps its files in its own temp dir (so it never becomes the "current cluster"
# a plain ray.init() joins); it runs with --block in the background and is stopped by its process
# id, where `ray stop` would stop every Ray instance of the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERATIONS=${ITERATIONS:-3}
GPUS=${GPUS:-}
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
RUN_DIR=${RUN_DIR:-$WORK/ppo-tiny}
README_ADDRESS="http://127.0.0.1:8265"

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Token authentication: the cluster and this script (the submitter) share one token file.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$WORK/auth_token"
(umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_AUTH_TOKEN_PATH")
unset RAY_ADDRESS RAY_API_SERVER_ADDRESS  # the job gets its cluster's address from Ray itself

HEAD_PID=""
stop_cluster() {  # SIGTERM makes `ray start --block` stop the processes it started
  if [ -n "$HEAD_PID" ]; then
    kill -TERM "$HEAD_PID" 2>/dev/null || true
    wait "$HEAD_PID" 2>/dev/null || true
  fi
  HEAD_PID=""
  rm -rf "$WORK/ray"
}
trap 'stop_cluster; rm -f "$RAY_AUTH_TOKEN_PATH"' EXIT

# Start the head on free ports; true once `ray start` reports "Ray runtime started." (it gives
# the raylet 30 s to register, which a heavily loaded machine can miss: the caller retries).
start_cluster() {
  DASHBOARD="http://127.0.0.1:$(free_port)"
  local log="$WORK/ray_start.log"
  # shellcheck disable=SC2086  # ${GPUS:+...} is empty or two words on purpose
  ray start --head --block --port "$(free_port)" --dashboard-host 127.0.0.1 --dashboard-port "${DASHBOARD##*:}" \
    --dashboard-agent-listen-port "$(free_port)" --metrics-export-port "$(free_port)" \
    --ray-client-server-port "$(free_port)" --temp-dir "$WORK/ray" --disable-usage-stats ${GPUS:+--num-gpus $GPUS} \
    > "$log" 2>&1 &
  HEAD_PID=$!
  for _ in $(seq 240); do
    if grep -q "Ray runtime started" "$log"; then return 0; fi
    if ! kill -0 "$HEAD_PID" 2>/dev/null; then break; fi
    sleep 1
  done
  echo "ray start did not come up; its log ends with:" >&2
  tail -n 5 "$log" >&2
  stop_cluster
  return 1
}
start_cluster || start_cluster

# The job server refuses a request without the token (HTTP 401): authentication is on.
"$PYTHON" - "$DASHBOARD" <<'PY'
import sys, time, urllib.error, urllib.request
dashboard = sys.argv[1]
for _ in range(120):
    try:
        urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=5)
        sys.exit("the job server answered a request without a token: authentication is off")
    except urllib.error.HTTPError as err:
        if err.code != 401:
            raise
        print(f"job server at {dashboard}: a request without the token gets HTTP 401")
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(f"no job server at {dashboard} after 120 s")
PY

# The README's command, word for word (it holds no quotes), on this cluster's dashboard address.
README_SUBMIT=$(grep -m1 '^ray job submit ' README.md) || { echo "README.md has no 'ray job submit' line" >&2; exit 1; }
case "$README_SUBMIT" in
  *"--address $README_ADDRESS "*) ;;
  *) echo "README's submit line does not use --address $README_ADDRESS: $README_SUBMIT" >&2; exit 1 ;;
esac
read -r -a SUBMIT <<< "${README_SUBMIT/"$README_ADDRESS"/$DASHBOARD}"
echo "running: ${SUBMIT[*]} run.iterations=${ITERATIONS} tracking.wandb=false run.dir=${RUN_DIR}"
"${SUBMIT[@]}" "run.iterations=${ITERATIONS}" tracking.wandb=false "run.dir=${RUN_DIR}"

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
"$PYTHON" -m app report "$RUN_DIR"
