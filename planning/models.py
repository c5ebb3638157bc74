"""Shapes of LLaMA-family models, their parameters and how each parameter is sharded.

`ModelSpec` is the one description of a model that planning, the engine and checkpoint I/O
share: built from a preset name or an HF `config.json`. `param_specs` lists every parameter by
its HF name; `tp_split_dim` says which dimension tensor parallelism splits (Megatron's rules);
`pipeline_partition` gives each pipeline stage its contiguous range of decoder blocks.
These three functions are the contract between the planner, the engine and the reallocator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes of a LLaMA-family decoder (Llama 2/3, Qwen2/2.5, Mistral)."""

    name: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # items of HF's rope_scaling dict
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` keys only

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r}: unsupported; allowed: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name}: {name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name}: n_heads={self.n_heads} not a multiple of n_kv_heads={self.n_kv_heads}")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def block_params(self) -> int:
        """Parameters of one decoder block."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.n_heads * d + 2 * h * self.n_kv_heads * d + self.n_heads * d * h
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * d
        return attn + 3 * h * self.intermediate_size + 2 * h

    def n_params(self, critic: bool = False) -> int:
        return sum(_numel(p.shape) for p in param_specs(self, critic))

    def to_hf_config(self, critic: bool = False) -> dict[str, Any]:
        """A transformers config dict (LlamaConfig / Qwen2Config / MistralConfig fields)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[self.family]
        if critic:
            arch = arch.replace("CausalLM", "SequenceClassification")
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family == "mistral":
            cfg["sliding_window"] = self.sliding_window
        if self.family == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        if critic:
            cfg["num_labels"] = 1
        return cfg

    @staticmethod
    def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
        """Build from an HF config dict, a config.json path or a checkpoint directory."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.exists():
                raise ValueError(f"model path {config}: no config.json found")
            name = name or path.parent.name
            config = json.loads(path.read_text())
        family = config.get("model_type", "")
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r}: unsupported; allowed: {', '.join(FAMILIES)}")
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # transformers>=5 writes `rope_parameters` (rope_theta + scaling keys) instead of
        # `rope_theta` + `rope_scaling`; accept both.
        rope_params = dict(config.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or rope_params
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        eos = config.get("eos_token_id")
        return ModelSpec(
            name=name or family,
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            sliding_window=config.get("sliding_window") if family == "mistral" else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_LLAMA3_SCALING = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                   ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))

MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-7b": ModelSpec("llama-7b", "llama", 32000, 4096, 11008, 32, 32, 32, 128),
    "llama-13b": ModelSpec("llama-13b", "llama", 32000, 5120, 13824, 40, 40, 40, 128),
    "llama-34b": ModelSpec("llama-34b", "llama", 32000, 8192, 22016, 48, 64, 8, 128, rope_theta=1e6, max_position_embeddings=16384),
    "llama-70b": ModelSpec("llama-70b", "llama", 32000, 8192, 28672, 80, 64, 8, 128),
    "llama3-8b": ModelSpec("llama3-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=5e5,
                           max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001),
    "llama3.2-1b": ModelSpec("llama3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, tie_embeddings=True,
                             rope_theta=5e5, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
                             bos_token_id=128000, eos_token_id=128001),
    "llama3.2-3b": ModelSpec("llama3.2-3b", "llama", 128256, 3072, 8192, 28, 24, 8, 128, tie_embeddings=True,
                             rope_theta=5e5, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
                             bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-0.5b": ModelSpec("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 64, tie_embeddings=True,
                              qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                              bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-1.5b": ModelSpec("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, tie_embeddings=True,
                              qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                              bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, qkv_bias=True,
                            rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                            bos_token_id=151643, eos_token_id=151643),
    # Tiny shapes for CPU tests and the embedded default run.
    "tiny": ModelSpec("tiny", "llama", 256, 64, 128, 4, 4, 2, 16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2),
    "tiny-critic": ModelSpec("tiny-critic", "llama", 256, 32, 64, 2, 4, 2, 8, max_position_embeddings=512,
                             bos_token_id=1, eos_token_id=2),
}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"preset {name!r}: unknown; allowed: {', '.join(MODEL_PRESETS)}") from None


# ---- parameters ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of the full (unsharded) model.

    layer: decoder block index, or -1 for the embedding, n_layers for final norm and head.
    """

    name: str
    shape: tuple[int, ...]
    layer: int


def param_specs(spec: ModelSpec, critic: bool = False) -> list[ParamSpec]:
    """Every parameter of the model by HF name, in HF order. Critics end in a (1, hidden) `score`.

    With tied embeddings the actor has no `lm_head.weight`: the head reuses the embedding.
    """
    h, d, L = spec.hidden_size, spec.head_dim, spec.n_layers
    out = [ParamSpec("model.embed_tokens.weight", (spec.vocab_size, h), -1)]
    for i in range(L):
        p = f"model.layers.{i}."
        out.append(ParamSpec(p + "input_layernorm.weight", (h,), i))
        out.append(ParamSpec(p + "self_attn.q_proj.weight", (spec.n_heads * d, h), i))
        out.append(ParamSpec(p + "self_attn.k_proj.weight", (spec.n_kv_heads * d, h), i))
        out.append(ParamSpec(p + "self_attn.v_proj.weight", (spec.n_kv_heads * d, h), i))
        if spec.qkv_bias:
            out.append(ParamSpec(p + "self_attn.q_proj.bias", (spec.n_heads * d,), i))
            out.append(ParamSpec(p + "self_attn.k_proj.bias", (spec.n_kv_heads * d,), i))
            out.append(ParamSpec(p + "self_attn.v_proj.bias", (spec.n_kv_heads * d,), i))
        out.append(ParamSpec(p + "self_attn.o_proj.weight", (h, spec.n_heads * d), i))
        out.append(ParamSpec(p + "post_attention_layernorm.weight", (h,), i))
        out.append(ParamSpec(p + "mlp.gate_proj.weight", (spec.intermediate_size, h), i))
        out.append(ParamSpec(p + "mlp.up_proj.weight", (spec.intermediate_size, h), i))
        out.append(ParamSpec(p + "mlp.down_proj.weight", (h, spec.intermediate_size), i))
    out.append(ParamSpec("model.norm.weight", (h,), L))
    if critic:
        out.append(ParamSpec("score.weight", (1, h), L))
    elif not spec.tie_embeddings:
        out.append(ParamSpec("lm_head.weight", (spec.vocab_size, h), L))
    return out


def kv_replicated(spec: ModelSpec, tp: int) -> bool:
    """K/V projections are replicated (not split) when tp does not divide the KV heads."""
    return spec.n_kv_heads % tp != 0


def validate_tp(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError naming the field when `tp` cannot shard this model."""
    checks = [("n_heads", spec.n_heads), ("intermediate_size", spec.intermediate_size), ("vocab_size", spec.vocab_size)]
    for field_name, value in checks:
        if value % tp:
            raise ValueError(f"model {spec.name}: tp={tp} does not divide {field_name}={value}")


_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
           "gate_proj.weight", "up_proj.weight")
_ROW = ("o_proj.weight", "down_proj.weight")


def tp_split_dim(name: str, spec: ModelSpec, tp: int) -> int | None:
    """Dimension tensor parallelism splits `name` along, or None when every tp rank holds it whole.

    Column-parallel (q/k/v/gate/up, and q/k/v biases) and vocab-parallel (embedding, lm_head)
    split dim 0; row-parallel (o_proj, down_proj) split dim 1; norms and the critic head are
    replicated; K/V are replicated when tp does not divide the KV heads.
    """
    if tp == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    if name.endswith(_COLUMN):
        if ("k_proj" in name or "v_proj" in name) and kv_replicated(spec, tp):
            return None
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def pipeline_partition(spec: ModelSpec, pp: int, critic: bool = False) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges per stage, balanced by parameter count.

    Stage 0 also holds the embedding and the last stage the final norm and head, so their
    parameters weigh on those stages. Every stage gets at least one block. Deterministic:
    the same (spec, pp) gives the same partition on every rank.
    """
    L = spec.n_layers
    if not 1 <= pp <= L:
        raise ValueError(f"model {spec.name}: pp={pp} must be between 1 and n_layers={L}")
    weights = [spec.block_params] * L
    emb = spec.vocab_size * spec.hidden_size
    weights[0] += emb
    head = spec.hidden_size if critic else (0 if spec.tie_embeddings else emb)
    weights[-1] += head + spec.hidden_size
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: minimal max-stage weight splitting blocks [0, i) into k stages; cut[k][i] its last cut.
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(pp + 1)]
    cut = [[0] * (L + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, L - (pp - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], L
    for k in range(pp, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def stages_holding(
    param: ParamSpec, spec: ModelSpec, partition: list[tuple[int, int]], critic: bool = False
) -> list[int]:
    """Pipeline stages that hold `param`. An actor's tied embedding is held by the first and the
    last stage (the last uses it as its head; the two copies are kept in sync)."""
    last = len(partition) - 1
    if param.layer == -1:
        if spec.tie_embeddings and not critic and last > 0:
            return [0, last]
        return [0]
    if param.layer >= spec.n_layers:
        return [last]
    for stage, (start, end) in enumerate(partition):
        if start <= param.layer < end:
            return [stage]
    raise AssertionError(f"layer {param.layer} not in partition {partition}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = [
    "FAMILIES", "MODEL_PRESETS", "ModelSpec", "ParamSpec", "kv_replicated", "model_preset", "param_specs",
    "pipeline_partition", "stages_holding", "tp_split_dim", "validate_tp",
]
