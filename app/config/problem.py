"""From an experiment config to the planner's inputs: the dataflow graph, the cluster, one
model per role (`build_problem`), and the `plan.manual` section as an `ExecutionPlan`.

With `rollout.env` set the generate calls are multi-turn (`multi_turn`: rollout.max_turns turns
of batch.gen_len sampled and rollout.max_observation_tokens observed tokens, rollout.env_step_s
per environment step) and every other call reads prompt_len + the response budget tokens. The
environment itself is never imported here: planning needs only the numbers.

Errors are `ConfigError`s naming the dotted field, like every other config error.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from app.config.checks import generation_rounds, samples_per_prompt, uses_ref
from app.config.experiment import ConfigError, ExperimentConfig, ManualPlacement, ModelSource
from planning.algorithm_graphs import OUTCOME_ALGORITHMS, dpo_graph, outcome_graph, ppo_graph, remax_graph
from planning.cost import ModelRole, PlanningProblem
from planning.dataflow import MFC, BatchShape, Graph, MultiTurn, prune_graph, with_entropy_bonus, with_staleness
from planning.efficiency import OpEfficiency, preset_efficiency
from planning.hardware import GiB, hardware_preset
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import ModelSpec, model_preset, validate_tp
from planning.offload import OPTIMIZER_BYTES_PER_PARAM, describe_capacity, host_capacity_bytes
from planning.offload_search import total_host_bytes
from planning.plan import CallExecution, ExecutionPlan, Placement
from planning.search import EXHAUSTIVE_LIMIT

# Bytes per parameter that must live somewhere in the cluster: bf16 weights (2) for every model;
# trained models add bf16 grads (2) and the optimizer state (fp32 master + AdamW m, v: 12).
FROZEN_BYTES_PER_PARAM = 2
TRAINED_BYTES_PER_PARAM = 2 + 2 + OPTIMIZER_BYTES_PER_PARAM


def multi_turn(cfg: ExperimentConfig) -> MultiTurn | None:
    """The generate calls' multi-turn shape from the rollout section; None without rollout.env."""
    r = cfg.rollout
    if r.env is None:
        return None
    return MultiTurn(turns=r.max_turns, obs_tokens=r.max_observation_tokens, env_step_s=r.env_step_s,
                     response_tokens=r.response_budget(cfg.batch.gen_len))


def algorithm_graph(cfg: ExperimentConfig) -> Graph:
    """The algorithm's full dataflow graph for the configured batch (before pruning)."""
    b = cfg.batch
    shape = BatchShape(b.prompts, b.prompt_len, b.gen_len)
    turns = multi_turn(cfg)
    if cfg.algorithm == "ppo":
        return ppo_graph(shape, b.ppo_minibatches, b.ppo_epochs, cfg.ppo.recompute_logprobs, multi_turn=turns)
    if cfg.algorithm in OUTCOME_ALGORITHMS:
        return outcome_graph(cfg.algorithm, shape, samples_per_prompt(cfg), b.ppo_minibatches, generation_rounds(cfg),
                             multi_turn=turns)
    if cfg.algorithm == "dpo":
        if turns is not None:
            raise ConfigError("rollout.env", cfg.rollout.env, "null for dpo, which generates nothing")
        return dpo_graph(shape)
    return remax_graph(shape, multi_turn=turns)


def build_graph(cfg: ExperimentConfig) -> Graph:
    """The graph that runs: `algorithm_graph` without the calls whose outputs no loss reads under
    this config (`unread_keys`), with run.max_staleness. The planner and the driver both get this
    graph, so a dropped call is neither planned, loaded nor run."""
    graph = with_staleness(prune_graph(algorithm_graph(cfg), unread_keys(cfg)), cfg.run.max_staleness)
    if reward_is_model_free(cfg):
        graph = replace(graph, mfcs=tuple(replace(m, model_free=True) if m.role == "reward" else m
                                          for m in graph.mfcs))
    s = cfg.sampling
    # How the generate calls sample (each priced by planning.cost_passes.generate_parts).
    sampling = {"truncated_sampling": s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0),
                "fp8_decode": s.fp8, "fp8_kv_cache": s.kv_cache_dtype == "fp8"}
    if any(sampling.values()):
        graph = replace(graph, mfcs=tuple(replace(m, **sampling) if m.kind == "generate" else m for m in graph.mfcs))
    return with_entropy_bonus(graph) if cfg.ppo.entropy_coef > 0 else graph


