"""Unit tests of the recovery rules: which failures a restart gets past, the one-line messages
(no Ray traceback, no colour codes), the stall report naming the rank that stopped."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from ray.exceptions import ActorDiedError, RayTaskError

from app.cli.train import DEFAULT_CONFIG
from app.config.experiment import load_config
from app.run.recovery import describe_error, guard_params, is_recoverable, one_line, stall_message

pytestmark = pytest.mark.unit


def task_error(cause: BaseException) -> RayTaskError:
    """What ray.get raises for an exception inside an actor method (traceback with colour codes)."""
    return RayTaskError("ModelWorker.run_call", "\x1b[36mTraceback (most recent call last):\x1b[0m\n  ...", cause)


def test_dead_workers_and_broken_collectives_are_recoverable_code_errors_are_not() -> None:
    assert is_recoverable(ActorDiedError())
    assert is_recoverable(task_error(dist.DistBackendError("NCCL watchdog")))
    assert is_recoverable(task_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")))
    assert is_recoverable(task_error(RuntimeError("Timed out waiting 300000ms for recv operation to complete")))
    assert not is_recoverable(task_error(ValueError("reward function f returned nan for sample 3")))
    assert not is_recoverable(task_error(RuntimeError("The size of tensor a (4) must match the size of tensor b")))
    assert not is_recoverable(ValueError("not a Ray error"))


def test_messages_are_one_line_without_ray_tracebacks() -> None:
    line = describe_error(task_error(ValueError("bad\nvalue  here")))
    assert line == "ValueError: bad value here"
    assert "\n" not in describe_error(ActorDiedError()) and describe_error(ActorDiedError()).startswith("ActorDiedError")
    assert one_line("\x1b[31mred\x1b[0m\n text") == "red text"
    assert len(one_line("x" * 5000)) == 1000


def test_stall_names_the_rank_that_stopped_not_its_waiting_peers() -> None:
    probes = {"worker-n0-g2": {"busy": True, "method": "run_call", "where": "sleep (x.py:3)", "in_collective": False},
              "worker-n0-g3": {"busy": True, "method": "run_call", "where": "step (o.py:9)", "in_collective": True}}
    message, stopped = stall_message("call 'critic_train' of iteration 0", 20.0, probes)
    assert stopped == ["worker-n0-g2"]
    assert message.startswith("call 'critic_train' of iteration 0 made no progress for 20 s (run.call_timeout_s)")
    assert "worker-n0-g2 stopped in run_call at sleep (x.py:3) (not in a collective)" in message
    assert "worker-n0-g3 wait(s) in a collective for it" in message
    message, stopped = stall_message("op", 5.0, {"a": None, "b": probes["worker-n0-g3"]})
    assert stopped == ["a"] and "a does not answer" in message
    message, stopped = stall_message("op", 5.0, {"b": probes["worker-n0-g3"]})  # all wait: name them all
    assert stopped == ["b"]


def test_guard_params_come_from_the_config() -> None:
    cfg = load_config(DEFAULT_CONFIG, ["run.on_nonfinite=skip", "reward.timeout_s=7"])
    assert guard_params(cfg) == {"on_nonfinite": "skip", "reward_timeout_s": 7.0}
