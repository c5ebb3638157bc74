"""HF checkpoint I/O: load safetensors slices into a (sharded / pipeline-sliced) Transformer,
gather shards back into a full state dict, and export a directory `transformers` loads unchanged.

Loading reads, on each rank, only what that rank holds: the names come from the module's own
state_dict (a pipeline stage asks only for its layers) and each tensor is read through
`safe_open(...).get_slice(name)[...]` restricted to this tp rank's slice along
`planning.models.tp_split_dim`. Single-file (`model.safetensors`) and sharded
(`model.safetensors.index.json`) checkpoints are both read.

Critic heads: `score.weight` [1, hidden] comes from an HF *ForSequenceClassification checkpoint,
else from a `value_head.safetensors` file in the checkpoint directory, else (a causal-LM
checkpoint loaded as a critic) it is initialised: zeros by default (the value estimate starts at
0 and the trunk gets no gradient from the head on the first step), or normal(0, 1/sqrt(hidden+1))
with a fixed seed (`score_init="normal"`, identical on every rank).
"""

from __future__ import annotations

import json
import math
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from planning.models import FAMILIES, ModelSpec, ParamSpec, param_specs, tp_split_dim, validate_tp

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VALUE_HEAD_FILE = "value_head.safetensors"
SCORE = "score.weight"
SCORE_INITS = ("zeros", "normal")
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


class CheckpointReader:
    """Lazy reader over the safetensors files of one checkpoint directory (plus value head)."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"checkpoint path {root}: not a directory")
        if (root / INDEX_FILE).exists():
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
            self.file_of = {name: root / file for name, file in weight_map.items()}
        elif (root / SINGLE_FILE).exists():
            with safe_open(root / SINGLE_FILE, framework="pt") as handle:
                self.file_of = {name: root / SINGLE_FILE for name in handle.keys()}
        else:
            raise ValueError(f"checkpoint path {root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._head_key = SCORE
        head_file = root / VALUE_HEAD_FILE
        if SCORE not in self.file_of and head_file.exists():
            with safe_open(head_file, framework="pt") as handle:
                keys = list(handle.keys())
            if SCORE not in keys and len(keys) != 1:
                raise ValueError(f"{head_file}: tensors {keys}; expected {SCORE!r} or exactly one tensor")
            self.file_of[SCORE] = head_file
            self._head_key = SCORE if SCORE in keys else keys[0]
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self.file_of

    def _slice(self, name: str):  # a safetensors PySafeSlice
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        key = self._head_key if file.name == VALUE_HEAD_FILE else name
        return self._handles[file].get_slice(key)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> Tensor:
        """The whole tensor, or rows/columns [start, stop) along `dim` (0 or 1) only."""
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


def check_hf_config(root: Path, spec: ModelSpec) -> None:
    """Raise ValueError naming the field when the checkpoint's config.json asks for something
    the model does not implement (other families, MLP biases, other activations, Qwen2's
    per-layer sliding window)."""
    config_path = root / "config.json"
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{config_path}: model_type={family!r} unsupported; allowed: {', '.join(FAMILIES)}")
    if family != spec.family:
        raise ValueError(f"{config_path}: model_type={family!r} but the spec's family is {spec.family!r}")
    # (field, value in the config, the one value we implement)
    checks = [("mlp_bias", config.get("mlp_bias", False), False),
              ("hidden_act", config.get("hidden_act", "silu"), "silu"),
              ("use_sliding_window", bool(config.get("use_sliding_window", False)) and family == "qwen2", False)]
    for field_name, value, allowed in checks:
        if value != allowed:
            raise ValueError(f"{config_path}: {field_name}={value!r} unsupported; allowed: {allowed!r}")


def _init_score(param: Tensor, how: str) -> None:
    if how == "zeros":
        param.zero_()
        return
    gen = torch.Generator().manual_seed(0)
    std = 1.0 / math.sqrt(param.shape[-1] + 1)
    param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=gen))


@torch.no_grad()
def load_hf_checkpoint(
    path: str | Path,
    spec: ModelSpec,
    critic: bool,
    module: nn.Module,
    tp_rank: int = 0,
    tp_size: int = 1,
    score_init: str = "zeros",
) -> list[str]:
    """Fill `module` (a materialised Transformer, possibly tp-sharded and/or a pipeline stage)
    from an HF checkpoint directory; return the names it initialised instead of reading.

    Each parameter's full shape is checked against planning.models.param_specs and its local
    shape against the tp shard; mismatches and missing tensors raise ValueError naming them.
    """
    if score_init not in SCORE_INITS:
        raise ValueError(f"score_init={score_init!r}: unknown; allowed: {', '.join(SCORE_INITS)}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank}: must be in [0, tp_size={tp_size})")
    validate_tp(spec, tp_size)
    root = Path(path)
    check_hf_config(root, spec)
    full_shapes = {p.name: p.shape for p in param_specs(spec, critic)}
    initialised: list[str] = []
    with CheckpointReader(root) as reader:
        for name, param in module.state_dict(keep_vars=True).items():
            if name not in full_shapes:
                raise ValueError(f"module tensor {name!r}: not a parameter of {spec.family} model {spec.name}")
            if param.is_meta:
                raise ValueError(f"module tensor {name!r} is on the meta device; "
                                 "call module.to_empty(device=...) first")
            if name == SCORE and not reader.has(SCORE):
                _init_score(param, score_init)
                initialised.append(name)
                continue
            param.copy_(_read_local(reader, name, full_shapes[name], tuple(param.shape), spec, tp_rank, tp_size))
    return initialised


def _read_local(
    reader: CheckpointReader, name: str, full_shape: tuple[int, ...], local_shape: tuple[int, ...],
    spec: ModelSpec, tp_rank: int, tp_size: int,
) -> Tensor:
    """This tp rank's slice of checkpoint tensor `name`, after checking both shapes."""
    if not reader.has(name):
        raise ValueError(f"checkpoint: tensor {name!r} missing (expected shape {list(full_shape)})")
    stored = reader.shape(name)
    if stored != full_shape:
        raise ValueError(f"checkpoint: tensor {name!r} has shape {list(stored)}, expected {list(full_shape)}")
    dim = tp_split_dim(name, spec, tp_size)
    expected_local = list(full_shape)
    if dim is not None:
        expected_local[dim] //= tp_size
    if list(local_shape) != expected_local:
        raise ValueError(f"module tensor {name!r} has local shape {list(local_shape)}, "
                         f"expected {expected_local} for tp_rank={tp_rank} of tp_size={tp_size}")
    if dim is None:
        return reader.read(name)
    width = expected_local[dim]
    return reader.read(name, dim, tp_rank * width, (tp_rank + 1) * width)


