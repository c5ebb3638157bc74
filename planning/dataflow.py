"""RLHF algorithms as dataflow graphs of model function calls (MFCs).

An MFC is one call on one model role: `generate`, `inference` or `train`. Edges come from keys
(a call consumes what another produces) and from parameter versions: a role's `train` call in
iteration i must finish before any call on that role's weights in iteration i+1 (generation of
i+1 waits for actor training of i).

The builders for PPO, GRPO, DPO, ReMax and the outcome-reward algorithms are in
`planning.algorithm_graphs`; this module holds the types and the transforms every graph goes
through.

`prune_graph` removes work nobody needs: given the keys a configuration leaves unread (e.g. the
reference logprobs when no KL term is on), it drops them from the consumers' inputs, then every
call none of whose outputs a remaining call reads; train calls are the sinks and always stay.

Bounded staleness (`Graph.max_staleness` = k, `with_staleness`): generation of iteration j reads
the actor weights after training iteration j - k - 1 (k = 0: on-policy, the previous iteration's).
Its version lag is then k + 1 iterations while every other call's is 1, and `dispatch_order`
submits the generation of iteration j + k + 1 right after the training calls of iteration j, so
generation on one mesh can run while training runs on another.

Multi-turn generation (`MultiTurn`, on the generate calls of a graph built with `multi_turn`):
a trajectory samples up to batch.gen_len tokens per turn, waits for its environment, has the
observation prefilled into its KV cache, for up to `turns` turns; every other call then reads
sequences of prompt_len + the response budget (sampled and observed tokens) tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

CallKind = Literal["generate", "inference", "train"]
ROLES = ("actor", "critic", "ref", "reward")


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Shape of the data one call processes.

    n_seqs: sequences in the call. prompt_len / gen_len: tokens of prompt and response (for
    generate, gen_len is the number of decoding steps; for inference and train the sequences are
    prompt_len + gen_len tokens long). prompt_group: consecutive sequences that share one prompt
    (samples per prompt); a generate call prefills each prompt once (actors.generation.prefill),
    an inference or train call runs it once per micro-batch (actors.engine.shared_prefix).
    """

    n_seqs: int
    prompt_len: int
    gen_len: int
    prompt_group: int = 1

    def __post_init__(self) -> None:
        for name in ("n_seqs", "prompt_len", "gen_len", "prompt_group"):
            value = getattr(self, name)
            if value < (0 if name in ("prompt_len", "gen_len") else 1):
                raise ValueError(f"batch.{name}={value}: must be {'>= 0' if name in ('prompt_len', 'gen_len') else 'positive'}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.seq_len


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Multi-turn generation: what each trajectory of a generate call does after its prompt.

    turns: turns per trajectory the cost model charges (rollout.max_turns, the worst case, until
        a run measures its mean; >= 1, fractional for a measured mean). Each turn decodes up to
        the call's batch.gen_len tokens.
    obs_tokens: observation tokens prefilled per turn (rollout.max_observation_tokens; >= 0).
    env_step_s: seconds one environment step takes (rollout.env_step_s, later the measured mean).
    response_tokens: the trajectory's budget after its prompt, sampled and observed tokens
        together (rollout.max_response_tokens); None: turns * (gen_len + obs_tokens), rounded up.
    """

    turns: float
    obs_tokens: int
    env_step_s: float
    response_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.turns) and self.turns >= 1):
            raise ValueError(f"MultiTurn.turns={self.turns}: must be a finite number >= 1")
        if isinstance(self.obs_tokens, bool) or not isinstance(self.obs_tokens, int) or self.obs_tokens < 0:
            raise ValueError(f"MultiTurn.obs_tokens={self.obs_tokens!r}: must be an int >= 0")
        if not (math.isfinite(self.env_step_s) and self.env_step_s >= 0):
            raise ValueError(f"MultiTurn.env_step_s={self.env_step_s}: must be a finite number >= 0")
        if self.response_tokens is not None and self.response_tokens < 1:
            raise ValueError(f"MultiTurn.response_tokens={self.response_tokens}: must be >= 1 (or None)")

    def budget(self, gen_len: int) -> int:
        """Tokens a trajectory may hold after its prompt, for `gen_len` sampled tokens per turn."""
        if self.response_tokens is not None:
            return self.response_tokens
        return math.ceil(self.turns * (gen_len + self.obs_tokens))


@dataclass(frozen=True, slots=True)
class MFC:
    """One model function call.

    role: which model (actor, critic, ref, reward). kind: generate | inference | train.
    n_minibatches: optimizer steps per train call (PPO minibatches x epochs); 1 otherwise.
    recompute_forward: a train call that first recomputes the behaviour policy's logprobs with one
        forward over the whole batch under its own layout (the outcome algorithms' actor with more
        than one optimizer step; with one, the training forward's own logprobs serve, as
        actors.worker.behaviour.reuses_forward_logprobs says; PPO has its actor_inf call instead).
    expected_runs: how many times the call runs per iteration on average (DAPO's dynamic
    sampling generates more rounds until enough groups with distinct rewards remain).
    with_entropy: a train call whose loss has an entropy bonus (more memory per logit).
    multi_turn: a generate call whose trajectories take several turns with an environment
        (`MultiTurn`; batch.gen_len is then one turn's decode length); None: single-turn.
    model_free: an inference call that runs no model: a rule-based reward scored on the workers'
        host threads, or the environments' rewards of multi-turn rollouts. It holds no weights and
        no GPU memory; its time is host time: `host_s_per_token` per response token, or
        `planning.cost_terms.MODEL_FREE_S_PER_TOKEN` where that is None.
    host_s_per_token: a model-free call's host seconds per response token where the app knows
        better than the default (a rule reward whose tokenizer decodes through a byte table:
        `planning.cost_terms.BYTE_TABLE_S_PER_TOKEN`).
    truncated_sampling: a generate call sampling with top-k or top-p (sorted rows each step);
        False: greedy or plain temperature sampling (one fused read of the logits).
    fp8_decode: a generate call whose decode steps run the MLPs and head from FP8 copies
        (sampling.fp8; `planning.cost_terms.decode_stage_s` prices them).
    fp8_kv_cache: a generate call whose KV cache is e4m3 (sampling.kv_cache_dtype): one byte
        per cached value to hold and to read.
    """

    name: str
    role: str
    kind: CallKind
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]
    batch: BatchShape
    n_minibatches: int = 1
    recompute_forward: bool = False
    expected_runs: float = 1.0
    with_entropy: bool = False
    multi_turn: MultiTurn | None = None
    model_free: bool = False
    host_s_per_token: float | None = None
    truncated_sampling: bool = False
    fp8_decode: bool = False
    fp8_kv_cache: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"MFC {self.name}: role {self.role!r} not one of {ROLES}")
        if self.kind not in ("generate", "inference", "train"):
            raise ValueError(f"MFC {self.name}: kind {self.kind!r} not generate|inference|train")
        if self.n_minibatches < 1:
            raise ValueError(f"MFC {self.name}: n_minibatches={self.n_minibatches} must be >= 1")
        if not self.expected_runs >= 1.0:
            raise ValueError(f"MFC {self.name}: expected_runs={self.expected_runs} must be >= 1")
        if self.multi_turn is not None and self.kind != "generate":
            raise ValueError(f"MFC {self.name}: multi_turn is for generate calls, not {self.kind}")
        if self.model_free and self.kind != "inference":
            raise ValueError(f"MFC {self.name}: model_free is for inference calls, not {self.kind}")
        if self.host_s_per_token is not None and not (self.model_free and self.host_s_per_token > 0):
            raise ValueError(f"MFC {self.name}: host_s_per_token={self.host_s_per_token} is for model-free calls, "
                             "and must be > 0")


@dataclass(frozen=True)
class Graph:
    """A dataflow graph: calls in a valid topological order plus their dependencies.

    max_staleness: k >= 0; generation reads the weights k + 1 iterations old (module docstring).
    """

    algorithm: str
    mfcs: tuple[MFC, ...]
    dataset_keys: tuple[str, ...] = field(default=("prompts",))
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"graph {self.algorithm}: max_staleness={self.max_staleness} must be >= 0")
        names = [m.name for m in self.mfcs]
        if len(set(names)) != len(names):
            raise ValueError(f"graph {self.algorithm}: duplicate call names {names}")
        available = set(self.dataset_keys)
        for m in self.mfcs:
            missing = [k for k in m.input_keys if k not in available]
            if missing:
                raise ValueError(f"graph {self.algorithm}: call {m.name} needs {missing}, produced by no earlier call")
            available.update(m.output_keys)

    def mfc(self, name: str) -> MFC:
        for m in self.mfcs:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.role for m in self.mfcs))

    @property
    def model_roles(self) -> tuple[str, ...]:
        """Roles whose weights some call runs (a role used only by model-free calls has none)."""
        return tuple(dict.fromkeys(m.role for m in self.mfcs if not m.model_free))

    @property
    def trained_roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.role for m in self.mfcs if m.kind == "train"))

    def data_parents(self, name: str) -> tuple[str, ...]:
        """Calls of the same iteration whose outputs `name` consumes."""
        call = self.mfc(name)
        producers: dict[str, str] = {}
        parents: list[str] = []
        for m in self.mfcs:
            if m.name == name:
                break
            for k in m.output_keys:
                producers[k] = m.name
        for k in call.input_keys:
            if k in producers and producers[k] not in parents:
                parents.append(producers[k])
        return tuple(parents)

    def version_parents(self, name: str) -> tuple[str, ...]:
        """Calls of the *previous* iteration that must finish before `name` starts.

        Every call on a trained role waits for that role's train call of the previous iteration
        (its weights must be the new version); a train call also waits for the previous
        iteration's last use of the old weights, which the first rule already orders.
        """
        role = self.mfc(name).role
        return tuple(m.name for m in self.mfcs if m.role == role and m.kind == "train")

    def children(self, name: str) -> tuple[str, ...]:
        return tuple(m.name for m in self.mfcs if name in self.data_parents(m.name))

    def placement_default(self, name: str) -> str | None:
        """The call whose placement `name` takes when a plan leaves it out: an inference call on a
        trained role (PPO's actor_inf) runs where the role trains (no reallocation); else None."""
        call = self.mfc(name)
        if call.kind != "inference" or call.role not in self.trained_roles:
            return None
        return next(m.name for m in self.mfcs if m.role == call.role and m.kind == "train")

    def is_rollout(self, name: str) -> bool:
        """Whether `name` belongs to the rollout stage (generation), the part that may run ahead
        on older weights; everything else is the train stage, run on the current weights."""
        return self.mfc(name).kind == "generate"

    def version_lag(self, name: str) -> int:
        """How many iterations back the training of `version_parents(name)` lies: 1 + k for
        generation, 1 for every other call (it reads the weights of the previous iteration)."""
        return 1 + self.max_staleness if self.is_rollout(name) else 1

    def dispatch_order(self, iterations: int) -> list[tuple[int, str]]:
        """(iteration, call) in the order a driver submits them. k = 0: iteration after iteration,
        calls in graph order. k > 0: the rollout stages of iterations 0..k first, then for each
        iteration j its train stage followed by the rollout stage of iteration j + k + 1."""
        if iterations < 1:
            raise ValueError(f"iterations={iterations}: must be >= 1")
        if self.max_staleness == 0:
            return [(it, m.name) for it in range(iterations) for m in self.mfcs]
        rollout = [m.name for m in self.mfcs if self.is_rollout(m.name)]
        train = [m.name for m in self.mfcs if not self.is_rollout(m.name)]
        order = [(it, name) for it in range(min(self.max_staleness + 1, iterations)) for name in rollout]
        for it in range(iterations):
            order += [(it, name) for name in train]
            ahead = it + self.max_staleness + 1
            if ahead < iterations:
                order += [(ahead, name) for name in rollout]
        return order


def prune_graph(graph: Graph, unread: Iterable[str] = ()) -> Graph:
    """`graph` without the input keys `unread` and without the calls whose outputs nobody reads.

    A call stays when it trains (the weight update is the point of an iteration) or when a call
    that stays reads one of its outputs; removal repeats until nothing changes, so a producer
    that fed only a dropped call goes too. Calls keep their order; the graph's own checks (every
    input produced earlier) still hold because only readers' inputs and unread producers go.
    """
    drop = set(unread)
    calls = [replace(m, input_keys=tuple(k for k in m.input_keys if k not in drop)) for m in graph.mfcs]
    while True:
        read = {k for m in calls for k in m.input_keys}
        kept = [m for m in calls if m.kind == "train" or read & set(m.output_keys)]
        if len(kept) == len(calls):
            return replace(graph, mfcs=tuple(kept))
        calls = kept


def with_entropy_bonus(graph: Graph) -> Graph:
    """The same graph whose actor training adds an entropy bonus to its loss (ppo.entropy_coef >
    0): the cost model then counts the entropy's float32 [token, vocab] buffers. DPO's loss has
    no entropy term, so its graph is returned unchanged."""
    if graph.algorithm == "dpo":
        return graph
    return replace(graph, mfcs=tuple(replace(m, with_entropy=True) if m.kind == "train" and m.role == "actor" else m
                                     for m in graph.mfcs))


def with_staleness(graph: Graph, max_staleness: int) -> Graph:
    """The same graph whose generation may read weights up to `max_staleness` iterations older
    than on-policy (see the module docstring); DPO, which generates nothing, only allows 0."""
    if max_staleness and not any(m.kind == "generate" for m in graph.mfcs):
        raise ValueError(f"max_staleness={max_staleness}: graph {graph.algorithm} has no generation to run ahead")
    return replace(graph, max_staleness=max_staleness)
