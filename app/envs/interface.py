"""The user's environment interface, its loader and the checks of what it returns.

An environment is a plain Python class, one instance per trajectory, constructed with the config's
`rollout.env_kwargs` as keyword arguments:

    class MyEnv:
        def __init__(self, **env_kwargs): ...
        def reset(self, sample: dict) -> str | list[dict]:      # the first observation: text, or
            ...                                                 # chat messages [{role, content}]
        def step(self, action_text: str) -> tuple[str, float, bool, dict]:
            ...                                                 # (observation, reward, done, info)

`sample` is the dataset record of the trajectory's prompt (at least "prompt", and "answer" when
the dataset has one). `action_text` is what the actor sampled this turn, decoded without special
tokens. The config names the class as `rollout.env: 'module:Class'` or `'path/to/file.py:Class'`;
`check_env` resolves and constructs it on the driver before Ray starts and raises one
`EnvLoadError` naming the spec and the problem. The `EnvFactory` it returns pickles as its spec,
so it can be shipped to Ray workers that share the file system.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.data import import_user_module, looks_like_file


class EnvLoadError(ValueError):
    """A name in the config (an environment class, or a tokenizer 'module:Class') cannot be used."""


class Env(Protocol):
    """What an environment class provides (duck-typed: no base class is needed)."""

    def reset(self, sample: dict[str, Any]) -> str | list[dict[str, str]]: ...

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]: ...


@dataclass(frozen=True)
class StepOutcome:
    """One checked `step` result: the observation text, a finite reward, done, and the info dict."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def import_attribute(spec: str, what: str) -> tuple[Any, str]:
    """The object named 'module:Name' or 'path/to/file.py:Name', and the spec with the file path
    made absolute. `what` names the setting in errors (e.g. "rollout.env='x:Y'")."""
    if not isinstance(spec, str):
        raise EnvLoadError(f"{what}: expected a string 'module:Class' or 'path/to/file.py:Class', "
                           f"got {type(spec).__name__}")
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise EnvLoadError(f"{what}: expected 'module:Class' or 'path/to/file.py:Class'")
    module = import_user_module(target, what, EnvLoadError, "env")
    if not hasattr(module, name):
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_")
                         and v.__module__ == module.__name__)
        raise EnvLoadError(f"{what}: {target!r} has no attribute {name!r}; classes there: "
                           f"{', '.join(classes[:12]) or 'none'}")
    if looks_like_file(target):
        spec = f"{Path(target).expanduser().resolve()}:{name}"
    return getattr(module, name), spec


def _check_methods(what: str, cls: type) -> None:
    """reset(sample) and step(action_text) exist, are callable and take one argument each."""
    for method, argument in (("reset", "sample"), ("step", "action_text")):
        fn = getattr(cls, method, None)
        if fn is None or not callable(fn):
            state = "is missing" if fn is None else f"is a {type(fn).__name__}, not a method"
            raise EnvLoadError(f"{what}: method {method}({argument}) {state}; an environment defines "
                               "reset(self, sample) -> observation and step(self, action_text) -> "
                               "(observation, reward, done, info)")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: trust them
            continue
        try:
            signature.bind(None, None)  # self and the one argument
        except TypeError as exc:
            raise EnvLoadError(f"{what}: {cls.__name__}.{method}{signature} cannot be called as "
                               f"{method}(self, {argument}): {exc}") from None


class EnvFactory:
    """A loaded environment class; `spec` is the config string it came from (file paths made
    absolute). Calling it with env_kwargs makes one environment instance. Pickling sends only the
    spec, and unpickling loads the class again (in a Ray worker)."""

    def __init__(self, spec: str, cls: type) -> None:
        self.spec = spec
        self.cls = cls

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return load_env, (self.spec,)

    def __call__(self, **env_kwargs: Any) -> Any:
        return self.cls(**env_kwargs)

    def __repr__(self) -> str:
        return f"EnvFactory({self.spec!r})"


def load_env(spec: str) -> EnvFactory:
    """Resolve 'module:Class' or 'path/to/file.py:Class' to an `EnvFactory`, checking that it is a
    class with reset(sample) and step(action_text) methods."""
    what = f"rollout.env={spec!r}"
    obj, spec = import_attribute(spec, what)
    if not isinstance(obj, type):
        raise EnvLoadError(f"{what}: {spec.rpartition(':')[2]!r} is a {type(obj).__name__}, not a class; "
                           "name a class with reset(sample) and step(action_text) methods")
    _check_methods(what, obj)
    return EnvFactory(spec, obj)


def check_env(spec: str, env_kwargs: dict[str, Any] | None = None) -> EnvFactory:
    """`load_env(spec)`, then one instance constructed with env_kwargs (the driver's check before
    Ray starts): a constructor that rejects the keywords or fails raises `EnvLoadError`."""
    factory = load_env(spec)
    kwargs = dict(env_kwargs or {})
    what = f"rollout.env={factory.spec!r}"
    try:
        signature = inspect.signature(factory.cls)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise EnvLoadError(f"{what}: the constructor {factory.cls.__name__}{signature} rejects "
                               f"rollout.env_kwargs={kwargs!r}: {exc}") from None
    try:
        factory(**kwargs)
    except Exception as exc:
        raise EnvLoadError(f"{what}: constructing {factory.cls.__name__}(**{kwargs!r}) failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    return factory


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _bool_like(value: Any) -> bool | None:
    """bool, a numpy bool, or the integers 0/1 as a bool; None for anything else."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    return None


def check_step_result(value: Any, spec: str) -> StepOutcome:
    """A `step` return value as a `StepOutcome`; ValueError naming the env and what was returned."""
    what = f"environment {spec}: step returned"
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        size = f"a {len(value)}-tuple" if isinstance(value, (tuple, list)) else type(value).__name__
        raise ValueError(f"{what} {size} ({_short(value)}); expected a 4-tuple "
                         "(observation: str, reward: float, done: bool, info: dict)")
    observation, reward, done, info = value
    if not isinstance(observation, str):
        raise ValueError(f"{what} observation {_short(observation)} ({type(observation).__name__}); "
                         "expected a str")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"{what} reward {_short(reward)} ({type(reward).__name__}); expected a finite number")
    flag = _bool_like(done)
    if flag is None:
        raise ValueError(f"{what} done {_short(done)} ({type(done).__name__}); expected a bool")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise ValueError(f"{what} info {_short(info)} ({type(info).__name__}); expected a dict (or None)")
    return StepOutcome(observation, float(reward), flag, info)


def check_reset_result(value: Any, spec: str) -> str | list[dict[str, str]]:
    """A `reset` return value checked: a str, or a non-empty list of {role: str, content: str}."""
    if isinstance(value, str):
        return value
    ok = isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ValueError(f"environment {spec}: reset returned {_short(value)} ({type(value).__name__}); expected "
                         "the first observation as a str or a non-empty list of {'role': str, 'content': str}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


__all__ = [
    "Env", "EnvFactory", "EnvLoadError", "StepOutcome", "check_env", "check_reset_result", "check_step_result",
    "import_attribute", "load_env",
]
