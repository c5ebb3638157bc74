"""Tests of the built-in environments (app.envs.builtin) and the calculator's safe evaluator
(app.envs.calculator)."""

from __future__ import annotations

import pytest

from app.data import generate_toy_prompts
from app.envs import CalculatorEnv, CalculatorError, HiddenDigitGame, calculate, evaluate
from app.envs.calculator import MAX_EXPRESSION_CHARS

pytestmark = pytest.mark.unit

SAMPLES = generate_toy_prompts(1000, seed=7)


def play(sample: dict[str, str], answer: "callable") -> float:  # noqa: UP037
    """One episode; `answer` maps the observation after step 1 to the second action."""
    game = HiddenDigitGame()
    first = game.reset(sample)
    assert first == "?"
    observation, reward, done, _ = game.step("anything")
    assert (reward, done) == (0.0, False) and len(observation) == 1 and observation in "0123456789"
    _, reward, done, info = game.step(answer(observation))
    assert done and info["target"] == str((info["secret"] + 1) % 10)
    return reward


def test_hidden_digit_reading_the_observation_scores_one() -> None:
    rewards = [play(s, lambda obs: f"{(int(obs) + 1) % 10}xyz") for s in SAMPLES]
    assert rewards == [1.0] * len(SAMPLES)


def test_hidden_digit_ignoring_the_observation_scores_chance() -> None:
    # Every sample shows the same first observation, so a policy that ignores the second one
    # answers the same way everywhere: its expected reward is that of a constant answer.
    means = {c: sum(play(s, lambda obs, c=c: c) for s in SAMPLES) / len(SAMPLES) for c in "0123456789"}
    assert all(0.22 < m < 0.34 for m in means.values()), means  # chance: 0.1 * 1 + 0.9 * 0.2 = 0.28
    assert abs(sum(means.values()) / 10 - 0.28) < 1e-9  # averaged over constants: exactly chance
    assert sum(play(s, lambda obs: "a") for s in SAMPLES[:50]) == 0.0
    assert sum(play(s, lambda obs: "") for s in SAMPLES[:50]) == 0.0


def test_hidden_digit_is_deterministic_and_seeded() -> None:
    def secrets(seed: int) -> list[int]:
        games = [HiddenDigitGame(seed=seed) for _ in SAMPLES[:200]]
        for game, sample in zip(games, SAMPLES[:200]):
            game.reset(sample)
            game.step("?")  # the first step shows the secret
        return [game.secret for game in games]

    assert secrets(0) == secrets(0) != secrets(1)
    assert set(secrets(0)) == set(range(10))
    game = HiddenDigitGame()
    game.reset(SAMPLES[0])
    game.step("a")
    game.step("b")
    with pytest.raises(RuntimeError, match="ended after 2 steps"):
        game.step("c")


def test_hidden_digit_rounds_reward_each_answer_against_the_digit_before_it() -> None:
    game = HiddenDigitGame(rounds=3)
    game.reset(SAMPLES[0])
    shown, total, done = game.step("x")[0], 0.0, False
    for turn in range(3):
        observation, reward, done, info = game.step(str((int(shown) + 1) % 10))
        assert info["target"] == str((int(shown) + 1) % 10)
        total += reward
        assert done == (turn == 2)
        shown = observation
    assert total == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rounds"):
        HiddenDigitGame(rounds=0)