def reward_is_model_free(cfg: ExperimentConfig) -> bool:
    """Whether the reward calls run no model: a rule-based reward (reward.function) or the
    environments' rewards (rollout.env). Their role then loads no weights, and the planner prices
    them as host time (`planning.dataflow.MFC.model_free`)."""
    return cfg.algorithm != "dpo" and (cfg.rollout.env is not None or cfg.reward.function is not None)


def unread_keys(cfg: ExperimentConfig) -> tuple[str, ...]:
    """Data keys that no loss reads under this config: the reference logprobs when the
    algorithm's KL term is off (`app.config.checks.uses_ref`: grpo, dapo, gspo with
    grpo.kl_loss_coef = 0; remax, rloo, reinforce_pp(_baseline) with ppo.kl_coef = 0). Their only
    other reader, the actor/kl metric, then goes too, as in TRL with beta = 0. PPO keeps its
    reference: actor/kl is its KL monitor and the adaptive controller's input. DPO's loss always
    reads it."""
    return () if uses_ref(cfg) else ("ref_logprobs",)


def build_cluster(cfg: ExperimentConfig) -> ClusterSpec:
    """The cluster from the hardware preset, with a measured profile applied when given."""
    hardware = hardware_preset(cfg.cluster.gpu)
    if cfg.plan.profile is not None:
        try:
            hardware = hardware.with_profile(cfg.plan.profile)
        except (OSError, ValueError, AttributeError) as exc:  # AttributeError: JSON that is not an object
            raise ConfigError("plan.profile", cfg.plan.profile, f"a readable profile JSON ({exc})") from None
    if cfg.cluster.gpu_memory_gib is not None:
        hardware = replace(hardware, mem_bytes=cfg.cluster.gpu_memory_gib * GiB)
    if cfg.cluster.host_memory_gib is not None:
        hardware = replace(hardware, host_mem_bytes=cfg.cluster.host_memory_gib * GiB)
    return ClusterSpec(cfg.cluster.nodes, cfg.cluster.gpus_per_node, hardware)


def profile_efficiency(cfg: ExperimentConfig) -> OpEfficiency:
    """The op efficiencies of the measured profile (`plan.profile`, its "efficiency" block, as
    `python -m app profile` writes it; factors it does not name are 1.0); without a profile,
    those fitted for the GPU preset (`planning.efficiency.PRESET_EFFICIENCY`)."""
    if cfg.plan.profile is None:
        return preset_efficiency(cfg.cluster.gpu)
    try:
        block = json.loads(Path(cfg.plan.profile).read_text()).get("efficiency", {})
        if not isinstance(block, dict):
            raise ValueError(f"'efficiency' is a {type(block).__name__}, not an object")
        above = {k: v for k, v in block.items() if isinstance(v, (int, float)) and v > 1.0}
        if above:  # a profile measures fractions of its own peaks (only a run's calibration exceeds 1)
            raise ValueError(f"factors above 1: {above}")
        return OpEfficiency.from_dict(block)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError("plan.profile", cfg.plan.profile,
                          f"a profile JSON whose 'efficiency' maps gemm/decode/comm/optimizer to (0, 1] ({exc})") from None


def role_sources(cfg: ExperimentConfig) -> dict[str, tuple[str, ModelSource]]:
    """role -> (dotted field it came from, source), applying the defaults ref<-actor, reward<-critic<-actor."""
    m = cfg.models
    out = {"actor": ("models.actor", m.actor)}
    out["ref"] = ("models.ref", m.ref) if m.ref else out["actor"]
    if m.critic:
        out["critic"] = ("models.critic", m.critic)
    out["reward"] = ("models.reward", m.reward) if m.reward else out.get("critic", out["actor"])
    return out


def model_spec(field: str, source: ModelSource) -> ModelSpec:
    """The ModelSpec of a preset or HF directory; `field` names the config entry in errors."""
    if source.preset is not None:
        return model_preset(source.preset)
    try:
        return ModelSpec.from_hf_config(source.path)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{field}.path", source.path,
                          f"an HF model directory with a LLaMA-family config.json ({exc})") from None