# ---- gathering shards ----------------------------------------------------------------------------


def gather_tp_shards(shards: list[dict[str, Tensor]], spec: ModelSpec, tp_size: int) -> dict[str, Tensor]:
    """Full tensors from the state dicts of tp ranks 0..tp_size-1 (same names on every rank):
    split tensors are concatenated along their tp_split_dim in rank order, replicated ones taken
    from rank 0."""
    if len(shards) != tp_size:
        raise ValueError(f"shards: {len(shards)} state dicts, expected one per tp rank (tp_size={tp_size})")
    full: dict[str, Tensor] = {}
    for name, tensor in shards[0].items():
        dim = tp_split_dim(name, spec, tp_size)
        if dim is None:
            full[name] = tensor
            continue
        missing = [rank for rank, shard in enumerate(shards) if name not in shard]
        if missing:
            raise ValueError(f"shards: tensor {name!r} missing on tp ranks {missing}")
        full[name] = torch.cat([shard[name] for shard in shards], dim=dim)
    return full


def merge_stage_states(stage_states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Union of the full state dicts of pipeline stages (a tied embedding held by the first and
    last stage is taken from the first)."""
    merged: dict[str, Tensor] = {}
    for state in stage_states:
        for name, tensor in state.items():
            merged.setdefault(name, tensor)
    return merged


# ---- export ---------------------------------------------------------------------------------------


def _ordered_tensors(full_state: dict[str, Tensor], specs: list[ParamSpec]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for p in specs:
        if p.name not in full_state:
            raise ValueError(f"full_state: tensor {p.name!r} missing (expected shape {list(p.shape)})")
        tensor = full_state[p.name]
        if tuple(tensor.shape) != p.shape:
            raise ValueError(f"full_state: tensor {p.name!r} has shape {list(tensor.shape)}, expected {list(p.shape)}")
        tensors[p.name] = tensor.detach().to("cpu").contiguous()
    return tensors


def _shard_groups(tensors: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Consecutive tensors grouped into files of at most max_shard_bytes (a larger tensor alone)."""
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def export_hf_checkpoint(
    full_state: dict[str, Tensor],
    spec: ModelSpec,
    critic: bool,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) that
    transformers' AutoModelForCausalLM (AutoModelForSequenceClassification for critics) loads.

    A tied actor's `lm_head.weight` is not written (transformers ties it to the embedding).
    `tokenizer_from`: a directory whose tokenizer files are copied alongside.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _ordered_tensors(full_state, param_specs(spec, critic))
    config = spec.to_hf_config(critic)
    dtypes = {t.dtype for t in tensors.values()}
    config["torch_dtype"] = str(next(iter(dtypes)) if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    groups = _shard_groups(tensors, max_shard_bytes)
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(groups) == 1:
        save_file(groups[0], out / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, out / file, metadata={"format": "pt"})
            weight_map.update({name: file for name in group})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_from) / name
            if source.exists():
                shutil.copy2(source, out / name)
    return out


__all__ = [
    "CheckpointReader", "DEFAULT_MAX_SHARD_BYTES", "check_hf_config", "INDEX_FILE", "SINGLE_FILE", "VALUE_HEAD_FILE",
    "export_hf_checkpoint", "gather_tp_shards", "load_hf_checkpoint", "merge_stage_states",
]
