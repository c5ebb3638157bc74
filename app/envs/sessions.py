"""The environments of one generation call on one worker: `EnvSessions`, a `TurnSource` for the
multi-turn decode loop (actors.generation.turns).

One environment instance per row (sample i -> row i), its resets and steps run in a bounded pool
of daemon threads beside the decode loop, each with a timeout; observations are encoded by
app.envs.templates in the decode loop's thread. Every failure of user code (an exception, a
malformed result, a timeout) ends only its row, with the reason and message kept; none raises
out of `prompts` or `poll`.

Rows:
- `prompts()` runs every reset (construction with env_kwargs included) and waits for all. A
  reset that fails or times out gives its row a minimal prompt (the tokenizer's prompt of
  sample["prompt"], else [bos] or [eos]) and ends it (reason 'error' / 'timeout', message kept
  with a "reset: " prefix); the loop decodes one turn for it, and that row's first `submit` is
  answered done=True by the next `poll` without running a step.
- `submit(row, action_ids, last)` decodes the action (special tokens skipped) and runs
  env.step in the pool. `poll` answers done=True when the environment said done (reason
  'done'), when the row has taken max_turns actions ('max_turns'), when `last` was set
  ('length'), or when the step raised / returned a malformed result ('error') or ran longer than
  env_timeout_s from when it started running ('timeout': the thread is abandoned, never waited
  for, and a fresh one takes its place). The reward of the step is kept in every case but the
  failures. Otherwise it answers the observation's ids (app.envs.templates, truncated to
  max_observation_tokens, counted) and done=False; an observation that encodes to no ids ends
  the row ('error': the loop resumes a trajectory only by appending ids).
- `outcomes()` / `metrics()` after the loop: a row answered with an observation and not
  submitted again was ended by the loop (the observation did not fit the trajectory's token
  budget) and counts as 'length'.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from app.envs.interface import EnvFactory, check_reset_result, check_step_result, load_env
from app.envs.pool import DaemonPool
from app.envs.templates import ObservationEncoder, observation_encoder

END_REASONS = ("done", "max_turns", "length", "error", "timeout")
WAIT_SLICE_S = 0.05  # longest single wait while submitted work has not started (timeouts start then)
# How often `poll` looks through every job in flight for timeouts. The decode loop polls once per
# step; a scan of 512 jobs took 0.4 ms on a 2-core machine, more than a decode step of few rows.
TIMEOUT_SCAN_S = 0.01
MAX_MESSAGE_CHARS = 500


def _turn_result_type() -> type:
    from actors.generation import TurnResult  # lazy: importing actors.generation imports torch

    return TurnResult


@dataclass
class _Job:
    """One reset or step in the pool; the pool thread stamps when it starts and ends."""

    row: int
    future: Future[Any] | None = None
    started: float | None = None
    finished: float | None = None


@dataclass
class _Row:
    sample: dict[str, Any]
    env: Any = None
    action_ids: list[int] = field(default_factory=list)
    last: bool = False
    answered_done: bool = False
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    steps: int = 0
    reset_s: float = 0.0
    step_s: float = 0.0
    observation_tokens: int = 0
    last_observation: int = 0  # ids of the observation answered last, until the row acts again
    truncated: int = 0
    end_reason: str | None = None
    error: str | None = None


def _run_timed(job: _Job, fn: Callable[..., Any], *args: Any) -> Any:
    job.started = time.monotonic()
    try:
        return fn(*args)
    finally:
        job.finished = time.monotonic()


def _describe(exc: BaseException) -> str:
    """"Type: message (at file:line)" of the innermost frame, cut to MAX_MESSAGE_CHARS."""
    where, tb = "", exc.__traceback__
    while tb is not None:
        where, tb = f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})", tb.tb_next
    text = f"{type(exc).__name__}: {exc}{where}"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


class EnvSessions:
    """The `TurnSource` of one generation call (see the module docstring), from JSON-able params:
    tokenizer "toy", an HF model directory or 'module:Class'; the rollout config section's fields;
    max_prompt_tokens: longer prompts keep their last tokens (counted in env/truncated_prompts)."""

    def __init__(self, env: str, samples: list[dict[str, Any]], tokenizer: str, chat_template: bool,
                 observation_role: str, max_turns: int, max_observation_tokens: int, env_timeout_s: float,
                 env_workers: int, reward_discount: float, env_kwargs: dict[str, Any] | None = None,
                 max_prompt_tokens: int | None = None) -> None:
        _check_params(samples, max_turns, max_observation_tokens, env_timeout_s, env_workers, reward_discount,
                      max_prompt_tokens)
        self.factory: EnvFactory = load_env(env)
        self.encoder: ObservationEncoder = (observation_encoder(tokenizer, bool(chat_template), observation_role)
                                            if isinstance(tokenizer, str)
                                            else ObservationEncoder(tokenizer, chat_template, observation_role))
        if max_observation_tokens < self.encoder.min_observation_tokens:
            raise ValueError(f"rollout.max_observation_tokens={max_observation_tokens}: the chat template alone "
                             f"takes {self.encoder.min_observation_tokens} tokens per observation; raise it")
        self.env_kwargs = dict(env_kwargs or {})
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        self.env_timeout_s, self.reward_discount = float(env_timeout_s), float(reward_discount)
        self.max_prompt_tokens = max_prompt_tokens
        self.truncated_prompts = 0
        self._rows = [_Row(dict(s)) for s in samples]
        self._pool = DaemonPool(env_workers, name="env-step")
        self._inflight: dict[int, _Job] = {}
        self._done: deque[_Job] = deque()  # jobs whose future finished, appended by the pool's threads
        self._next_scan = 0.0  # when `_finished_jobs` next looks for timeouts
        self._ready: list[Any] = []
        self._prompts: list[list[int]] | None = None
        self._turn_result = _turn_result_type()

    # ---- the TurnSource protocol -------------------------------------------------------------

    def prompts(self) -> list[list[int]]:
        """Prompt ids of every row, after every reset has finished or timed out (see the module docstring)."""
        if self._prompts is None:
            for i, row in enumerate(self._rows):
                self._start(i, self._make_env, row.sample)
            firsts: dict[int, str | list[dict[str, str]]] = {}
            while self._inflight:
                self._wait(None)
                for job in self._finished_jobs():
                    first = self._finish_reset(job)
                    if first is not None:
                        firsts[job.row] = first
            self._prompts = [self._prompt_ids(i, firsts.get(i)) for i in range(len(self._rows))]
        return [list(p) for p in self._prompts]

    def submit(self, row: int, action_ids: list[int], last: bool) -> None:
        """Step row's environment with this turn's action (decoded); answered by a later `poll`."""
        if self._prompts is None:
            raise RuntimeError("EnvSessions.submit before prompts()")
        if not 0 <= row < len(self._rows):
            raise ValueError(f"row {row}: outside 0..{len(self._rows) - 1}")
        state = self._rows[row]
        if row in self._inflight or any(r.row == row for r in self._ready):
            raise ValueError(f"row {row}: submitted again before its previous turn was answered")
        if state.answered_done:
            raise ValueError(f"row {row}: its trajectory already ended ({state.end_reason})")
        state.turns += 1
        state.last, state.last_observation = bool(last), 0
        state.action_ids = [int(i) for i in action_ids]
        if state.end_reason is not None:  # its reset failed: end it now
            self._ready.append(self._end(row))
            return
        try:
            text = self.encoder.decode(state.action_ids)
        except Exception as exc:  # noqa: BLE001 (user code or its output: ends the row)
            self._ready.append(self._end(row, "error", f"decoding the action: {_describe(exc)}"))
            return
        self._start(row, state.env.step, text)

    def poll(self, wait_s: float) -> list[Any]:
        """TurnResults of the steps finished (or timed out) now; waits up to wait_s for one."""
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            results, self._ready = self._ready, []
            results += [self._finish_step(job) for job in self._finished_jobs()]
            if results or not self._inflight or time.monotonic() >= deadline:
                return results
            self._wait(deadline)

    def pending(self) -> int:
        """Rows submitted and not yet answered."""
        return len(self._inflight) + len(self._ready)

    # ---- results -------------------------------------------------------------------------------

    def outcomes(self) -> list[dict[str, Any]]:
        """Per row, once the decode loop has finished: reward (sum_t discount^t r_t), step_rewards,
        turns (actions submitted), steps (env.step calls), env_seconds (reset and steps),
        observation_tokens (appended), truncated_observations, end_reason (one of END_REASONS) and
        error. A row answered with an observation and never submitted again was ended by the loop
        (the observation did not fit its token budget): 'length', that observation not counted."""
        out = []
        for i, row in enumerate(self._rows):
            reason, observed = row.end_reason, row.observation_tokens
            if reason is None and row.last_observation and i not in self._inflight:
                reason, observed = "length", observed - row.last_observation
            out.append({
                "reward": sum(self.reward_discount**t * r for t, r in enumerate(row.rewards)),
                "step_rewards": list(row.rewards), "turns": row.turns, "steps": row.steps,
                "env_seconds": row.reset_s + row.step_s, "observation_tokens": observed,
                "truncated_observations": row.truncated, "end_reason": reason, "error": row.error,
            })
        return out

    def metrics(self) -> dict[str, float]:
        """Aggregates over the rows, named as veRL names its env metrics (env/...)."""
        rows, n, outcomes = self._rows, max(1, len(self._rows)), self.outcomes()
        steps = sum(r.steps for r in rows)
        reasons = [o["end_reason"] for o in outcomes]
        return {
            "env/turns_mean": sum(r.turns for r in rows) / n,
            "env/turns_max": float(max((r.turns for r in rows), default=0)),
            "env/steps": float(steps),
            "env/step_s_mean": sum(r.step_s for r in rows) / steps if steps else 0.0,
            "env/seconds": sum(r.reset_s + r.step_s for r in rows),
            "env/errors": float(reasons.count("error")),
            "env/timeouts": float(reasons.count("timeout")),
            "env/truncated_observations": float(sum(r.truncated for r in rows)),
            "env/truncated_prompts": float(self.truncated_prompts),
            "env/observation_tokens_mean": sum(o["observation_tokens"] for o in outcomes) / n,
            "env/length_cut": float(reasons.count("length")),
            "env/max_turns_cut": float(reasons.count("max_turns")),
            "env/done_fraction": reasons.count("done") / n,
            "env/reward_mean": sum(o["reward"] for o in outcomes) / n,
        }

    def close(self) -> None:
        """Shut the pool down without waiting for steps still running (their results are dropped)."""
        self._pool.close()
        self._inflight.clear()
        self._done.clear()

    def __enter__(self) -> EnvSessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------

    def _make_env(self, sample: dict[str, Any]) -> tuple[Any, str | list[dict[str, str]]]:
        env = self.factory(**self.env_kwargs)
        return env, check_reset_result(env.reset(dict(sample)), self.factory.spec)

    def _start(self, row: int, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(row)
        job.future = self._pool.submit(_run_timed, job, fn, *args)
        job.future.add_done_callback(lambda _future, job=job: self._done.append(job))  # deque: thread-safe
        self._inflight[row] = job
        return job

    def _finished_jobs(self) -> list[_Job]:
        """In-flight jobs now done (in the order they finished) or past the timeout, removed from
        the in-flight set. Done ones come from their futures' callbacks, so a poll costs the
        answers it returns; the in-flight set is scanned for timeouts at most every TIMEOUT_SCAN_S."""
        done = []
        while self._done:
            job = self._done.popleft()
            if self._inflight.get(job.row) is job:  # not already ended by a timeout
                del self._inflight[job.row]
                done.append(job)
        now = time.monotonic()
        if self._inflight and now >= self._next_scan:
            self._next_scan = now + TIMEOUT_SCAN_S
            late = [job for job in self._inflight.values()
                    if job.started is not None and now - job.started > self.env_timeout_s]
            for job in late:
                del self._inflight[job.row]
            done += late
        return done

    def _wait(self, deadline: float | None) -> None:
        """Until an in-flight job finishes, one may have timed out, or the deadline."""
        now = time.monotonic()
        starts = [job.started for job in self._inflight.values()]
        limits = [s + self.env_timeout_s - now for s in starts if s is not None]
        if any(s is None for s in starts):
            limits.append(WAIT_SLICE_S)
        if deadline is not None:
            limits.append(deadline - now)
        timeout = max(0.0, min(limits)) + 1e-3 if limits else None
        wait([job.future for job in self._inflight.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def _outcome(self, job: _Job) -> tuple[float, Any, str | None, str | None]:
        """(seconds, result, failure reason, message) of a finished or timed-out job."""
        now = time.monotonic()
        seconds = (job.finished or now) - (job.started or now)
        if not job.future.done() or seconds > self.env_timeout_s:
            self._pool.abandon(job.future)
            return seconds, None, "timeout", f"took longer than rollout.env_timeout_s={self.env_timeout_s:g}"
        exc = job.future.exception()
        if exc is not None:
            return seconds, None, "error", _describe(exc)
        return seconds, job.future.result(), None, None

    def _finish_reset(self, job: _Job) -> str | list[dict[str, str]] | None:
        state = self._rows[job.row]
        seconds, result, reason, message = self._outcome(job)
        state.reset_s += seconds
        if reason is not None:
            state.end_reason, state.error = reason, f"reset: {message}"
            return None
        state.env, first = result
        return first

    def _finish_step(self, job: _Job) -> Any:
        row, state = job.row, self._rows[job.row]
        seconds, result, reason, message = self._outcome(job)
        state.steps += 1
        state.step_s += seconds
        if reason is None:
            try:
                outcome = check_step_result(result, self.factory.spec)
            except ValueError as exc:
                reason, message = "error", str(exc)
        if reason is not None:
            return self._end(row, reason, f"step {state.steps}: {message}")
        state.rewards.append(outcome.reward)
        if outcome.done:
            return self._end(row, "done")
        if state.turns >= self.max_turns:
            return self._end(row, "max_turns")
        if state.last:
            return self._end(row, "length")
        try:
            ids, truncated = self.encoder.encode_observation(outcome.observation, self.max_observation_tokens,
                                                             state.action_ids)
        except Exception as exc:  # noqa: BLE001 (user code or its output: ends the row)
            return self._end(row, "error", f"step {state.steps}: encoding the observation: {_describe(exc)}")
        if not ids:  # the loop resumes a trajectory only by appending ids
            return self._end(row, "error", f"step {state.steps}: the observation {outcome.observation!r} encodes to "
                                           "no tokens and done is False; return a non-empty observation")
        state.observation_tokens += len(ids)
        state.last_observation = len(ids)
        state.truncated += int(truncated)
        return self._turn_result(row, tuple(ids), False)

    def _end(self, row: int, reason: str | None = None, message: str | None = None) -> Any:
        """The done answer of a row; reason None keeps the reason it already has (a failed reset)."""
        state = self._rows[row]
        if reason is not None:
            state.end_reason, state.error = reason, message
        state.answered_done = True
        return self._turn_result(row, (), True)

    def _prompt_ids(self, row: int, first: str | list[dict[str, str]] | None) -> list[int]:
        """The first observation's prompt ids; a failed row's: its sample's prompt, else [bos] / [eos]."""
        state, ids = self._rows[row], []
        if first is not None:
            try:
                ids = self.encoder.encode_prompt(first)
            except Exception as exc:  # noqa: BLE001 (user code or its output: ends the row)
                state.end_reason, state.error = "error", f"reset: encoding the first observation: {_describe(exc)}"
        if state.end_reason is not None:  # a failed row
            with contextlib.suppress(Exception):
                ids = self.encoder.encode_prompt(str(state.sample.get("prompt", "")))
        if not ids:
            bos = getattr(self.encoder.tokenizer, "bos_token_id", None)
            ids = [int(bos if bos is not None else self.encoder.tokenizer.eos_token_id)]
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            ids = ids[-self.max_prompt_tokens:]
            self.truncated_prompts += 1
        return ids


def _check_params(samples: list[dict[str, Any]], max_turns: int, max_observation_tokens: int, env_timeout_s: float,
                  env_workers: int, reward_discount: float, max_prompt_tokens: int | None) -> None:
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise ValueError("EnvSessions samples: expected a list of dicts (one dataset record per row)")
    for name, value, ok, allowed in [
        ("rollout.max_turns", max_turns, max_turns >= 1, ">= 1"),
        ("rollout.max_observation_tokens", max_observation_tokens, max_observation_tokens >= 1, ">= 1"),
        ("rollout.env_timeout_s", env_timeout_s, env_timeout_s > 0, "> 0"),
        ("rollout.env_workers", env_workers, env_workers >= 1, ">= 1"),
        ("rollout.reward_discount", reward_discount, 0.0 <= reward_discount <= 1.0, "in [0, 1]"),
        ("max_prompt_tokens", max_prompt_tokens, max_prompt_tokens is None or max_prompt_tokens >= 1, "null or >= 1"),
    ]:
        if not ok:
            raise ValueError(f"{name}={value!r}: must be {allowed}")


__all__ = ["END_REASONS", "DaemonPool", "EnvSessions"]
