"""The experiment config: a pydantic schema loaded from YAML plus dotted command-line overrides.

`load_config` reads a YAML file, applies `key.path=value` overrides (values parsed as YAML
scalars, so `plan.seconds=1` is an int and `cluster.virtual_gpus=true` a bool) and validates
with `extra="forbid"` everywhere. app.config.problem turns a config into the planner's inputs.

Every bad input, whether caught by pydantic or by the semantic checks here, surfaces as one
`ConfigError` (app.config.errors) whose message names the dotted field, the value and what is
allowed. The algorithm checks (app.config.checks) sit below this module: they read the config
through a structural type and never import it.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from app.config.checks import check_training_fields
from app.config.errors import ConfigError
from app.config.files import load_yaml, read_utf8
from app.config.sections import (
    CheckpointConfig,
    DAPOConfig,
    DataConfig,
    DPOConfig,
    GRPOConfig,
    GSPOConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TrackingConfig,
)
from planning.hardware import HARDWARE_PRESETS
from planning.layout import Layout
from planning.models import MODEL_PRESETS

MAX_PLAN_SECONDS = 3600.0  # a search budget beyond an hour is a typo (1e9 ran until killed)
MAX_TIMEOUT_S = 86400.0


# ---- schema --------------------------------------------------------------------------------------


class _Section(BaseModel):
    # coerce_numbers_to_str: an override like run.name=2024 parses as a YAML int but names a string field.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


class ModelSource(_Section):
    """Where a model's shapes come from: a named preset or an HF checkpoint directory, and the
    tokenizer it reads.

    tokenizer: 'toy' or an HF directory with tokenizer files; null: the tokenizer files of `path`
    (a preset, or a directory without them, has none of its own: it reads the actor's ids only
    when its vocabulary is the actor's). Every model that reads the actor's token ids is checked
    against the actor's tokenizer before Ray starts (app.run.tokenizer_check); a reward model with
    another tokenizer reads the decoded text instead, rendered with its chat template
    (chat_template: true, false, or null = when its tokenizer has one) and cut to its last
    max_length tokens (null: the model's max positions). chat_template and max_length are
    models.reward's only.
    """

    preset: str | None = None
    path: str | None = None
    tokenizer: str | None = None
    chat_template: bool | None = None
    max_length: int | None = Field(None, ge=2)

    @model_serializer(mode="wrap")
    def _without_unset_tokenizer_fields(self, handler: Any) -> dict[str, Any]:
        # Dumped as before these fields existed when they are unset: a checkpoint's config
        # fingerprint (app.run.resume) and plan.json stay comparable with older runs.
        out = handler(self)
        for name in ("tokenizer", "chat_template", "max_length"):
            if out.get(name) is None:
                out.pop(name, None)
        return out

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        # The ValueError text is the "allowed" part of the ConfigError (see _from_validation).
        if value is not None and value not in MODEL_PRESETS:
            raise ValueError(f"one of {', '.join(MODEL_PRESETS)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if (self.preset is None) == (self.path is None):
            raise ValueError("exactly one of 'preset' or 'path'")
        return self


class ModelsConfig(_Section):
    """One model per role. ref defaults to actor; reward defaults to critic, else to actor. A
    reward model given where no call loads one (a rule reward, rollout.env, DPO) is refused."""

    actor: ModelSource
    critic: ModelSource | None = None
    ref: ModelSource | None = None
    reward: ModelSource | None = None


class BatchConfig(_Section):
    """prompts per iteration, token lengths, PPO minibatches/epochs and the GRPO group size."""

    prompts: int = Field(512, ge=1)
    prompt_len: int = Field(128, ge=1)
    gen_len: int = Field(384, ge=1)
    ppo_minibatches: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    group_size: int = Field(8, ge=1)


class ClusterConfig(_Section):
    """nodes x gpus_per_node GPUs of one hardware preset; virtual_gpus runs them on CPU.
    dashboard: start the Ray dashboard (127.0.0.1) with a local instance.
    gpu_memory_gib / host_memory_gib: the memory per GPU, and the host RAM per GPU, the planner
    may use instead of the preset's (GPUs shared with other work, a smaller host, or virtual
    GPUs given a size); a measured profile's values apply first, these last."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    gpu: str = "h100-80g"
    virtual_gpus: bool = False
    dashboard: bool = True
    gpu_memory_gib: float | None = Field(None, gt=0.0)
    host_memory_gib: float | None = Field(None, gt=0.0)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value not in HARDWARE_PRESETS:
            raise ValueError(f"one of {', '.join(HARDWARE_PRESETS)}")
        return value


class ManualPlacement(_Section):
    """A call's placement written by hand: mesh like 'n0:g0-3', layout like 'dp2tp2pp1'; and,
    optionally, how it runs: micro_batch_tokens (inference and train calls: tokens per
    micro-batch of each dp share) or gen_rounds (generate calls). Unset: the cost model picks."""

    mesh: str
    layout: str
    micro_batch_tokens: int | None = Field(None, ge=1)
    gen_rounds: int | None = Field(None, ge=1)

    @field_validator("layout")
    @classmethod
    def _parsable_layout(cls, value: str) -> str:
        try:
            Layout.parse(value)
        except ValueError:
            raise ValueError("a layout like 'dp2tp2pp1' or 'tp2,pp1'") from None
        return value


class PlanConfig(_Section):
    """How to choose the plan: MCMC search, exhaustive, the heuristic, or `manual` placements.

    memory_margin: fraction of each GPU's memory a plan must leave free (the search keeps it; a
    manual plan that does not is refused before any call, and a call whose measured peak exceeds
    its estimate by more than this fraction is a warning). recalibrate_after: after this many
    iterations, fit the cost model to the run's own call times and memory and search again from
    the current plan (None: never); the run switches when the new plan is estimated at least
    switch_gain (a fraction) faster, moving every model between two iterations.
    optimizer_offload: None lets the planner keep part of a trained model's optimizer state in
    host memory when no plan fits without (the least that makes one fit); {role: fraction} fixes
    it per trained role instead (0: never, 1: all of it; roles not named: 0).
    """

    mode: Literal["search", "exhaustive", "heuristic", "manual"] = "search"
    seconds: float = Field(60.0, gt=0, le=MAX_PLAN_SECONDS)
    seed: int = 0
    profile: str | None = None
    manual: dict[str, ManualPlacement] | None = None
    memory_margin: float = Field(0.1, ge=0.0, lt=1.0)
    recalibrate_after: int | None = Field(None, ge=1)
    switch_gain: float = Field(0.05, ge=0.0, lt=1.0)
    optimizer_offload: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] | None = None


