"""Before Ray starts: every model that reads the actor's token ids, checked against the actor's tokenizer.

The actor's tokenizer is data.tokenizer: it encodes the prompts the actor reads and decodes what it
writes. A model's own tokenizer is `models.<role>.tokenizer`, else its directory's tokenizer files,
else none (a preset, or a directory of weights only: `app.config.model_tokenizer`). "The same"
tokenizer means the same fingerprint (every id the same token, the same special ids:
`app.data.tokenizer_info`).

  actor        a tokenizer of its own must be data.tokenizer, and its vocabulary must hold every
               id data.tokenizer produces (the toy tokenizer's 256 ids fit any preset).
  ref, critic  read the actor's ids as they are: the actor's tokenizer and a vocabulary holding its
               ids; without a tokenizer of their own, the actor's vocabulary size (a preset pair of
               one family). Otherwise the run stops here, naming both models.
  reward       a reward model with the actor's tokenizer (or none and the actor's vocabulary size)
               reads the ids as they are; with another tokenizer it reads the text
               (`app.data.RewardText`: decoded with the actor's tokenizer, rendered with its chat
               template, re-tokenized, cut to its maximum length), and the planner prices its
               calls at the measured ratio of its tokens to the actor's (plus the tokens its
               template adds to every sequence); with no tokenizer and
               another vocabulary the run stops naming models.reward, both vocabularies and what
               to give.
Every failure is one `ConfigError` (exit status 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config import (
    ConfigError,
    ExperimentConfig,
    ModelSource,
    build_problem,
    check_tokenizer_dir,
    model_tokenizer,
    reward_may_read_text,
    role_sources,
)
from app.data import REWARD_TEXT, PromptExample, RewardText, TokenizerInfo, tokenizer_info
from planning.cost import PlanningProblem
from planning.models import ModelSpec

RATIO_SAMPLE = 256  # prompts the reward-token ratio is measured on (the dataset's first ones)


@dataclass(frozen=True)
class RewardTextPlan:
    """A reward model that reads text: the reward call's params (`RolloutSettings.reward_text`)
    and its tokens per actor token (what `build_problem` prices the reward calls with)."""

    params: dict[str, Any]
    ratio: float
    extra_tokens: int


def describe(source: ModelSource) -> str:
    return f"preset {source.preset}" if source.preset is not None else str(source.path)


def _tokenizer_field(field: str, source: ModelSource) -> str:
    return f"{field}.tokenizer" if source.tokenizer is not None else f"{field}.path"


def _info(field: str, name: str) -> TokenizerInfo:
    """The tokenizer `name` (a config value of `field`) loaded and fingerprinted, or ConfigError."""
    try:
        return tokenizer_info(name)
    except ValueError as exc:
        raise ConfigError(field, name, "'toy' or an HF directory with tokenizer files",
                          problem=" ".join(str(exc).split())) from None


def check_tokenizers(cfg: ExperimentConfig, specs: dict[str, ModelSpec], worker_tokenizer: str,
                     examples: Sequence[Any], eos_token_id: int | None) -> RewardTextPlan | None:
    """Check every role in `specs` (the roles holding weights) as the module docstring says;
    returns the reward model's text bridge when it reads text, else None. Raises ConfigError.

    worker_tokenizer: data.tokenizer as the workers load it ('module:Class' or a directory);
    examples: the dataset (its first prompts measure the reward-token ratio)."""
    sources = role_sources(cfg)
    for role, (field, source) in sources.items():
        if role in specs and source.tokenizer is not None:
            check_tokenizer_dir(f"{field}.tokenizer", source.tokenizer)
    actor = _check_actor(cfg, sources["actor"], specs["actor"])
    plan = None
    for role in ("ref", "critic", "reward"):
        if role not in specs or sources[role][1] == sources["actor"][1]:
            continue  # not in this run, or the actor's own model and tokenizer
        own = _check_reader(cfg, role, sources[role], specs[role], sources["actor"], specs["actor"], actor)
        if own is not None:  # the reward model reads text: decoded, then its own tokens
            field, source = sources[role]
            plan = reward_text_plan(field, source, specs[role], own, worker_tokenizer, eos_token_id, examples)
    return plan


def priced_as_read(cfg: ExperimentConfig, problem: PlanningProblem, worker_tokenizer: str,
                   examples: Sequence[Any], eos_token_id: int | None) -> tuple[PlanningProblem, RewardTextPlan | None]:
    """`check_tokenizers` over the roles of `problem` (built by `build_problem(cfg)`, or with ratio
    1.0 where `reward_may_read_text`), then the problem as its reward calls read: re-tokenized
    text at the measured ratio, or the actor's ids (rebuilt, so the reward model's positions are
    checked against the actor's sequences). Returns the problem and the text bridge, if any."""
    specs = {role: problem.models[role].spec for role in problem.graph.model_roles}
    reward_text = check_tokenizers(cfg, specs, worker_tokenizer, examples, eos_token_id)
    if reward_text is not None:
        return build_problem(cfg, reward_text.ratio, reward_text.extra_tokens), reward_text
    return (build_problem(cfg) if reward_may_read_text(cfg) else problem), None