def build_problem(cfg: ExperimentConfig, reward_token_ratio: float | None = None,
                  reward_extra_tokens: int = 0) -> PlanningProblem:
    """Graph + cluster + one model per role the graph uses. Raises ConfigError on a bad config.

    reward_token_ratio / reward_extra_tokens: a reward model with another tokenizer than the
    actor's reads the text re-tokenized (app.run.tokenizer_check): its calls are priced at this
    many of its tokens per actor token plus the tokens its rendering adds to every sequence, cut
    to its maximum length (`reward_batch`); None (one tokenizer): as the batch says."""
    graph = build_graph(cfg)
    cluster = build_cluster(cfg)
    sources = role_sources(cfg)
    models: dict[str, ModelRole] = {}
    for role in graph.roles:
        if role not in sources:
            raise ConfigError(f"models.{role}", None, f"a model for the {role} role, which {cfg.algorithm} uses")
        field, source = sources[role]
        spec = model_spec(field, source)
        if role == "reward" and reward_token_ratio is not None:
            # It reads text cut to its maximum length, never the actor's sequences as they are.
            limit = reward_max_length(source, spec)
            graph = replace(graph, mfcs=tuple(
                replace(m, batch=reward_batch(m.batch, reward_token_ratio, limit, reward_extra_tokens))
                if m.role == "reward" else m
                for m in graph.mfcs))
        else:
            check_positions(cfg, spec, field)
        models[role] = ModelRole(spec=spec, critic=role in ("critic", "reward"))
    offload = config_offload(cfg, graph)
    problem = PlanningProblem(graph=graph, cluster=cluster, models=models, efficiency=profile_efficiency(cfg),
                              memory_margin=cfg.plan.memory_margin, optimizer_offload=offload,
                              auto_offload=cfg.plan.optimizer_offload is None)
    check_cluster_memory(cfg, problem)
    return problem


def rule_reward_priced(problem: PlanningProblem, host_s_per_token: float) -> PlanningProblem:
    """The problem with its model-free reward calls priced at `host_s_per_token` per response
    token (`MFC.host_s_per_token`): the actor's tokenizer says how fast a rule reward's rows
    decode (app.data.rule_reward_s_per_token; app.run.runtime.preflight, `python -m app plan`)."""
    mfcs = tuple(replace(m, host_s_per_token=host_s_per_token) if m.model_free and m.role == "reward" else m
                 for m in problem.graph.mfcs)
    return replace(problem, graph=replace(problem.graph, mfcs=mfcs))


def config_offload(cfg: ExperimentConfig, graph: Graph) -> tuple[tuple[str, float], ...]:
    """`plan.optimizer_offload` as the problem's (role, fraction) pairs (zeros left out); every
    role named must be one the graph trains. None (the planner chooses) gives ()."""
    given = cfg.plan.optimizer_offload
    if given is None:
        return ()
    trained = graph.trained_roles
    for role, fraction in given.items():
        if role not in trained:
            raise ConfigError(f"plan.optimizer_offload.{role}", fraction,
                              f"a role {cfg.algorithm} trains: {', '.join(trained)}", problem="not a trained role")
    return tuple(sorted((role, float(f)) for role, f in given.items() if f > 0))


def reward_max_length(source: ModelSource, spec: ModelSpec) -> int:
    """The longest sequence a reward model reading text is given: models.reward.max_length, at
    most its max positions."""
    limit = spec.max_position_embeddings
    return min(source.max_length, limit) if source.max_length is not None else limit


def reward_batch(batch: BatchShape, ratio: float, max_length: int, extra: int = 0) -> BatchShape:
    """The shape of a reward call that reads the actor's prompt + response re-tokenized: each
    part `ratio` times as many tokens (rounded up), the prompt `extra` more (a chat template's
    own tokens), both scaled down together to `max_length` (the worker keeps each sequence's last
    max_length tokens)."""
    if not (math.isfinite(ratio) and ratio > 0) or extra < 0:
        raise ValueError(f"reward_token_ratio={ratio}, extra tokens {extra}: must be a finite number > 0 and >= 0")
    prompt, gen = math.ceil(batch.prompt_len * ratio) + extra, math.ceil(batch.gen_len * ratio)
    if prompt + gen > max_length:
        prompt = prompt * max_length // (prompt + gen)
        gen = max_length - prompt
    return BatchShape(batch.n_seqs, prompt, gen)


