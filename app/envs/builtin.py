"""Built-in environments: a two-turn toy game for the CPU learning test, and a calculator tool
for GSM8K-format math problems.

Name them in a config as `rollout.env: app.envs.builtin:HiddenDigitGame` (with the toy dataset
and tokenizer) or `app.envs.builtin:CalculatorEnv` (with a GSM8K prompt file, see app.data.gsm8k).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from app.data import math_exact_match
from app.envs.calculator import calculate

DIGITS = "0123456789"
HIDDEN_DIGIT_CREDIT = 0.2


class HiddenDigitGame:
    """A game whose reward needs what the observations say.

    reset(sample) returns `first_observation` ("?" by default), the same for every sample, so the
    prompt holds no information. Step 1 (any action): the observation is a secret digit as one
    character, reward 0. Each later step rewards the action's FIRST character against the digit
    shown just before it: 1.0 when it is the successor, str((digit + 1) % 10), 0.2
    (`HIDDEN_DIGIT_CREDIT`) when it is another digit and 0 otherwise, each divided by `rounds`
    (the trajectory's reward is their mean); it shows the next secret digit, until `rounds`
    digits have been answered (done). Secrets come from a hash of (seed, sample["prompt"], round).

    The reward cannot be earned without reading the observations: each secret is uniform over the
    ten digits and independent of everything the policy saw before it was shown, so a policy that
    ignores them answers the right digit with probability 1/10 at best and scores at most chance,
    0.1 * 1.0 + 0.9 * 0.2 = 0.28 (always answering a digit); one that reads them scores 1.0. The
    target is the successor, not the digit itself, because the toy task (app.data.toy_task) makes
    "digit d -> d + 1 as the next token" the map a tiny transformer learns first: each turn starts
    right after the observed digit. It takes rounds + 1 turns (rollout.max_turns).
    """

    def __init__(self, seed: int = 0, first_observation: str = "?", rounds: int = 1) -> None:
        if not isinstance(first_observation, str) or not first_observation:
            raise ValueError(f"first_observation={first_observation!r}: must be a non-empty string")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds={rounds!r}: must be an int >= 1")
        self.seed, self.first_observation, self.rounds = int(seed), first_observation, rounds
        self.prompt: str | None = None
        self.secret: int | None = None
        self.turn = 0

    def _secret(self, round_index: int) -> int:
        digest = hashlib.sha256(f"{self.seed}\0{self.prompt}\0{round_index}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % 10

    def reset(self, sample: dict[str, Any]) -> str:
        self.prompt = str(sample.get("prompt", ""))
        self.secret = None
        self.turn = 0
        return self.first_observation

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.prompt is None:
            raise RuntimeError("HiddenDigitGame.step before reset")
        self.turn += 1
        if self.turn > self.rounds + 1:
            raise RuntimeError(f"HiddenDigitGame.step: the game ended after {self.rounds + 1} steps "
                               f"(this is step {self.turn})")
        reward, info = 0.0, {}
        if self.secret is not None:
            target = str((self.secret + 1) % 10)
            first = action_text[:1]
            credit = 1.0 if first == target else HIDDEN_DIGIT_CREDIT if first and first in DIGITS else 0.0
            reward, info = credit / self.rounds, {"secret": self.secret, "target": target}
        if self.turn == self.rounds + 1:
            return "", reward, True, info
        self.secret = self._secret(self.turn)
        return str(self.secret), reward, False, info


CALCULATOR_INSTRUCTION = (
    "You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / // % ** and parentheses) "
    "and the result comes back as <result>VALUE</result>. When you know the answer, write it after "
    '"####" (or as <answer>N</answer>) in a turn without a calculation.'
)
_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_FINAL = re.compile(r"####\s*([^\n]*)|<answer>(.*?)</answer>", re.DOTALL)


class CalculatorEnv:
    """A calculator tool for GSM8K-format problems (sample["prompt"]: the question,
    sample["answer"]: the worked answer ending with `#### N`, or the number alone).

    reset(sample) returns the prompt followed by `instruction`. step(action):
    - calculations `<calc>EXPR</calc>` in the action (at most `max_calls` of them, in order) are
      evaluated by app.envs.calculator (errors come back as text, never as exceptions); the
      observation is one `<result>VALUE</result>` per calculation, reward 0, not done. A final
      answer written in the same turn is ignored: it must come after the results are seen.
    - otherwise a final answer (`#### N` or `<answer>N</answer>`) is compared numerically with
      the reference (app.data.rewards.math_exact_match): reward 1 or 0, done.
    - otherwise the observation restates the format, reward 0, not done.
    The session's max_turns ends a trajectory that never answers (reward 0).
    """

    def __init__(self, instruction: str = CALCULATOR_INSTRUCTION, prompt_key: str = "prompt",
                 answer_key: str = "answer", max_calls: int = 4) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls={max_calls}: must be >= 1")
        self.instruction = instruction
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.max_calls = int(max_calls)
        self.prompt = ""
        self.answer: str | None = None

    def reset(self, sample: dict[str, Any]) -> str:
        for key in (self.prompt_key, self.answer_key):
            if not isinstance(sample.get(key), str):
                raise ValueError(f"CalculatorEnv: sample field {key!r} is missing or not a string "
                                 f"(fields: {', '.join(sorted(sample)) or 'none'})")
        self.prompt, self.answer = sample[self.prompt_key], sample[self.answer_key]
        return f"{self.prompt}\n{self.instruction}" if self.instruction else self.prompt

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.answer is None:
            raise RuntimeError("CalculatorEnv.step before reset")
        calls = _CALC.findall(action_text)
        if calls:
            results = [f"<result>{calculate(expr)}</result>" for expr in calls[: self.max_calls]]
            if len(calls) > self.max_calls:
                results.append(f"(only the first {self.max_calls} calculations of a turn are evaluated)")
            return "\n".join(results), 0.0, False, {"calls": len(calls)}
        final = _FINAL.search(action_text)
        if final is not None:
            given = final.group(1) if final.group(1) is not None else final.group(2)
            reward = math_exact_match(self.prompt, given, self.answer)
            return "", reward, True, {"answer": given.strip()}
        return ("No calculation or final answer found. Write <calc>EXPRESSION</calc> to calculate, or "
                "#### N to answer."), 0.0, False, {}


__all__ = ["CALCULATOR_INSTRUCTION", "HIDDEN_DIGIT_CREDIT", "CalculatorEnv", "HiddenDigitGame"]
