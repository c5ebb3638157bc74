"""Setting up a training run: checks before any worker starts, then Ray, plan, workers, models.

`preflight(cfg)` needs no Ray: it builds the planning problem (cluster too small for the models
fails here), resolves the reward function, reads and tokenises the dataset (a row without the
prompt field fails naming the file and line; for DPO, preference pairs with prompt, chosen and
rejected fields), checks there are enough prompts (pairs) for a batch, that every model
directory holds weights matching its config (app.config.preflight) and that every model reading
the actor's token ids shares its tokenizer, or for a reward model reads the text through its own
(app.run.tokenizer_check).
Every failure is one `ConfigError`.

The rest runs in this order on the driver (see app.run.driver):
`search_plan_now` (the plan, before Ray: a config without a feasible plan fails here),
`connect_cluster` (local Ray with virtual GPUs, or `RAY_ADDRESS`; picks the planner's nodes of
the Ray cluster or names what it lacks, app.run.cluster_check), `start_workers` + `init_world` (one
`ModelWorker` per GPU, torch.distributed rendezvous with a timeout), `setup_groups` (every
process group the plan will use: each placement's layout groups and each reallocation's
broadcast groups, created once, in one order, on every rank) and `load_models` (trained roles
on their train placement, frozen roles on their first call's placement).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from actors.worker import CONCURRENCY_GROUPS
from app.algorithms import (
    MULTI_TURN_ALGORITHMS,
    RUNTIME_ALGORITHMS,
    AlgorithmSettings,
    settings_from_config,
    toy_preference_records,
)
from app.config import (
    ConfigError,
    ExperimentConfig,
    build_problem,
    check_model_dir,
    check_tokenizer_dir,
    manual_plan,
    model_spec,
    reward_may_read_text,
    role_sources,
    rule_reward_priced,
    search_error,
)
from app.data import (
    PreferenceExample,
    PromptExample,
    RewardLoadError,
    build_prompt_dataset,
    load_preference_records,
    load_reward_fn,
    load_tokenizer,
    rule_reward_s_per_token,
    tokenize_preferences,
)
from app.run.cluster_check import check_local_start, planner_nodes
from app.run.schedule import home_placements, realloc_member_sets
from app.run.tokenizer_check import priced_as_read
from cluster.collective import list_process_groups
from cluster.placement import WorkerGroup, create_workers
from cluster.resources import RayClusterInfo, RayStartOptions, connect
from planning.cost import PlanningProblem
from planning.models import ModelSpec
from planning.plan import ExecutionPlan, Placement
from planning.planner_service import PlannerService
from planning.realloc_plan import plan_reallocation
from planning.search import SearchResult

TOY_TOKENIZER = "app.data.toy_task:CharTokenizer"


@dataclass(frozen=True)
class RoleModel:
    """One role's model: its shapes, where its weights come from, and whether it is trained."""

    role: str
    spec: ModelSpec
    critic: bool
    hf_dir: str | None
    trainable: bool


@dataclass(frozen=True)
class TrainInputs:
    """Everything checked before Ray starts."""

    cfg: ExperimentConfig
    problem: PlanningProblem
    manual: ExecutionPlan | None
    models: dict[str, RoleModel]  # roles that hold weights (a rule-based reward holds none)
    examples: list[PromptExample] | list[PreferenceExample]  # preference pairs for DPO
    tokenizer_spec: str  # what workers load to decode: 'module:Class' or an HF directory
    reward_fn: str | None  # 'module:function' of a rule-based reward, None for a reward model
    eos_token_id: int
    pad_token_id: int
    settings: AlgorithmSettings  # what app.algorithms.call_params turns into each call's params


