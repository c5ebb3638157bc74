"""Nothing lost, end to end on the shared local Ray (2 CPUs, 4 virtual GPUs), with the real workers.

* exact resume: 6 iterations straight, and 3 + a SIGKILL of the driver process (a `python -m
  app train` joined to the shared Ray) + `run.resume=auto` for the rest, give identical
  metrics.jsonl rows (every key but wall-clock timings and throughput) and identical final
  weights and optimizer state;
* recovery: a worker SIGKILLed at a random point of iteration 3, during a reallocation, and
  during a checkpoint write: the driver restarts the workers, resumes from the last complete
  checkpoint and finishes every iteration, with each row in metrics.jsonl exactly once, the
  restart logged naming the worker and the operation, and no incomplete checkpoint left.

A worker kills itself once per test: it creates a marker file first, so the restarted worker
goes on. The markers live in a directory named after this Ray session and job, which the test
process and its workers compute alike (workers do not see the test's environment).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from actors.worker import CallSpec, ModelWorker
from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.reporting.tracking import read_metrics
from app.run.checkpoint import complete_checkpoints, incomplete_checkpoints
from app.run.driver import Driver
from planning.plan import Placement
from tests.ray_fixtures import REPO_ROOT, ray_session  # noqa: F401  (the shared Ray instance fixture)

pytestmark = pytest.mark.ray

SMALL = ["tracking.console=false", "batch.prompts=16"]
WALL_CLOCK = ("timing_s/", "timing_gc_s/", "timing_gc_before_s/", "timing_compile_s/", "perf/")  # and the generation phases' seconds, gen/*_s


def config(run_dir: Path, *overrides: str):
    return load_config(DEFAULT_CONFIG, [f"run.dir={run_dir}", *SMALL, *overrides])


def marker_dir() -> Path:
    """The same directory in the test process and in its Ray workers (see the module docstring)."""
    context = ray.get_runtime_context()
    name = f"{context.gcs_address}-{context.get_job_id()}".replace(":", "_").replace("/", "_")
    return Path("/tmp") / f"realray-test-kills-{name}"


def first_time(name: str) -> bool:
    """True once per test (the marker file is created atomically)."""
    marker_dir().mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marker_dir() / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def die_mid_op() -> None:
    """SIGKILL this process inside an op, after the reply of its previous op has left. Killed the
    instant an op starts, a worker can take its previous op's reply with it (Ray sends replies
    asynchronously), and the driver then rightly names that previous op; a real death mid-write
    or mid-transfer comes some time into the op."""
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def die_soon(max_delay_s: float) -> None:
    """SIGKILL this process after a random delay (from another thread: the call goes on)."""
    delay = random.uniform(0.0, max_delay_s)
    threading.Thread(target=lambda: (time.sleep(delay), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()


class DiesInIteration3(ModelWorker):
    """Rank 1 (actor generation, reference and training) dies at a random point of iteration 3."""

    def run_call(self, call: CallSpec, *inputs: dict | None) -> tuple[dict, dict | None]:
        if call.iteration == 3 and self.rank == 1 and first_time("iteration3"):
            die_soon(0.3)
        return super().run_call(call, *inputs)


class DiesInReallocation(ModelWorker):
    """Rank 0 dies in its third reallocation (iteration 2's actor tp2 -> dp2 move), while its
    peer (rank 1) sends and receives its halves."""

    reallocations = 0

    def reallocate(self, role: str, src: Placement, dst: Placement) -> dict:
        DiesInReallocation.reallocations += 1
        if self.rank == 0 and DiesInReallocation.reallocations == 3 and first_time("realloc"):
            die_mid_op()
        return super().reallocate(role, src, dst)


class DiesWritingCheckpoint(ModelWorker):
    """Rank 2 (critic) dies while writing the second checkpoint: half a shard file, then SIGKILL."""

    saves = 0

    def save_state(self, role: str, out_dir: str) -> dict:
        DiesWritingCheckpoint.saves += 1
        if self.rank == 2 and DiesWritingCheckpoint.saves == 2 and first_time("checkpoint"):
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "tp0-pp0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"half")
            die_mid_op()
        return super().save_state(role, out_dir)


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK) and not (k.startswith("gen/") and k.endswith("_s"))}
            for row in rows]


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.rglob("*.safetensors")):
        out.update({f"{path.relative_to(directory)}:{k}": v for k, v in load_file(str(path)).items()})
    return out


def test_resume_after_the_driver_is_killed_is_exact(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["run.iterations=6", "checkpoint.every=3"]
    Driver(config(straight, *common), straight).run()
    # The same run as a separate driver process on the shared Ray, killed after checkpoint iter_3.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": str(REPO_ROOT)}
    log = (tmp_path / "driver.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "app", "train", str(DEFAULT_CONFIG), f"run.dir={resumed}",
                                *SMALL, *common], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (resumed / "checkpoints" / "iter_3" / "checkpoint.json").is_file():
            assert process.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the driver process wrote no checkpoint iter_3"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (resumed / "checkpoints" / "iter_6").exists()  # killed before the end
    rows = Driver(config(resumed, *common, "run.resume=auto"), resumed).run()
    assert [int(r["iteration"]) for r in rows] == [3, 4, 5]
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["iteration"] for m in b] == list(range(6))  # each row once, none missing
    assert comparable(a) == comparable(b)
    final_a, final_b = tensors_of(straight / "checkpoints" / "iter_6"), tensors_of(resumed / "checkpoints" / "iter_6")
    assert final_a.keys() == final_b.keys() and any("exp_avg/" in k for k in final_a)
    for key, tensor in final_a.items():
        assert torch.equal(tensor, final_b[key]), key


@pytest.mark.parametrize("worker_cls, marker, worker, op", [
    (DiesInIteration3, "iteration3", "worker-n0-g1", "iteration"),
    (DiesInReallocation, "realloc", "worker-n0-g0", "realloc 'actor_gen' of iteration 2"),
    (DiesWritingCheckpoint, "checkpoint", "worker-n0-g2", "save 'critic' of iteration 3"),
])
def test_a_killed_worker_is_recovered(ray_session: None, tmp_path: Path, worker_cls: type,  # noqa: F811
                                      marker: str, worker: str, op: str) -> None:
    shutil.rmtree(marker_dir(), ignore_errors=True)
    try:
        rows = Driver(config(tmp_path, "run.iterations=6", "checkpoint.every=2", "run.max_restarts=2"), tmp_path,
                      worker_cls=worker_cls).run()
        assert (marker_dir() / marker).exists(), "the worker never died"
    finally:
        shutil.rmtree(marker_dir(), ignore_errors=True)
    assert [int(r["iteration"]) for r in rows] == list(range(6))
    assert [m["iteration"] for m in read_metrics(tmp_path)] == list(range(6))  # none duplicated or missing
    timeline = [json.loads(line)["iteration"] for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert sorted(set(timeline)) == list(range(6))
    restarts = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and op in restarts[0]["op"] and restarts[0]["worker"] == worker
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["iter_4", "iter_6"]  # checkpoint.keep=2
    assert incomplete_checkpoints(tmp_path) == []