def check_positions(cfg: ExperimentConfig, spec: ModelSpec, field: str) -> None:
    """The longest sequence must fit the model's positions: prompt_len + gen_len, or with
    rollout.env prompt_len + the response budget (`RolloutConfig.response_budget`)."""
    b, r = cfg.batch, cfg.rollout
    limit = spec.max_position_embeddings
    if r.env is None:
        if b.prompt_len + b.gen_len > limit:
            raise ConfigError("batch.gen_len", b.gen_len, f"prompt_len + gen_len <= {limit} (max positions of {field})")
        return
    budget = r.response_budget(b.gen_len)
    if b.prompt_len + budget <= limit:
        return
    if r.max_response_tokens is not None:
        raise ConfigError("rollout.max_response_tokens", r.max_response_tokens,
                          f"batch.prompt_len + rollout.max_response_tokens <= {limit} (max positions of {field})")
    raise ConfigError("batch.gen_len", b.gen_len,
                      f"batch.prompt_len + rollout.max_turns * (batch.gen_len + rollout.max_observation_tokens) = "
                      f"{b.prompt_len + budget} <= {limit} (max positions of {field}), or a smaller "
                      "rollout.max_response_tokens")


def check_cluster_memory(cfg: ExperimentConfig, problem: PlanningProblem) -> None:
    """Refuse, before searching, a cluster whose total memory cannot hold weights + optimizer
    states: GPU memory, plus the host memory optimizer offload may use (all of it the plan may
    fill when the planner chooses the offload, the configured fractions when they are fixed)."""
    trained = set(problem.graph.trained_roles)
    need = optimizer = 0.0
    for role, model in problem.models.items():
        if role not in problem.graph.model_roles:  # a model-free reward loads no weights
            continue
        params = model.spec.n_params(model.critic)
        need += (TRAINED_BYTES_PER_PARAM if role in trained else FROZEN_BYTES_PER_PARAM) * params
        optimizer += OPTIMIZER_BYTES_PER_PARAM * params if role in trained else 0.0
    hw = problem.cluster.hardware
    if problem.auto_offload:
        host = min(optimizer, host_capacity_bytes(hw) * problem.cluster.n_gpus)
    else:
        host = total_host_bytes(problem, dict(problem.optimizer_offload))
    have = problem.cluster.n_gpus * hw.mem_bytes
    if need - host > have:
        c = cfg.cluster
        offload = (f", and {host / GiB:.0f} GiB of optimizer state in host memory ({describe_capacity(hw)})"
                   if host > 0 else "")
        raise ConfigError(
            "cluster", f"{c.nodes}x{c.gpus_per_node} {c.gpu}",
            f"at least {need / GiB:.0f} GiB of GPU memory in total for weights and optimizer states "
            f"(this cluster has {have / GiB:.0f} GiB{offload}): add nodes or use a GPU with more memory",
            problem="too small for the models",
        )


def manual_plan(cfg: ExperimentConfig, problem: PlanningProblem) -> ExecutionPlan | None:
    """The `plan.manual` placements as an ExecutionPlan; None unless plan.mode is 'manual' (a
    manual section left in a config does not stand in the way of searching). Raises ConfigError."""
    if cfg.plan.mode != "manual" or not cfg.plan.manual:
        return None
    calls = [m.name for m in problem.graph.mfcs]
    # A placement for a call the config prunes (e.g. ref_inf without a KL term) is not needed.
    pruned = {m.name for m in algorithm_graph(cfg).mfcs} - set(calls)
    for name in cfg.plan.manual:
        if name not in calls and name not in pruned:
            raise ConfigError(f"plan.manual.{name}", name, f"a call of the {cfg.algorithm} graph: {', '.join(calls)}",
                              problem="unknown call")
    # A call with a placement default (PPO's actor_inf: where the actor trains) may be left out.
    given = {name: cfg.plan.manual.get(name) or cfg.plan.manual.get(problem.graph.placement_default(name) or "")
             for name in calls}
    missing = [name for name in calls if given[name] is None]
    if missing:
        raise ConfigError("plan.manual", sorted(cfg.plan.manual),
                          f"a placement for every call; missing {', '.join(missing)}", problem="incomplete")
    placements, executions = {}, {}
    for mfc in problem.graph.mfcs:
        entry = given[mfc.name]
        assert entry is not None  # `missing` above
        placements[mfc.name] = _manual_placement(mfc.name, entry, problem.models[mfc.role].spec, problem.cluster)
        execution = _manual_execution(mfc, entry)
        if execution is not None:
            executions[mfc.name] = execution
    # A fixed plan.optimizer_offload goes with the plan; otherwise the search adds what it needs.
    return ExecutionPlan.from_dict(placements, executions).with_offload(dict(problem.optimizer_offload))