def preflight(cfg: ExperimentConfig) -> TrainInputs:
    """Check the config against files, imports and sizes; no Ray, no workers. Raises ConfigError."""
    if cfg.algorithm not in RUNTIME_ALGORITHMS:
        raise ConfigError("algorithm", cfg.algorithm, ", ".join(RUNTIME_ALGORITHMS) + " (the algorithms `train` runs)",
                          problem="not supported by train yet")
    # Cluster too small for the models: ConfigError("cluster", ...). A reward model that may read
    # text is cut to its own length until the tokenizers are compared (priced_as_read).
    problem = build_problem(cfg, 1.0 if reward_may_read_text(cfg) else None)
    manual_plan(cfg, problem)  # a bad plan.manual named before the files are read
    dpo, multi_turn = cfg.algorithm == "dpo", cfg.rollout.env is not None
    tokenizer = _load_tokenizer(cfg)
    if multi_turn:  # the environments score the trajectories: no reward function, no reward model
        cfg = _check_env(cfg, tokenizer)
    reward_fn = None if dpo or multi_turn else _check_reward(cfg)  # DPO has no reward call
    examples = _load_preferences(cfg, tokenizer) if dpo else _load_dataset(cfg, tokenizer, needs_answer=False)
    tokenizer_spec = TOY_TOKENIZER if cfg.data.tokenizer == "toy" else cfg.data.tokenizer
    eos, pad = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
    try:
        # Workers decode responses only for a rule-based reward (a reward model reads token ids),
        # so a data tokenizer smaller than the model's vocabulary (the toy one) stays usable.
        settings = settings_from_config(cfg, tokenizer_spec if reward_fn or multi_turn else None, reward_fn, eos, pad)
    except ValueError as exc:  # the message names the field (e.g. ppo.kl_estimator)
        raise ConfigError("config", cfg.algorithm, "values the algorithm accepts", problem=str(exc)) from None
    models = role_models(cfg, problem)
    sources = role_sources(cfg)
    for role, model in models.items():  # weights present, headers readable, names and shapes as configured
        if model.hf_dir is not None:
            check_model_dir(f"{sources[role][0]}.path", model.hf_dir, model.spec, model.critic)
    # Every model reading the actor's ids against its tokenizer; a reward model with another one reads text.
    problem, reward_text = priced_as_read(cfg, problem, tokenizer_spec, examples, eos)
    if reward_text is not None:  # priced at its own token counts, run through the text bridge
        settings = replace(settings, rollout=replace(settings.rollout, reward_text=reward_text.params))
    # A rule reward's rows decode faster through a byte-level tokenizer's byte table.
    if reward_fn is not None and (rate := rule_reward_s_per_token(tokenizer)) is not None:
        problem = rule_reward_priced(problem, rate)
    return TrainInputs(
        cfg=cfg, problem=problem, manual=manual_plan(cfg, problem), models=models,
        examples=examples, tokenizer_spec=tokenizer_spec, reward_fn=reward_fn, eos_token_id=eos, pad_token_id=pad,
        settings=settings,
    )


def reward_model_priced(cfg: ExperimentConfig, problem: PlanningProblem, tokenizer: Any) -> PlanningProblem:
    """`problem` (built with `reward_may_read_text`'s ratio) with the reward model's calls priced as
    preflight prices them, for `python -m app plan`: the tokenizers compared (`priced_as_read`),
    the token ratio measured on data.path's prompts where that file is on this machine, else 1.0.
    `tokenizer`: data.tokenizer, loaded. Raises ConfigError where train would."""
    data_here = cfg.data.path == "toy" or Path(cfg.data.path).is_file()
    examples = _load_dataset(cfg, tokenizer, needs_answer=False) if data_here else []
    worker_tokenizer = TOY_TOKENIZER if cfg.data.tokenizer == "toy" else cfg.data.tokenizer
    return priced_as_read(cfg, problem, worker_tokenizer, examples, int(tokenizer.eos_token_id))[0]


