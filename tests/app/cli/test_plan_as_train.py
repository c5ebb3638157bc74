"""`python -m app plan` plans the problem `train` runs: for every tiny example (one per algorithm,
multi-turn and bounded staleness among them) `plan_experiment`'s problem equals preflight's, the
reward calls priced the same way (app.cli.plan.problem_as_train)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.plan import plan_experiment
from app.config import load_config
from app.run import preflight

pytestmark = pytest.mark.unit

TINY_EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*-tiny.yaml"))


def test_every_algorithm_has_a_tiny_example() -> None:
    assert len(TINY_EXAMPLES) >= 10


@pytest.mark.parametrize("example", TINY_EXAMPLES, ids=lambda path: path.stem)
def test_plan_prices_the_problem_train_runs(example: Path) -> None:
    cfg = load_config(example, ["plan.seconds=0.5"])
    assert plan_experiment(cfg).problem == preflight(cfg).problem
