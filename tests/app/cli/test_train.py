"""`python -m app train`: configs that cannot run fail with status 2 and one message, before Ray
or any worker starts (checked in-process: Ray must still be uninitialised afterwards)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from app.cli import main
from app.cli.train import DEFAULT_CONFIG

pytestmark = pytest.mark.unit


def run_train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(["train", str(DEFAULT_CONFIG), *args])
    err = capsys.readouterr().err.strip()
    return status, err


@pytest.fixture(autouse=True)
def no_ray_started() -> None:
    was_running = ray.is_initialized()
    yield
    assert ray.is_initialized() == was_running, "a bad config must fail before Ray starts"


def test_cluster_too_small_for_the_models(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, err = run_train(capsys, "models.actor={preset: llama-70b}", "plan.mode=search",
                            f"run.dir={tmp_path / 'run'}")
    assert status == 2
    assert err.count("\n") == 0 and err.startswith("error: cluster=") and "too small" in err
    assert not (tmp_path / "run").exists()


def test_unknown_reward_function(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run_train(capsys, "reward.function=app.data.rewards:no_such_reward")
    assert status == 2 and err.count("\n") == 0
    assert "reward.function='app.data.rewards:no_such_reward'" in err and "no function 'no_such_reward'" in err
    status, err = run_train(capsys, "reward.function=no_such_module:f")
    assert status == 2 and "cannot be imported" in err


def test_dataset_row_without_the_prompt_field_names_file_and_line(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "123", "answer": "4567"}\n{"question": "456"}\n')
    status, err = run_train(capsys, f"data.path={data}")
    assert status == 2 and err.count("\n") == 0
    assert f"{data} line 2" in err and "'prompt'" in err


def test_dataset_smaller_than_a_batch_and_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = tmp_path / "few.jsonl"
    data.write_text('{"prompt": "123"}\n')
    status, err = run_train(capsys, f"data.path={data}")
    assert status == 2 and "batch.prompts=64" in err and "1 usable prompts" in err
    status, err = run_train(capsys, f"data.path={tmp_path / 'absent.jsonl'}")
    assert status == 2 and "data.path=" in err and "no such file" in err


def test_unknown_field_and_unsupported_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run_train(capsys, "ppo.clip=0.1")
    assert status == 2 and "ppo.clip" in err and "clip_eps" in err
    status, err = run_train(capsys, "algorithm=dpo", "plan.mode=heuristic", "dpo.beta=0")
    assert status == 2 and "dpo.beta" in err


def test_overrides_without_a_config_use_the_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["train", "reward.function=app.data.rewards:absent"])
    err = capsys.readouterr().err
    assert status == 2 and "app.data.rewards:absent" in err