def role_models(cfg: ExperimentConfig, problem: PlanningProblem) -> dict[str, RoleModel]:
    """The roles that hold weights, in graph order; a model-free reward (a rule, or the
    environments' rewards: `reward_is_model_free`) leaves the reward role out."""
    sources = role_sources(cfg)
    trained = set(problem.graph.trained_roles)
    out = {}
    for role in problem.graph.model_roles:
        field, source = sources[role]
        out[role] = RoleModel(role, model_spec(field, source), role in ("critic", "reward"), source.path,
                              role in trained)
    return out


def _check_reward(cfg: ExperimentConfig) -> str | None:
    if cfg.reward.function is None:
        return None
    try:
        return load_reward_fn(cfg.reward.function).spec
    except RewardLoadError as exc:
        raise ConfigError("reward.function", cfg.reward.function,
                          "'module:function' or 'path/to/file.py:function' naming a callable, "
                          "e.g. app.data.rewards:toy_reward", problem=str(exc)) from None


def _check_env(cfg: ExperimentConfig, tokenizer: Any) -> ExperimentConfig:
    """Multi-turn rollouts: an algorithm that has them, an environment that loads and constructs
    with rollout.env_kwargs, and a chat template that keeps earlier turns as they were. Returns the
    config with the environment named as the workers load it (a file path made absolute)."""
    from app.envs import EnvLoadError, check_env, check_prefix_preserving

    r = cfg.rollout
    if cfg.algorithm not in MULTI_TURN_ALGORITHMS:
        raise ConfigError("rollout.env", r.env, f"null with algorithm {cfg.algorithm!r}; multi-turn rollouts run "
                          f"with {', '.join(MULTI_TURN_ALGORITHMS)}", problem="not supported by this algorithm")
    try:
        factory = check_env(str(r.env), dict(r.env_kwargs))
    except EnvLoadError as exc:
        raise ConfigError("rollout.env", r.env, "'module:Class' or 'path/to/file.py:Class' naming a class with "
                          "reset(sample) and step(action_text), constructible with rollout.env_kwargs",
                          problem=str(exc)) from None
    if cfg.data.chat_template:
        try:
            check_prefix_preserving(tokenizer, r.observation_role)
        except ValueError as exc:
            raise ConfigError("data.chat_template", True, "a chat template that renders earlier turns unchanged when "
                              "a turn is added (or data.chat_template: false)", problem=str(exc)) from None
    return cfg.model_copy(update={"rollout": r.model_copy(update={"env": factory.spec})})


def _load_tokenizer(cfg: ExperimentConfig) -> Any:
    check_tokenizer_dir("data.tokenizer", cfg.data.tokenizer)
    try:
        return load_tokenizer(cfg.data.tokenizer)
    except ValueError as exc:
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, "'toy' or an HF model directory with tokenizer files",
                          problem=str(exc)) from None


def _load_dataset(cfg: ExperimentConfig, tokenizer: Any, needs_answer: bool) -> list[PromptExample]:
    d = cfg.data
    if d.path != "toy" and not Path(d.path).is_file():
        raise ConfigError("data.path", d.path, "'toy' or an existing JSONL / Parquet file", problem="no such file")
    try:
        examples = build_prompt_dataset(
            d.path, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key, require_answer=needs_answer,
            chat_template=d.chat_template, max_prompt_len=d.max_prompt_len or cfg.batch.prompt_len,
            too_long=d.too_long, toy_size=d.toy_size, toy_seed=d.seed,
        )
    except ValueError as exc:  # the message names the file and the line
        raise ConfigError("data.path", d.path, f"rows with a string field {d.prompt_key!r} (data.prompt_key)",
                          problem=" ".join(str(exc).split())) from None
    if len(examples) < cfg.batch.prompts:
        raise ConfigError("batch.prompts", cfg.batch.prompts,
                          f"at most the {len(examples)} usable prompts of data.path={d.path!r}")
    return examples