class RunConfig(_Section):
    """Name of the run, its directory (None: runs/<name>-<time>), training length and timeouts.

    call_timeout_s: a call that makes no progress for this long is a stall (the driver names
    the rank that stopped, then restarts the workers); collective_timeout_s: the
    torch.distributed timeout of every process group, so a collective waiting on a dead peer
    raises in the worker. resume: "auto" continues the run in run.dir from its latest complete
    checkpoint (a fresh start when there is none), or a checkpoint directory to continue from;
    None starts a new run (in a directory that holds none). max_restarts: how often a dead or
    stalled worker is recovered from (restart all workers, resume from the last complete
    checkpoint) before the run fails. on_nonfinite: "stop" ends the run at a NaN/inf reward,
    loss or gradient norm, naming it; "skip" skips that update and counts it
    (<role>/skipped_updates).
    max_staleness: k; generation of iteration i + k + 1 starts from the weights after training
    iteration i (0: on-policy), so generation may run beside training (app.run.staleness).
    """

    name: str = "realray"
    dir: str | None = None
    iterations: int = Field(40, ge=1)
    seed: int = 0
    call_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    collective_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    resume: str | None = None
    max_restarts: int = Field(3, ge=0)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_staleness: int = Field(0, ge=0)


class ExperimentConfig(_Section):
    """A whole experiment: the planning sections, then the ones only training reads (app.config.sections)."""

    algorithm: Literal["ppo", "grpo", "dpo", "remax", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo",
                       "gspo"] = "ppo"
    models: ModelsConfig
    batch: BatchConfig = BatchConfig()
    cluster: ClusterConfig = ClusterConfig()
    plan: PlanConfig = PlanConfig()
    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    sampling: SamplingConfig = SamplingConfig()
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    dapo: DAPOConfig = DAPOConfig()
    gspo: GSPOConfig = GSPOConfig()
    dpo: DPOConfig = DPOConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


