"""Tests of app.envs.sessions.EnvSessions, driven as the multi-turn decode loop drives a
TurnSource: full episodes with the toy tokenizer, environments that raise, hang past the timeout
or return malformed results (each ends only its row), limits, truncation and metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.data.toy_task import BOS_ID, EOS_ID
from app.envs import EnvLoadError, EnvSessions
from app.envs.sessions import DaemonPool
from app.envs.templates import render_ids
from tests.tiny_chat_model import build_tokenizer

pytestmark = pytest.mark.unit
HERE = "tests.app.envs.test_sessions"
HANG_S = 2.0


class ScriptedEnv:
    """Behaves as sample["mode"] says: ok, raise / hang / bad_obs at step 2, reset_raise, reset_hang."""

    def __init__(self, done_after: int = 3, observation: str = "x") -> None:
        self.done_after = done_after
        self.observation = observation
        self.turn = 0
        self.mode = "ok"

    def reset(self, sample: dict[str, Any]) -> str:
        self.mode = sample.get("mode", "ok")
        if self.mode == "reset_raise":
            raise RuntimeError("reset exploded")
        if self.mode == "reset_hang":
            time.sleep(HANG_S)
        if self.mode == "reset_messages":
            return [{"role": "user", "content": sample["prompt"]}]
        if self.mode == "reset_bad":
            return 3
        return sample["prompt"]

    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        self.turn += 1
        if self.turn == 2 and self.mode == "raise":
            raise KeyError("boom")
        if self.turn == 2 and self.mode == "hang":
            time.sleep(HANG_S)
        if self.turn == 2 and self.mode == "bad_obs":
            return 5, 0.0, False, {}
        return self.observation * self.turn, float(self.turn), self.turn >= self.done_after, {"a": action_text}


def sessions(samples: list[dict[str, Any]], env: str = f"{HERE}:ScriptedEnv", **overrides: Any) -> EnvSessions:
    params: dict[str, Any] = {"env": env, "samples": samples, "tokenizer": "toy", "chat_template": False,
                              "observation_role": "user", "max_turns": 4, "max_observation_tokens": 8,
                              "env_timeout_s": 0.2, "env_workers": 2, "reward_discount": 1.0}
    return EnvSessions(**{**params, **overrides})


def drive(source: EnvSessions, action: Callable[[int, list[int]], list[int]],
          last_after: int | None = None) -> dict[int, list[Any]]:
    """The decode loop's side: every row acts, then acts again on each observation, until done.
    action(row, observation_ids) -> the ids sampled; last_after: submit with last=True at that turn."""
    answers: dict[int, list[Any]] = {row: [] for row in range(len(source.prompts()))}
    turns = dict.fromkeys(answers, 1)
    for row in answers:
        source.submit(row, action(row, []), last=last_after == 1)
    while source.pending():
        for result in source.poll(1.0):
            answers[result.row].append(result)
            if not result.done:
                turns[result.row] += 1
                source.submit(result.row, action(result.row, list(result.observation_ids)),
                              last=last_after == turns[result.row])
    return answers


def toy_ids(text: str) -> list[int]:
    return [ord(c) for c in text] + [EOS_ID]


def test_hidden_digit_episode_with_the_toy_tokenizer() -> None:
    samples = [{"prompt": f"{i}{i * 7}"} for i in range(12)]
    source = sessions(samples, env="app.envs.builtin:HiddenDigitGame")

    def successor(row: int, observation: list[int]) -> list[int]:  # reads the observed digit
        return toy_ids(str((int(chr(observation[0])) + 1) % 10) if observation else "go")

    with source:
        assert source.prompts() == [[BOS_ID, ord("?")]] * 12
        answers = drive(source, successor)
    for results in answers.values():
        assert [r.done for r in results] == [False, True]
        assert len(results[0].observation_ids) == 1 and chr(results[0].observation_ids[0]).isdigit()
    outcomes = source.outcomes()
    assert all(o["reward"] == 1.0 and o["turns"] == 2 and o["end_reason"] == "done" for o in outcomes)
    assert outcomes[0]["step_rewards"] == [0.0, 1.0] and outcomes[0]["observation_tokens"] == 1
    metrics = source.metrics()
    assert metrics["env/done_fraction"] == 1.0 and metrics["env/turns_mean"] == 2.0
    assert metrics["env/reward_mean"] == 1.0 and metrics["env/steps"] == 24.0


def test_failures_end_only_their_row_and_never_wait_for_a_hung_step() -> None:
    modes = ["ok", "raise", "hang", "bad_obs", "reset_raise", "reset_hang", "ok"]
    source = sessions([{"prompt": f"p{i}", "mode": m} for i, m in enumerate(modes)])
    start = time.monotonic()
    prompts = source.prompts()
    assert time.monotonic() - start < 1.0  # the hung reset is abandoned after 0.2 s
    assert prompts[0] == [BOS_ID, ord("p"), ord("0")] and prompts[4] == [BOS_ID, ord("p"), ord("4")]
    answers = drive(source, lambda row, obs: toy_ids("a"))
    source.close()
    assert time.monotonic() - start < HANG_S - 0.5  # neither hung call was waited for
    outcomes = source.outcomes()
    reasons = [o["end_reason"] for o in outcomes]
    assert reasons == ["done", "error", "timeout", "error", "error", "timeout", "done"]
    assert "step 2: KeyError: 'boom' (at " in outcomes[1]["error"] and "test_sessions.py" in outcomes[1]["error"]
    assert outcomes[2]["error"] == "step 2: took longer than rollout.env_timeout_s=0.2"
    assert "step returned observation 5 (int); expected a str" in outcomes[3]["error"]
    assert outcomes[4]["error"].startswith("reset: RuntimeError: reset exploded")
    assert outcomes[5]["error"] == "reset: took longer than rollout.env_timeout_s=0.2"
    # Working rows ran all their turns; failing steps keep the rewards of the steps before them.
    assert [o["turns"] for o in outcomes] == [3, 2, 2, 2, 1, 1, 3]
    assert [o["reward"] for o in outcomes] == [6.0, 1.0, 1.0, 1.0, 0.0, 0.0, 6.0]
    assert [len(answers[r]) for r in range(7)] == [3, 2, 2, 2, 1, 1, 3]
    assert all(results[-1].done and not any(r.done for r in results[:-1]) for results in answers.values())
    metrics = source.metrics()
    assert (metrics["env/errors"], metrics["env/timeouts"]) == (3.0, 2.0)
    assert metrics["env/done_fraction"] == pytest.approx(2 / 7) and metrics["env/turns_max"] == 3.0
    assert 0.2 <= metrics["env/seconds"] < 1.0 and metrics["env/steps"] == 12.0


def test_bad_first_observations_end_their_row() -> None:
    source = sessions([{"prompt": "ok"}, {"prompt": "m", "mode": "reset_messages"},
                       {"prompt": "b", "mode": "reset_bad"}])
    assert source.prompts() == [[BOS_ID, ord("o"), ord("k")], [BOS_ID, ord("m")], [BOS_ID, ord("b")]]
    answers = drive(source, lambda row, obs: toy_ids("a"))
    assert [len(answers[row]) for row in range(3)] == [3, 1, 1]
    outcomes = source.outcomes()
    assert [o["end_reason"] for o in outcomes] == ["done", "error", "error"]
    assert "reset: encoding the first observation: ValueError: reset returned chat messages" in outcomes[1]["error"]
    assert "reset: ValueError: environment tests.app.envs.test_sessions:ScriptedEnv: reset returned 3" in (
        outcomes[2]["error"])


def test_max_turns_length_and_discount() -> None:
    source = sessions([{"prompt": "a"}, {"prompt": "b"}], env_kwargs={"done_after": 99}, max_turns=2,
                      reward_discount=0.5)
    drive(source, lambda row, obs: toy_ids("z"))
    assert [o["end_reason"] for o in source.outcomes()] == ["max_turns", "max_turns"]
    assert [o["reward"] for o in source.outcomes()] == [1.0 + 0.5 * 2.0] * 2
    cut = sessions([{"prompt": "a"}], env_kwargs={"done_after": 99})
    answers = drive(cut, lambda row, obs: toy_ids("z"), last_after=3)
    (outcome,) = cut.outcomes()
    assert (outcome["end_reason"], outcome["turns"], outcome["step_rewards"]) == ("length", 3, [1.0, 2.0, 3.0])
    assert [r.done for r in answers[0]] == [False, False, True]
    assert cut.metrics()["env/length_cut"] == 1.0


def test_truncation_is_counted() -> None:
    source = sessions([{"prompt": "abcdef"}], env_kwargs={"observation": "xyz"}, max_observation_tokens=4,
                      max_prompt_tokens=3)
    assert source.prompts() == [[ord("d"), ord("e"), ord("f")]]
    answers = drive(source, lambda row, obs: toy_ids("q"))
    assert [list(r.observation_ids) for r in answers[0][:2]] == [[ord(c) for c in "xyz"], [ord(c) for c in "xyzx"]]
    (outcome,) = source.outcomes()
    assert (outcome["truncated_observations"], outcome["observation_tokens"]) == (1, 7)
    metrics = source.metrics()
    assert (metrics["env/truncated_observations"], metrics["env/truncated_prompts"]) == (1.0, 1.0)


def test_empty_observation_and_rows_the_loop_ended() -> None:
    empty = sessions([{"prompt": "a"}], env_kwargs={"observation": ""})
    drive(empty, lambda row, obs: toy_ids("q"))
    (outcome,) = empty.outcomes()
    assert outcome["end_reason"] == "error" and "step 1: the observation '' encodes to no tokens" in outcome["error"]
    # The loop ends a row whose observation does not fit its budget without submitting it again.
    source = sessions([{"prompt": "a"}, {"prompt": "b"}], env_kwargs={"observation": "ob"})
    source.prompts()
    source.submit(0, toy_ids("q"), last=False)
    source.submit(1, toy_ids("q"), last=False)
    assert sorted(len(r.observation_ids) for r in source.poll(1.0) + source.poll(1.0)) == [2, 2]
    source.submit(1, toy_ids("q"), last=True)
    source.poll(1.0)
    first, second = source.outcomes()
    assert (first["end_reason"], first["observation_tokens"], first["turns"]) == ("length", 0, 1)
    assert (second["end_reason"], second["observation_tokens"], second["turns"]) == ("length", 2, 2)
    assert source.metrics()["env/length_cut"] == 2.0


def test_metric_names() -> None:
    source = sessions([{"prompt": "a"}])
    assert source.poll(5.0) == []  # nothing in flight: answers at once
    drive(source, lambda row, obs: toy_ids("q"))
    assert set(source.metrics()) == {
        "env/turns_mean", "env/turns_max", "env/steps", "env/step_s_mean", "env/seconds", "env/errors",
        "env/timeouts", "env/truncated_observations", "env/truncated_prompts", "env/observation_tokens_mean",
        "env/length_cut", "env/max_turns_cut", "env/done_fraction", "env/reward_mean"}
    assert all(isinstance(v, float) for v in source.metrics().values())


def test_protocol_misuse_and_bad_params_raise() -> None:
    source = sessions([{"prompt": "a"}])
    with pytest.raises(RuntimeError, match="submit before prompts"):
        source.submit(0, [65], last=False)
    source.prompts()
    source.submit(0, [65], last=False)
    with pytest.raises(ValueError, match="row 0: submitted again"):
        source.submit(0, [65], last=False)
    with pytest.raises(ValueError, match=r"row 1: outside 0\.\.0"):
        source.submit(1, [65], last=True)
    source.close()
    with pytest.raises(EnvLoadError, match="no_such_module"):
        sessions([{"prompt": "a"}], env="no_such_module:Env")
    with pytest.raises(ValueError, match="rollout.env_timeout_s=0: must be > 0"):
        sessions([{"prompt": "a"}], env_timeout_s=0)
    with pytest.raises(ValueError, match="rollout.reward_discount=1.5: must be in"):
        sessions([{"prompt": "a"}], reward_discount=1.5)


def test_chat_template_session(tmp_path: Path) -> None:
    hf = build_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="max_observation_tokens=4: the chat template alone takes"):
        sessions([{"prompt": "q"}], tokenizer=str(tmp_path), chat_template=True, max_observation_tokens=4)
    source = sessions([{"prompt": "How many?"}], tokenizer=str(tmp_path), chat_template=True,
                      observation_role="tool", max_observation_tokens=32, env_kwargs={"observation": "36"})
    (prompt,) = source.prompts()
    action = hf.encode("<calc>3*12</calc>", add_special_tokens=False) + [hf.eos_token_id]
    source.submit(0, action, last=False)
    (result,) = source.poll(2.0)
    conversation = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "<calc>3*12</calc>"},
                    {"role": "tool", "content": "36"}]
    assert prompt + action + list(result.observation_ids) == render_ids(hf, conversation, add_generation_prompt=True)
    source.close()


def test_daemon_pool_replaces_an_abandoned_thread() -> None:
    pool = DaemonPool(1)
    stuck = pool.submit(time.sleep, HANG_S)
    queued = pool.submit(lambda: 42)
    time.sleep(0.05)
    assert not queued.done()
    pool.abandon(stuck)
    assert queued.result(timeout=1.0) == 42 and not stuck.done()
    later = pool.submit(time.sleep, HANG_S)
    pool.close()
    assert later.cancelled() or later.running()