def _check_actor(cfg: ExperimentConfig, actor_role: tuple[str, ModelSource], spec: ModelSpec) -> TokenizerInfo:
    """data.tokenizer, fingerprinted: the actor's own tokenizer, if it has one, must be it, and
    the actor's vocabulary must hold its ids. Raises ConfigError."""
    actor = _info("data.tokenizer", cfg.data.tokenizer)
    actor_field, actor_source = actor_role
    own = model_tokenizer(actor_source)
    if own is not None:
        info = _info(_tokenizer_field(actor_field, actor_source), own)
        if not info.same_as(actor):
            raise ConfigError("data.tokenizer", cfg.data.tokenizer,
                              f"the tokenizer of {actor_field}: {info.source} (it encodes the prompts the actor reads)",
                              problem=f"{actor.describe()} is not the tokenizer {actor_field} "
                                      f"({describe(actor_source)}) states: {info.describe()}")
    if actor.n_ids > spec.vocab_size:
        raise ConfigError(actor_field, describe(actor_source),
                          f"an actor whose vocabulary holds the {actor.n_ids} ids of data.tokenizer "
                          f"({cfg.data.tokenizer})", problem=f"a vocabulary of {spec.vocab_size} ids")
    return actor


def _check_reader(cfg: ExperimentConfig, role: str, reader: tuple[str, ModelSource], spec: ModelSpec,
                  actor_role: tuple[str, ModelSource], actor_spec: ModelSpec,
                  actor: TokenizerInfo) -> TokenizerInfo | None:
    """Check a model `role` (ref, critic, reward) that reads the actor's ids against the actor
    (module docstring). Returns the reward model's own tokenizer when it reads text instead, else
    None. Raises ConfigError."""
    (field, source), (actor_field, actor_source) = reader, actor_role
    own, actor_vocab = model_tokenizer(source), actor_spec.vocab_size
    both = (f"{field} ({describe(source)}, vocabulary {spec.vocab_size}) reads the token ids of "
            f"{actor_field} ({describe(actor_source)}, vocabulary {actor_vocab}, tokenizer {actor.describe()})")
    if own is None:
        if spec.vocab_size == actor_vocab:
            return None  # no tokenizer of its own: the actor's, as for a preset pair of one family
        if role == "reward":
            raise ConfigError(
                field, describe(source),
                f"{field}.tokenizer naming the reward model's tokenizer (or tokenizer files in its directory): it "
                f"then reads the decoded text re-tokenized; or {field}.tokenizer={cfg.data.tokenizer} (data."
                "tokenizer) when it was trained on the actor's ids; or a reward model with the actor's vocabulary",
                problem=f"no tokenizer to re-tokenize with and a vocabulary of {spec.vocab_size} ids where the "
                        f"actor's has {actor_vocab}; {both}")
        raise ConfigError(field, describe(source),
                          f"a {role} with the actor's tokenizer and vocabulary (or {field}.tokenizer naming its "
                          "tokenizer, which must be the actor's)",
                          problem=f"no tokenizer of its own and another vocabulary: {both}")
    info = _info(_tokenizer_field(field, source), own)
    if info.same_as(actor):
        if actor.n_ids > spec.vocab_size:
            raise ConfigError(field, describe(source), f"a model whose vocabulary holds the {actor.n_ids} ids of "
                              f"its tokenizer", problem=f"a vocabulary of {spec.vocab_size} ids; {both}")
        return None
    if role != "reward":
        raise ConfigError(field, describe(source),
                          f"a {role} with the actor's tokenizer ({actor.describe()}): it reads the actor's token ids",
                          problem=f"its tokenizer {info.describe()} is not the actor's; {both}")
    return info


def reward_text_plan(field: str, source: ModelSource, spec: ModelSpec, info: TokenizerInfo, worker_tokenizer: str,
                     eos_token_id: int | None, examples: Sequence[Any]) -> RewardTextPlan:
    """The text bridge of a reward model with its own tokenizer; its token ratio measured on the
    dataset's first RATIO_SAMPLE prompts with the same class the workers use."""
    if info.n_ids > spec.vocab_size:
        raise ConfigError(field, describe(source), f"a reward model whose vocabulary holds the {info.n_ids} ids of its "
                          f"tokenizer ({info.source})", problem=f"a vocabulary of {spec.vocab_size} ids")
    if source.chat_template and not info.chat_template:
        raise ConfigError(f"{field}.chat_template", True, "false (prompt and response as plain text), or a reward "
                          "tokenizer with a chat template", problem=f"tokenizer {info.source} has no chat template")
    chat = info.chat_template if source.chat_template is None else source.chat_template
    limit = spec.max_position_embeddings
    max_length = min(source.max_length, limit) if source.max_length is not None else limit
    reward_tokenizer = str(Path(info.source).resolve()) if Path(info.source).is_dir() else info.source
    kwargs = {"actor_tokenizer": worker_tokenizer, "reward_tokenizer": reward_tokenizer, "chat_template": chat,
              "max_length": max_length, "eos_token_id": eos_token_id}
    prompts = [e for e in examples[:RATIO_SAMPLE] if isinstance(e, PromptExample)]
    try:
        bridge = RewardText(**kwargs)
        ratio, extra = (bridge.token_pricing([e.prompt for e in prompts], [e.prompt_ids for e in prompts])
                        if prompts else (1.0, 0))
    except ValueError as exc:
        raise ConfigError(_tokenizer_field(field, source), info.source, "a tokenizer that encodes the dataset's text",
                          problem=" ".join(str(exc).split())) from None
    return RewardTextPlan({"bridge": REWARD_TEXT, **kwargs}, ratio, extra)


__all__ = ["RATIO_SAMPLE", "RewardTextPlan", "check_tokenizers", "describe", "priced_as_read", "reward_text_plan"]