# ---- loading -------------------------------------------------------------------------------------


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read YAML at `path`, apply `key.path=value` overrides, validate. Raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "an existing YAML file", problem="no such file")
    try:
        raw = load_yaml(read_utf8(path))  # duplicate keys and non-UTF-8 bytes name their line
    except ValueError as exc:
        raise ConfigError("config", str(path), "a UTF-8 YAML file", problem=str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("config", str(path), "valid YAML", problem=f"{where}{problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config", str(path), "a YAML mapping of sections (algorithm, models, ...)",
                          problem=f"holds a {type(raw).__name__}")
    for override in overrides or []:
        apply_override(raw, override)
    return validate_config(raw)


def validate_config(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate a plain dict (e.g. parsed YAML) into an ExperimentConfig. Raises ConfigError."""
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    _check_cross_fields(cfg)
    return cfg


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `raw[a][b][c] = yaml_scalar(value)` for the override 'a.b.c=value', in place."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError("override", override, "key.path=value, e.g. plan.seconds=5")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # not YAML: keep the plain string and let the schema judge it
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            dotted = ".".join(parts[: depth + 1])
            raise ConfigError(dotted, child, f"a section holding {key.strip()}", problem="not a section")
        node = child
    node[parts[-1]] = value


def _from_validation(exc: ValidationError) -> ConfigError:
    """The first pydantic error as a ConfigError naming the dotted field and what is allowed."""
    # An unknown key explains the other errors of its section (often a misspelt field), so it goes first.
    err = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = tuple(str(part) for part in err["loc"])
    field = ".".join(loc) or "config"
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1])
        return ConfigError(field, err["input"], f"the fields {', '.join(known)}", problem="unknown field")
    if kind == "missing":
        return ConfigError(field, None, "a value", problem="required field missing")
    if kind == "value_error":
        # Our validators raise ValueError(<what is allowed>); pydantic keeps it in ctx["error"].
        return ConfigError(field, err["input"], str(err["ctx"]["error"]))
    return ConfigError(field, err["input"], err["msg"].removeprefix("Input should be "))


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """Field names of the section at `loc` (walking dict[str, Section] values by key)."""
    target: Any = ExperimentConfig
    expect_key = False
    for part in loc:
        if expect_key:
            expect_key = False
            continue
        if not (isinstance(target, type) and issubclass(target, BaseModel)) or part not in target.model_fields:
            return []
        target, expect_key = _section_type(target.model_fields[part].annotation)
    return list(target.model_fields) if isinstance(target, type) and issubclass(target, BaseModel) else []


def _section_type(annotation: Any) -> tuple[Any, bool]:
    """(section class, whether it sits behind dict keys) of a field annotation like `X | None`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                return _section_type(arg)
    if origin is dict:
        return typing.get_args(annotation)[1], True
    return annotation, False


def _check_reward_model_used(cfg: ExperimentConfig) -> None:
    """A models.reward that no call would load is refused: with a rule reward (reward.function,
    on by default), the environments' rewards or DPO, the run would score without it and say
    nothing."""
    source = cfg.models.reward
    if source is None:
        return
    value = source.preset if source.preset is not None else source.path
    if cfg.algorithm == "dpo":
        raise ConfigError("models.reward", value, "unset for dpo, which has no reward call")
    if cfg.rollout.env is not None:
        raise ConfigError("models.reward", value, f"unset: the environments of rollout.env={cfg.rollout.env!r} "
                          "score the trajectories")
    if cfg.reward.function is not None:
        raise ConfigError("models.reward", value, "reward.function: null (to score with this reward model), or "
                          "no models.reward", problem=f"reward.function={cfg.reward.function!r} (a rule, the "
                          "default) scores the responses, so no reward model would load")


def _check_cross_fields(cfg: ExperimentConfig) -> None:
    """Checks that involve more than one field."""
    if cfg.plan.mode == "manual" and not cfg.plan.manual:
        raise ConfigError("plan.manual", cfg.plan.manual, "placements for every call when plan.mode is 'manual'")
    if cfg.plan.profile is not None and not Path(cfg.plan.profile).is_file():
        raise ConfigError("plan.profile", cfg.plan.profile, "an existing profile JSON file (python -m app profile)")
    for role in ("actor", "critic", "ref"):  # what only a reward model reading text uses
        source = getattr(cfg.models, role)
        for name in ("chat_template", "max_length"):
            if source is not None and getattr(source, name) is not None:
                raise ConfigError(f"models.{role}.{name}", getattr(source, name),
                                  f"unset: only models.reward reads {name} (when its tokenizer is not the actor's)")
    _check_reward_model_used(cfg)
    gpu = cfg.cluster.gpu
    if cfg.sampling.fp8 and not (HARDWARE_PRESETS[gpu].fp8_matmul or gpu == "cpu" or cfg.cluster.virtual_gpus):
        with_fp8 = ", ".join(name for name, spec in HARDWARE_PRESETS.items() if spec.fp8_matmul)
        raise ConfigError("sampling.fp8", True, f"false, or a cluster.gpu with FP8 matmuls: {with_fp8}",
                          f"cluster.gpu={gpu!r} has no FP8 matmuls (they need compute capability >= 8.9)")
    check_training_fields(cfg)  # the algorithm sections: app.config.checks
