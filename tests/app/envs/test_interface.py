"""Tests of app.envs.interface: loading environment classes by name (each error case and its
message), pickling the factory by spec, and the checks of what reset and step return."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from app.envs import EnvFactory, EnvLoadError, HiddenDigitGame, StepOutcome, check_env, check_step_result, load_env
from app.envs.interface import check_reset_result

pytestmark = pytest.mark.unit

ENV_FILE = '''
class FileEnv:
    def __init__(self, bonus: float = 0.0):
        self.bonus = bonus
    def reset(self, sample):
        return "start"
    def step(self, action_text):
        return "obs", 1.0 + self.bonus, True, {}

def not_a_class(sample):
    return "x"

class NoStep:
    def reset(self, sample):
        return "x"

class StepNotMethod:
    step = 3
    def reset(self, sample):
        return "x"

class StepTakesTwo:
    def reset(self, sample):
        return "x"
    def step(self, action_text, extra):
        return "x", 0.0, True, {}

class Exploding:
    def __init__(self, size: int = 1):
        raise RuntimeError("no GPU for the env")
    def reset(self, sample):
        return "x"
    def step(self, action_text):
        return "x", 0.0, True, {}
'''


@pytest.fixture()
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_envs.py"
    path.write_text(ENV_FILE)
    return path


def test_load_builtin_by_module_and_pickle_by_spec() -> None:
    factory = load_env("app.envs.builtin:HiddenDigitGame")
    assert isinstance(factory, EnvFactory) and factory.cls is HiddenDigitGame
    again = pickle.loads(pickle.dumps(factory))
    assert again.spec == factory.spec and again.cls is HiddenDigitGame
    assert isinstance(again(seed=3), HiddenDigitGame)


def test_load_from_file_makes_the_path_absolute_and_pickles(env_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(env_file.parent)
    factory = load_env("./my_envs.py:FileEnv")
    assert factory.spec == f"{env_file.resolve()}:FileEnv"
    again = pickle.loads(pickle.dumps(factory))
    assert again.spec == factory.spec
    env = again(bonus=0.5)
    assert env.reset({"prompt": "p"}) == "start" and env.step("a") == ("obs", 1.5, True, {})


@pytest.mark.parametrize(("spec", "expected"), [
    ("HiddenDigitGame", "expected 'module:Class'"),
    ("app.envs.builtin:", "expected 'module:Class'"),
    ("no_such_module_xyz:Env", "module 'no_such_module_xyz' cannot be imported"),
    ("/no/such/dir/envs.py:Env", "does not exist"),
    ("app.envs.builtin:NoSuchEnv", "has no attribute 'NoSuchEnv'; classes there: CalculatorEnv, HiddenDigitGame"),
])
def test_load_errors_name_the_spec_and_the_problem(spec: str, expected: str) -> None:
    with pytest.raises(EnvLoadError) as info:
        load_env(spec)
    assert f"rollout.env={spec!r}" in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize(("name", "expected"), [
    ("not_a_class", "'not_a_class' is a function, not a class"),
    ("NoStep", "method step(action_text) is missing"),
    ("StepNotMethod", "method step(action_text) is a int, not a method"),
    ("StepTakesTwo", "StepTakesTwo.step(self, action_text, extra) cannot be called as step(self, action_text)"),
])
def test_load_errors_for_what_the_file_holds(env_file: Path, name: str, expected: str) -> None:
    with pytest.raises(EnvLoadError, match="rollout.env=") as info:
        load_env(f"{env_file}:{name}")
    assert expected in str(info.value) and str(env_file) in str(info.value)


def test_a_file_that_fails_to_execute(tmp_path: Path) -> None:
    path = tmp_path / "broken_env.py"
    path.write_text("raise ImportError('needs gym')\n")
    with pytest.raises(EnvLoadError, match=r"executing .*broken_env.py' failed: ImportError: needs gym"):
        load_env(f"{path}:Env")


def test_check_env_constructs_with_the_kwargs(env_file: Path) -> None:
    assert check_env(f"{env_file}:FileEnv", {"bonus": 2.0}).cls.__name__ == "FileEnv"
    with pytest.raises(EnvLoadError) as info:
        check_env(f"{env_file}:FileEnv", {"bonsu": 2.0})
    message = str(info.value)
    assert "rejects rollout.env_kwargs={'bonsu': 2.0}" in message and "(bonus: float = 0.0)" in message
    with pytest.raises(EnvLoadError, match=r"constructing Exploding\(\*\*\{'size': 2\}\) failed: "
                                           "RuntimeError: no GPU for the env"):
        check_env(f"{env_file}:Exploding", {"size": 2})


def test_check_step_result_accepts_and_normalises() -> None:
    assert check_step_result(("o", 1, True, {"k": 1}), "E") == StepOutcome("o", 1.0, True, {"k": 1})
    outcome = check_step_result(["o", np.float32(0.5), np.bool_(False), None], "E")
    assert outcome == StepOutcome("o", 0.5, False, {}) and type(outcome.done) is bool
    assert check_step_result(("", 0.0, 1, {}), "E").done is True


@pytest.mark.parametrize(("value", "expected"), [
    (("o", 1.0, True), "a 3-tuple"),
    (("o", 1.0, False, False, {}), "a 5-tuple"),
    ("o", "step returned str"),
    ((5, 1.0, False, {}), "observation 5 (int); expected a str"),
    (("o", "1.0", False, {}), "reward '1.0' (str); expected a finite number"),
    (("o", math.nan, False, {}), "reward nan (float)"),
    (("o", math.inf, False, {}), "reward inf (float)"),
    (("o", None, False, {}), "reward None (NoneType)"),
    (("o", 1.0, "yes", {}), "done 'yes' (str); expected a bool"),
    (("o", 1.0, 2, {}), "done 2 (int)"),
    (("o", 1.0, True, ["x"]), "info ['x'] (list); expected a dict"),
])
def test_check_step_result_errors_name_the_env_and_the_value(value: object, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        check_step_result(value, "my.envs:Maze")
    assert "environment my.envs:Maze: step returned" in str(info.value) and expected in str(info.value)


def test_check_reset_result() -> None:
    assert check_reset_result("hi", "E") == "hi"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "extra": 1}]
    assert check_reset_result(messages, "E") == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for bad in (None, [], [{"role": "user"}], [{"role": "user", "content": 3}], 7):
        with pytest.raises(ValueError, match="environment E: reset returned"):
            check_reset_result(bad, "E")