@pytest.mark.parametrize(("expression", "value"), [
    ("2+3*4", 14), ("(2 + 3) * 4", 20), ("-3**2", -9), ("7/2", 3.5), ("7//2", 3), ("7 % 3", 1),
    ("2**10", 1024), ("2**-1", 0.5), ("--5", 5), ("+4", 4), ("1,000 + 1", 1001), ("1.5 * 2", 3.0),
    ("((((1))))", 1), ("10**30", 10**30),
])
def test_evaluate_valid(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "expected"), [
    ("__import__('os').system('ls')", "function calls not allowed"),
    ("abs(-1)", "function calls not allowed"),
    ("x + 1", "names not allowed"),
    ("(1).real", "attributes not allowed"),
    ("[1, 2][0]", "subscripts not allowed"),
    ("1 if 1 else 2", "if/else not allowed"),
    ("1 < 2", "comparisons not allowed"),
    ("1 and 2", "and/or not allowed"),
    ("2 ^ 3", "operator ^ (use ** for powers) not allowed"),
    ("1 << 3", "operator << not allowed"),
    ("~1", "operator ~ not allowed"),
    ("not 1", "operator not not allowed"),
    ("lambda: 1", "lambdas not allowed"),
    ("1, 2", "tuples"),
    ("'a' * 3", "'a' is not a number"),
    ("1j", "1j is not a number"),
    ("True + 1", "True is not a number"),
    ("", "empty expression"),
    ("1 +", "cannot parse"),
    ("1" * (MAX_EXPRESSION_CHARS + 1), "longer than"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("2 ** 100000", "exponent 100000 exceeds 64"),
    ("2 ** 2 ** 2 ** 2 ** 2", "exceeds 64"),
    ("9 ** 60", "result exceeds"),
    ("10**20 * 10**20", "result exceeds"),
    ("(-8) ** 0.5", "fractional power"),
    ("0 ** -1", "zero to a negative power"),
    ("1e308 * 10", "result exceeds"),
    ("1e400 - 1", "not a finite number"),
])
def test_evaluate_refuses(expression: str, expected: str) -> None:
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert expected in str(info.value)
    assert calculate(expression).startswith("error: ")


def test_calculate_formats() -> None:
    assert calculate("6 * 7") == "42"
    assert calculate("1.5 * 2") == "3"
    assert calculate("1 / 3") == "0.333333333333"
    assert calculate("import os") == "error: cannot parse 'import os' (invalid syntax)"


GSM8K_SAMPLE = {"prompt": "Tom has 3 bags of 12 apples. How many apples?",
                "answer": "3 bags * 12 = 36 apples.\n#### 36"}


def test_calculator_env_episode() -> None:
    env = CalculatorEnv()
    first = env.reset(GSM8K_SAMPLE)
    assert first.startswith(GSM8K_SAMPLE["prompt"]) and "<calc>" in first and "####" in first
    observation, reward, done, info = env.step("I need <calc>3 * 12</calc> and <calc>2**99</calc>.")
    assert observation == "<result>36</result>\n<result>error: exponent 99 exceeds 64 in magnitude</result>"
    assert (reward, done, info) == (0.0, False, {"calls": 2})
    observation, reward, done, _ = env.step("I think so.")
    assert (reward, done) == (0.0, False) and "<calc>EXPRESSION</calc>" in observation
    assert env.step("So the answer is\n#### 36")[1:3] == (1.0, True)


def test_calculator_env_answers() -> None:
    def answer(text: str) -> tuple[float, bool]:
        env = CalculatorEnv()
        env.reset(GSM8K_SAMPLE)
        return env.step(text)[1:3]

    assert answer("<answer>36.0</answer>") == (1.0, True)
    assert answer("#### 1,036") == (0.0, True)
    assert answer("#### 35") == (0.0, True)
    assert answer("<calc>3*12</calc> #### 36") == (0.0, False)  # a calculation turn: the answer comes later


def test_calculator_env_checks_the_sample_and_kwargs() -> None:
    with pytest.raises(ValueError, match="sample field 'answer' is missing or not a string"):
        CalculatorEnv().reset({"prompt": "q"})
    env = CalculatorEnv(instruction="", max_calls=1)
    assert env.reset({"prompt": "q", "answer": "4"}) == "q"
    observation = env.step("<calc>1+1</calc><calc>2+2</calc>")[0]
    assert observation.startswith("<result>2</result>\n(only the first 1 calculations")
    with pytest.raises(ValueError, match="max_calls=0"):
        CalculatorEnv(max_calls=0)
