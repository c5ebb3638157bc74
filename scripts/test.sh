#!/usr/bin/env bash
# The project's test command (README, .ci/run): install, run every CPU test tier, then run the
# tiny PPO experiment through `ray job submit` on a throw-away local Ray cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -m "not gpu" -q -p no:cacheprovider
bash scripts/ci_ray_job.sh
