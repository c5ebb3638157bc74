"""Checks of the files a config names, on the driver before Ray starts (no torch, no ray).

A model directory (`models.<role>.path`, `generate/score --model`) must hold a config.json the
planner reads and safetensors weights the workers can load: `check_model_dir` reads every
weight file's header (8-byte length + JSON, as the safetensors format defines it) without the
tensors, so a missing file, a truncated file, a garbled header, a missing tensor or a shape that
does not match the config is found here, naming the file and the tensor, instead of inside a
Ray worker half a minute later. A tokenizer directory must exist and hold tokenizer files. An
output path must be a file in an existing directory. Every failure is one ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.config.experiment import ConfigError, ExperimentConfig, ModelSource
from app.config.problem import reward_is_model_free, role_sources
from planning.models import ModelSpec, param_specs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VALUE_HEAD_FILE = "value_head.safetensors"
SCORE = "score.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
MODEL_DIR = "an HF model directory with config.json and safetensors weights"


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header, checked
    against the file's size. ValueError naming the file when it is truncated or not safetensors."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length <= 1 or 8 + length > size:
            raise ValueError(f"{path}: truncated or not a safetensors file ({size} bytes; header length field "
                             f"{length if length >= 0 else 'missing'})")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, info in header.items():
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has no valid shape / data_offsets in the header") from None
        if not 0 <= begin <= end <= data_bytes:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {end} of a {data_bytes}-byte data section "
                             "(the file is truncated)")
        info["shape"] = shape
    return header


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index,
    plus a value-head file). ValueError when there are no safetensors weights."""
    if (model_dir / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((model_dir / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
            files = {name: model_dir / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{model_dir / INDEX_FILE}: unreadable index ({type(exc).__name__}: {exc})") from None
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{model_dir / INDEX_FILE} names weight files that do not exist: {', '.join(missing[:3])}")
    elif (model_dir / SINGLE_FILE).is_file():
        files = {}
    else:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others[:3])}: convert them to safetensors)" if others else ""
        raise ValueError(f"{model_dir}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    if not files:
        files = {name: model_dir / SINGLE_FILE for name in safetensors_header(model_dir / SINGLE_FILE)}
    if SCORE not in files and (model_dir / VALUE_HEAD_FILE).is_file():
        files[SCORE] = model_dir / VALUE_HEAD_FILE
    return files


def model_tensor_problems(model_dir: Path, spec: ModelSpec, critic: bool) -> None:
    """ValueError naming the first missing tensor or shape mismatch between the weights and the
    config (a critic's score head may be absent: it is initialised)."""
    files = weight_files(model_dir)
    headers = {path: safetensors_header(path) for path in sorted(set(files.values()))}
    for param in param_specs(spec, critic):
        if param.name not in files:
            if critic and param.name == SCORE:
                continue
            raise ValueError(f"{model_dir}: tensor {param.name!r} missing from the weights "
                             f"(expected shape {list(param.shape)})")
        header = headers[files[param.name]]
        info = header.get(param.name) or (next(iter(header.values())) if files[param.name].name == VALUE_HEAD_FILE
                                          else None)
        if info is None:
            raise ValueError(f"{files[param.name]}: tensor {param.name!r} listed by the index but not in the file")
        if list(info["shape"]) != list(param.shape):
            raise ValueError(f"{files[param.name]}: tensor {param.name!r} has shape {info['shape']}, the config "
                             f"says {list(param.shape)}")


def check_model_dir(field: str, path: str | Path, spec: ModelSpec, critic: bool) -> None:
    """ConfigError naming `field` unless `path` holds weights matching `spec` (module docstring)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ConfigError(field, str(path), MODEL_DIR, problem="not a directory")
    try:
        model_tensor_problems(model_dir, spec, critic)
    except (OSError, ValueError) as exc:
        raise ConfigError(field, str(path), MODEL_DIR, problem=" ".join(str(exc).split())) from None


def check_tokenizer_dir(field: str, value: str) -> None:
    """ConfigError unless `value` is 'toy', a directory with tokenizer files, or a hub id
    (`org/name`, resolved from the local cache by transformers)."""
    if value == "toy":
        return
    path = Path(value).expanduser()
    allowed = "'toy' or an HF model directory holding tokenizer files (tokenizer.json, tokenizer_config.json, ...)"
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(field, value, allowed, problem="the directory holds no tokenizer files")
        return
    if path.exists():
        raise ConfigError(field, value, allowed, problem="names a file, not a directory")
    looks_like_path = value.startswith((".", "/", "~")) or value.count("/") != 1
    if looks_like_path:
        raise ConfigError(field, value, allowed, problem="no such directory")


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether `path` is a directory holding tokenizer files."""
    directory = Path(path).expanduser()
    return directory.is_dir() and any((directory / name).is_file() for name in TOKENIZER_FILES)


def model_tokenizer(source: ModelSource) -> str | None:
    """The tokenizer a model states: its `tokenizer` field, else its directory when that holds
    tokenizer files, else None (a preset, or a directory of weights only)."""
    if source.tokenizer is not None:
        return source.tokenizer
    if source.path is not None and has_tokenizer_files(source.path):
        return source.path
    return None


def reward_may_read_text(cfg: ExperimentConfig) -> bool:
    """Whether the reward calls may read text rather than the actor's ids: a reward model, not the
    actor's own, that states a tokenizer (`model_tokenizer`). Whether it does is known only once
    the two tokenizers are compared (app.run.tokenizer_check); until then its sequences are priced
    as text cut to its own length (build_problem's reward_token_ratio), so a reward model with
    fewer positions than the actor's sequences is not refused before that comparison."""
    if cfg.algorithm == "dpo" or reward_is_model_free(cfg):
        return False
    sources = role_sources(cfg)
    reward, actor = sources["reward"][1], sources["actor"][1]
    return reward != actor and model_tokenizer(reward) is not None


def check_out_path(field: str, value: str) -> Path:
    """An output file path whose directory exists (and which is not itself a directory)."""
    path = Path(value)
    if path.is_dir():
        raise ConfigError(field, value, "a file path (the output file)", problem="names a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(field, value, "a file in an existing directory", problem=f"directory {parent} does not exist")
    return path


__all__ = [
    "check_model_dir", "check_out_path", "check_tokenizer_dir", "has_tokenizer_files", "model_tensor_problems",
    "model_tokenizer", "reward_may_read_text", "safetensors_header", "weight_files",
]
