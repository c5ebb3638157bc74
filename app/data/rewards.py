"""Rule-based reward functions named by a `module:function` string in the experiment config.

The string is either an importable module and a function name (`app.data.rewards:math_exact_match`,
`mypkg.scoring:score`) or a path to a Python file and a function name
(`./my_rewards.py:score`, `/abs/path/rw.py:score`). The function is called once per response as

    fn(prompt: str, response: str, answer: str | None) -> float | int | bool | dict

where `answer` is the dataset's reference answer (None when the dataset has none) and a dict
result must hold a numeric "score" (other keys are kept as extra info). `load_reward_fn` resolves
the string on the driver, before any worker starts, and raises one `RewardLoadError` naming the
problem (unknown module, missing file, missing function, not callable).

Built-ins: `app.data.rewards:toy_reward` (the toy task, see app.data.toy_task) and
`app.data.rewards:math_exact_match` (GSM8K-style: the last number in the response equals the answer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.data.toy_task import toy_reward  # noqa: F401  (configs name it `app.data.rewards:toy_reward`)
from app.data.user_code import import_user_module, looks_like_file

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardLoadError(ValueError):
    """The reward function named in the config cannot be loaded."""


@dataclass(frozen=True)
class RewardResult:
    """One scored response: the scalar score plus any extra keys the function returned."""

    score: float
    extra: dict[str, Any]


def _last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def math_exact_match(prompt: str, response: str, answer: str | None) -> float:
    """1.0 if the last number in the response equals the reference answer, else 0.0.

    The reference is the text after "####" when present (GSM8K format), else its last number.
    Commas are thousands separators ("1,000" == 1000); comparison is numeric ("3.0" == "3").
    """
    if answer is None:
        raise ValueError("math_exact_match: the dataset has no answer field; it needs one per prompt")
    reference_text = answer.split("####")[-1]
    reference, predicted = _last_number(reference_text), _last_number(response)
    if reference is None or predicted is None:
        return 0.0
    return 1.0 if math.isclose(predicted, reference, rel_tol=0.0, abs_tol=1e-6) else 0.0


class RewardFn:
    """A loaded reward function; `spec` is the config string it came from (file paths made
    absolute). Pickling sends only the spec, and unpickling loads it again, so a RewardFn from a
    local .py file can be shipped to Ray workers that share the file system."""

    def __init__(self, spec: str, fn: Callable[..., Any]) -> None:
        self.spec = spec
        self.fn = fn

    def __reduce__(self) -> tuple[Callable[[str], RewardFn], tuple[str]]:
        return load_reward_fn, (self.spec,)

    def score(self, prompt: str, response: str, answer: str | None = None) -> RewardResult:
        """Call the function and check its result (number, bool or dict with a numeric "score")."""
        raw = self.fn(prompt, response, answer)
        extra: dict[str, Any] = {}
        if isinstance(raw, dict):
            if "score" not in raw:
                raise ValueError(f"reward {self.spec}: returned a dict without a 'score' key (keys: {sorted(raw)})")
            extra = {k: v for k, v in raw.items() if k != "score"}
            raw = raw["score"]
        if isinstance(raw, bool):
            raw = float(raw)
        if not isinstance(raw, (int, float)) or not math.isfinite(float(raw)):
            raise ValueError(f"reward {self.spec}: returned {raw!r}; must be a finite number, a bool, "
                             "or a dict with a numeric 'score'")
        return RewardResult(float(raw), extra)

    def score_batch(self, prompts: list[str], responses: list[str],
                    answers: list[str | None] | None = None) -> list[float]:
        """Scores of many responses (answers default to None for every prompt)."""
        if len(prompts) != len(responses) or (answers is not None and len(answers) != len(prompts)):
            raise ValueError(f"score_batch: {len(prompts)} prompts, {len(responses)} responses, "
                             f"{'no' if answers is None else len(answers)} answers; lengths must match")
        answers = answers if answers is not None else [None] * len(prompts)
        return [self.score(p, r, a).score for p, r, a in zip(prompts, responses, answers)]

    def __call__(self, prompt: str, response: str, answer: str | None = None) -> float:
        return self.score(prompt, response, answer).score


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve `module:function` or `path/to/file.py:function` to a callable `RewardFn`."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardLoadError(f"reward {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    module = import_user_module(target, f"reward {spec!r}", RewardLoadError, "reward")
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardLoadError(f"reward {spec!r}: {target!r} has no function {name!r}; "
                              f"callables there: {', '.join(public[:12]) or 'none'}")
    if not callable(fn):
        raise RewardLoadError(f"reward {spec!r}: {target}.{name} is a {type(fn).__name__}, not callable")
    if looks_like_file(target):
        spec = f"{Path(target).expanduser().resolve()}:{name}"
    return RewardFn(spec, fn)


__all__ = ["RewardFn", "RewardLoadError", "RewardResult", "load_reward_fn", "math_exact_match"]