def _load_preferences(cfg: ExperimentConfig, tokenizer: Any) -> list[PreferenceExample]:
    """DPO pairs of data.path ("toy": the built-in toy pairs), each prompt + answer within
    batch.prompt_len + batch.gen_len tokens. A bad row fails naming the file and the line."""
    d, keys = cfg.data, (cfg.data.prompt_key, cfg.dpo.chosen_key, cfg.dpo.rejected_key)
    if d.path != "toy" and not Path(d.path).is_file():
        raise ConfigError("data.path", d.path, "'toy' or an existing JSONL / Parquet file of preference pairs",
                          problem="no such file")
    try:
        records = (toy_preference_records(d.toy_size, d.seed) if d.path == "toy"
                   else load_preference_records(d.path, *keys))
        examples = tokenize_preferences(records, tokenizer, d.chat_template,
                                        max_len=cfg.batch.prompt_len + cfg.batch.gen_len)
    except ValueError as exc:  # the message names the file and the line
        raise ConfigError("data.path", d.path, "rows with string fields {!r}, {!r} and {!r} (data.prompt_key, "
                          "dpo.chosen_key, dpo.rejected_key)".format(*keys),
                          problem=" ".join(str(exc).split())) from None
    if len(examples) < cfg.batch.prompts:
        raise ConfigError("batch.prompts", cfg.batch.prompts,
                          f"at most the {len(examples)} usable preference pairs of data.path={d.path!r}")
    return examples


# ---- Ray ------------------------------------------------------------------------------------------


def connect_cluster(cfg: ExperimentConfig) -> RayClusterInfo:
    """Connect to RAY_ADDRESS or start a local Ray (virtual GPUs on CPU); returns it narrowed to
    the planner's nodes (ConfigError naming what the Ray cluster lacks)."""
    c = cfg.cluster
    check_local_start(cfg)
    options = RayStartOptions(virtual_gpus=c.nodes * c.gpus_per_node if c.virtual_gpus else 0, hardware=c.gpu,
                              include_dashboard=c.dashboard)
    return planner_nodes(cfg, connect(options))


def join_virtual_cluster(virtual: bool) -> None:
    """With virtual GPUs and RAY_ADDRESS set (e.g. `ray start --head --num-gpus 4` on a machine
    without GPUs, then `ray job submit`), join that cluster here (`connect` would join it too)."""
    address = os.environ.get("RAY_ADDRESS")
    if virtual and address and not ray.is_initialized():
        ray.init(address=address)


def search_plan_now(inputs: TrainInputs) -> SearchResult:
    """The run's plan, searched (or priced, for manual and heuristic modes) in this process before
    Ray starts: the plan needs nothing from the cluster but its shape, which the config gives, so
    a config without a feasible plan fails in about a second with the planner's reason (the call
    that does not fit), not after Ray and the workers have started. A space of a few thousand
    plans or less (one GPU: one plan) is enumerated at once instead of spending plan.seconds."""
    p = inputs.cfg.plan
    try:
        return PlannerService().search(inputs.problem, p.mode, p.seconds, p.seed, inputs.manual)
    except ValueError as exc:
        raise search_error(inputs.cfg, exc) from None


def start_workers(info: RayClusterInfo, inputs: TrainInputs, worker_cls: type) -> WorkerGroup:
    """One worker per configured GPU (CPU workers on virtual GPUs)."""
    spec = inputs.problem.cluster
    return create_workers(
        worker_cls, spec, {"world_size": spec.n_gpus, "device": info.device},
        rank_kwargs=[{"rank": r} for r in range(spec.n_gpus)],
        cpus_per_worker=info.cpus_per_worker, gpus_per_worker=info.gpus_per_worker,
        env_vars={"OMP_NUM_THREADS": "1"} if info.virtual else None,
        nodes=info.nodes, concurrency_groups=CONCURRENCY_GROUPS,
    )


