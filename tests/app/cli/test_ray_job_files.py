"""What `ray job submit` uploads and runs: runtime_env.yaml's excludes (checked with Ray's own
packaging code on a checkout holding a virtual environment, wheels, runs and downloads), the
README's submit line that scripts/ci_ray_job.sh runs, and scripts/submit.sh's input check."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def uploaded(checkout: Path, excludes: list[str]) -> set[str]:
    """Files Ray would upload for `--working-dir checkout` (relative paths)."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    files: list[Path] = []
    _dir_travel(checkout, [_get_excludes(checkout, excludes)], lambda p: files.append(p) if p.is_file() else None,
                include_gitignore=False)
    return {str(p.relative_to(checkout)) for p in files}


def test_runtime_env_uploads_code_and_shipped_data_only(tmp_path: Path) -> None:
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    assert set(env) == {"excludes", "env_vars"} and all(isinstance(v, str) for v in env["env_vars"].values())
    checkout = tmp_path / "checkout"
    kept = ["app/cli/train.py", "examples/ppo-tiny.yaml", "examples/data/gsm8k_tiny.jsonl", "runtime_env.yaml",
            "tests/app/data/test_gsm8k.py"]
    dropped = [".git/HEAD", ".venv/lib/torch.so", "venv/bin/python", "env/bin/python", "wheels/torch.whl",
               ".whl/x.whl", "dist/realray-0.1.0-py3-none-any.whl", "runs/ppo/metrics.jsonl",
               "wandb/offline-run-1/run.wandb", "runs/ppo/wandb/x.wandb", "docs/plan.png", "app/__pycache__/a.pyc",
               "models/Qwen2.5-0.5B-Instruct/model.safetensors", "data/gsm8k/main/train.parquet"]
    for name in kept + dropped:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text("x")
    assert uploaded(checkout, env["excludes"]) == set(kept)


def test_readme_submit_line_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("ray job submit "))
    assert line == ("ray job submit --address http://127.0.0.1:8265 --runtime-env runtime_env.yaml --working-dir . "
                    "-- python3 -m app train examples/ppo-tiny.yaml")
    ci = (ROOT / "scripts" / "ci_ray_job.sh").read_text()
    assert "grep -m1 '^ray job submit ' README.md" in ci and 'README_ADDRESS="http://127.0.0.1:8265"' in ci
    assert "RAY_AUTH_MODE=token" in ci


def test_submit_script_rejects_a_missing_config() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "submit.sh"), "examples/nope.yaml"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": "http://127.0.0.1:1"}, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "error: config examples/nope.yaml: no such file" in done.stderr
