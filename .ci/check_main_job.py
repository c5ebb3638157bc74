"""Check the README's main job's output: every iteration ran and the reward rose.

The job ends with a line like `40 iterations; reward mean: first 5 0.007, last 5 0.450`
(app/cli/train.py). Fails (exit 1) naming what is wrong."""

from __future__ import annotations

import re
import sys
from pathlib import Path

EXPECTED_ITERATIONS = 40
MIN_RISE = 0.1  # the tiny PPO run rises by ~0.44; a broken learner stays near 0
SUMMARY = re.compile(r"^(\d+) iterations; reward mean: first \d+ (-?[\d.]+), last \d+ (-?[\d.]+)", re.M)


def check(log: str) -> str | None:
    """None when the log shows a finished, learning run; else what is wrong."""
    found = SUMMARY.findall(log)
    if not found:
        return "no closing line '<N> iterations; reward mean: first 5 X, last 5 Y' in the main job's output"
    iterations, first, last = int(found[-1][0]), float(found[-1][1]), float(found[-1][2])
    if iterations != EXPECTED_ITERATIONS:
        return f"the main job ran {iterations} iterations; expected {EXPECTED_ITERATIONS}"
    if last - first < MIN_RISE:
        return f"the mean reward went {first} -> {last}; expected a rise of at least {MIN_RISE}"
    return None


if __name__ == "__main__":
    problem = check(Path(sys.argv[1]).read_text(encoding="utf-8", errors="replace"))
    if problem:
        print(f"ci: {problem}", file=sys.stderr)
        raise SystemExit(1)
    print("ci: main job ok (40 iterations, reward rose)")