def init_world(workers: WorkerGroup, backend: str, timeout_s: float) -> None:
    """Rendezvous: rank 0 reports an address, every worker joins one world with a timeout."""
    (addr, port), = workers.run("address", ranks=[0], timeout_s=timeout_s)
    # Host it on rank 0's Ray node address, which the other nodes reach (the worker's own guess
    # is the interface of its default route, which on a multi-homed node may not be that one).
    addr = workers.slots[0].ip or addr
    workers.run("init_distributed", addr, port, backend, timeout_s, timeout_s=timeout_s + 60.0)


def plan_groups(inputs: TrainInputs, plan: ExecutionPlan) -> tuple[tuple[int, ...], ...]:
    """Every process group the plan needs, in one deterministic order."""
    graph = inputs.problem.graph
    roles = tuple(inputs.models)
    placements: list[Placement] = [p for _, p in plan.placements]
    placements += list(home_placements(graph, plan, roles).values())
    realloc_sets: list[tuple[int, ...]] = []
    for src, dst, role in realloc_member_sets(graph, plan, roles):
        model = inputs.models[role]
        realloc_sets.extend(plan_reallocation(model.spec, model.critic, src, dst).groups)
        realloc_sets.append(tuple(sorted(set(src.mesh.gpus) | set(dst.mesh.gpus))))
    return list_process_groups([(p.mesh, p.layout) for p in placements], realloc_sets,
                               world_size=inputs.problem.cluster.n_gpus)


def setup_groups(workers: WorkerGroup, groups: tuple[tuple[int, ...], ...], timeout_s: float) -> None:
    """Create the groups on every rank (torch's new_group is collective over the world)."""
    workers.run("ensure_groups", [list(g) for g in groups], timeout_s=timeout_s)


def load_models(workers: WorkerGroup, inputs: TrainInputs, plan: ExecutionPlan, timeout_s: float) -> dict[str, Any]:
    """Load each role on its home placement. Every rank is called (ranks outside the home mesh
    record the model's shapes, which a later reallocation onto them needs); returns per role the
    metadata of the home mesh's first rank."""
    cfg = inputs.cfg
    homes = home_placements(inputs.problem.graph, plan, tuple(inputs.models))
    pending = {}
    for index, (role, model) in enumerate(inputs.models.items()):
        optim = optimizer_params(cfg, role) if model.trainable else {}
        seed = cfg.run.seed + 1000 * index
        if role == "ref" and "actor" in inputs.models and role_sources(cfg)["ref"] == role_sources(cfg)["actor"]:
            # The reference policy is the initial actor (KL is measured against it): with no
            # checkpoint, the same random init as the actor.
            seed = cfg.run.seed + 1000 * list(inputs.models).index("actor")
        pending[role] = workers.call("load_model", role, model.spec, model.critic, homes[role], model.hf_dir,
                                     seed, model.trainable, optim, host_fraction=plan.offload_fraction(role))
    started = time.perf_counter()
    out = {}
    for role, call in pending.items():
        left = max(timeout_s - (time.perf_counter() - started), 1.0)
        out[role] = workers.get(call, timeout_s=left)[homes[role].mesh.start]
    return out


def optimizer_params(cfg: ExperimentConfig, role: str) -> dict[str, Any]:
    """AdamW settings of a trained role (learning rate by role)."""
    p = cfg.ppo
    lr = p.actor_lr if role == "actor" else p.critic_lr
    if cfg.algorithm == "dpo" and role == "actor":
        lr = cfg.dpo.lr
    return {"lr": lr, "weight_decay": p.weight_decay, "max_grad_norm": p.max_grad_norm,
            "warmup_steps": p.warmup_steps}


__all__ = [
    "RoleModel", "TOY_TOKENIZER", "TrainInputs", "connect_cluster", "init_world", "load_models", "optimizer_params",
    "plan_groups", "preflight", "reward_model_priced", "role_models", "search_plan_now", "setup_groups",
    "start_workers",
]