def _manual_execution(mfc: MFC, given: ManualPlacement) -> CallExecution | None:
    """The call's micro_batch_tokens / gen_rounds, when set; the one that does not fit the call's
    kind (or any, for a call that runs no model) is a ConfigError."""
    name, kind, field = mfc.name, mfc.kind, f"plan.manual.{mfc.name}"
    if mfc.model_free and given.micro_batch_tokens is not None:
        raise ConfigError(f"{field}.micro_batch_tokens", given.micro_batch_tokens,
                          f"unset for {name}: it runs no model (a rule or environment reward on the workers' "
                          "host threads), so it has no micro-batches")
    if kind == "generate" and given.micro_batch_tokens is not None:
        raise ConfigError(f"{field}.micro_batch_tokens", given.micro_batch_tokens,
                          f"unset for {name}, a generate call (it takes gen_rounds)")
    if kind != "generate" and given.gen_rounds is not None:
        raise ConfigError(f"{field}.gen_rounds", given.gen_rounds,
                          f"unset for {name}, a {kind} call (it takes micro_batch_tokens)")
    if given.micro_batch_tokens is None and given.gen_rounds is None:
        return None
    return CallExecution(given.micro_batch_tokens, given.gen_rounds)


def _manual_placement(name: str, given: ManualPlacement, spec: ModelSpec, cluster: ClusterSpec) -> Placement:
    field = f"plan.manual.{name}"
    try:
        mesh = Mesh.parse(given.mesh, cluster.gpus_per_node)
    except ValueError as exc:
        raise ConfigError(f"{field}.mesh", given.mesh, f"a legal mesh like 'n0' or 'n0:g0-3' ({exc})") from None
    if mesh.start + mesh.size > cluster.n_gpus:
        raise ConfigError(f"{field}.mesh", given.mesh,
                          f"a mesh inside the {cluster.nodes}x{cluster.gpus_per_node} cluster {cluster.full_mesh}",
                          problem="outside the cluster")
    layout = Layout.parse(given.layout)
    try:
        validate_tp(spec, layout.tp)
    except ValueError as exc:
        raise ConfigError(f"{field}.layout", given.layout,
                          f"tp dividing the heads, intermediate and vocab sizes of {spec.name} ({exc})") from None
    if layout.pp > spec.n_layers:
        raise ConfigError(f"{field}.layout", given.layout, f"pp <= n_layers={spec.n_layers} of {spec.name}")
    try:
        return Placement(mesh, layout)
    except ValueError as exc:
        raise ConfigError(f"{field}.layout", given.layout,
                          f"dp*tp*pp = {mesh.size} GPUs of mesh {mesh}, tp inside one node ({exc})") from None
def search_error(cfg: ExperimentConfig, exc: ValueError) -> ConfigError:
    """The config field to blame when no runnable plan came out: the manual plan, the exhaustive
    mode's size, or the cluster (too small for the models and batch)."""
    what = " ".join(str(exc).split())
    if cfg.plan.mode == "manual":
        given = ", ".join(f"{name}: {p.mesh}/{p.layout}" for name, p in (cfg.plan.manual or {}).items())
        return ConfigError("plan.manual", given, f"placements on which every call can run ({what})",
                           problem="infeasible plan")
    if cfg.plan.mode == "exhaustive" and str(EXHAUSTIVE_LIMIT) in what:
        return ConfigError("plan.mode", cfg.plan.mode, f"'search' or 'heuristic' for a plan space this large ({what})",
                           problem="too many plans")
    c = cfg.cluster
    return ConfigError(
        "cluster", f"{c.nodes}x{c.gpus_per_node} {c.gpu}",
        f"a cluster on which plan mode {cfg.plan.mode!r} finds a feasible plan ({what}): add GPUs, "
        "shorten batch.gen_len or lower batch.prompts",
        problem="no feasible plan",
    )


