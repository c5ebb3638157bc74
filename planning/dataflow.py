"""RLHF algorithms as dataflow graphs of model function calls (MFCs).

An MFC is one call on one model role: `generate`, `inference` or `train`. Edges come from keys
(a call consumes what another produces) and from parameter versions: a role's `train` call in
iteration i must finish before any call on that role's weights in iteration i+1 (generation of
i+1 waits for actor training of i). Builders exist for PPO, GRPO, DPO and ReMax.

`prune_graph` removes work nobody needs: given the keys a configuration leaves unread (e.g. the
reference logprobs when no KL term is on), it drops them from the consumers' inputs, then every
call none of whose outputs a remaining call reads; train calls are the sinks and always stay.
"""

from __future__ import annotations

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
    prompt_len + gen_len tokens long).
    """

    n_seqs: int
    prompt_len: int
    gen_len: int

    def __post_init__(self) -> None:
        for name in ("n_seqs", "prompt_len", "gen_len"):
            value = getattr(self, name)
            if value < (1 if name == "n_seqs" else 0):
                raise ValueError(f"batch.{name}={value}: must be {'positive' if name == 'n_seqs' else '>= 0'}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.seq_len


@dataclass(frozen=True, slots=True)
class MFC:
    """One model function call.

    role: which model (actor, critic, ref, reward). kind: generate | inference | train.
    n_minibatches: optimizer steps per train call (PPO minibatches x epochs); 1 otherwise.
    recompute_forward: a train call that first recomputes the behaviour policy's logprobs with one
        forward over the whole batch under its own layout (the PPO and GRPO actors with more than
        one optimizer step; with one, the training forward's own logprobs serve, as
        actors.worker.train.reuses_forward_logprobs says).
    """

    name: str
    role: str
    kind: CallKind
    input_keys: tuple[str, ...]
    output_keys: tuple[str, ...]
    batch: BatchShape
    n_minibatches: int = 1
    recompute_forward: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"MFC {self.name}: role {self.role!r} not one of {ROLES}")
        if self.kind not in ("generate", "inference", "train"):
            raise ValueError(f"MFC {self.name}: kind {self.kind!r} not generate|inference|train")
        if self.n_minibatches < 1:
            raise ValueError(f"MFC {self.name}: n_minibatches={self.n_minibatches} must be >= 1")


@dataclass(frozen=True)
class Graph:
    """A dataflow graph: calls in a valid topological order plus their dependencies."""

    algorithm: str
    mfcs: tuple[MFC, ...]
    dataset_keys: tuple[str, ...] = field(default=("prompts",))

    def __post_init__(self) -> None:
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


def ppo_graph(batch: BatchShape, ppo_minibatches: int = 4, ppo_epochs: int = 1) -> Graph:
    """PPO: actor generation; reward, ref and critic inference; actor and critic training."""
    n_mb = ppo_minibatches * ppo_epochs
    seq = ("seq", "prompt_mask")
    return Graph("ppo", (
        MFC("actor_gen", "actor", "generate", ("prompts",), seq + ("logprobs", "no_eos_mask"), batch),
        MFC("rew_inf", "reward", "inference", seq, ("rewards",), batch),
        MFC("ref_inf", "ref", "inference", seq, ("ref_logprobs",), batch),
        MFC("critic_inf", "critic", "inference", seq, ("values",), batch),
        MFC("actor_train", "actor", "train", seq + ("logprobs", "ref_logprobs", "rewards", "values", "no_eos_mask"),
            ("actor_stats",), batch, n_mb, recompute_forward=n_mb > 1),
        MFC("critic_train", "critic", "train", seq + ("logprobs", "ref_logprobs", "rewards", "values", "no_eos_mask"),
            ("critic_stats",), batch, n_mb),
    ))


def grpo_graph(batch: BatchShape, group_size: int, ppo_minibatches: int = 1) -> Graph:
    """GRPO: `group_size` samples per prompt, group-normalised rewards, no critic."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: must be >= 1")
    grouped = BatchShape(batch.n_seqs * group_size, batch.prompt_len, batch.gen_len)
    seq = ("seq", "prompt_mask")
    return Graph("grpo", (
        MFC("actor_gen", "actor", "generate", ("prompts",), seq + ("logprobs", "no_eos_mask"), grouped),
        MFC("rew_inf", "reward", "inference", seq, ("rewards",), grouped),
        MFC("ref_inf", "ref", "inference", seq, ("ref_logprobs",), grouped),
        MFC("actor_train", "actor", "train", seq + ("logprobs", "ref_logprobs", "rewards"), ("actor_stats",),
            grouped, ppo_minibatches, recompute_forward=ppo_minibatches > 1),
    ))


def dpo_graph(batch: BatchShape) -> Graph:
    """DPO: reference logprobs of chosen and rejected answers, then actor training on the pairs.

    batch.n_seqs is the number of pairs; each call sees 2 * n_seqs sequences.
    """
    pairs = BatchShape(2 * batch.n_seqs, batch.prompt_len, batch.gen_len)
    return Graph("dpo", (
        MFC("ref_inf", "ref", "inference", ("pairs",), ("ref_logprobs",), pairs),
        MFC("actor_train", "actor", "train", ("pairs", "ref_logprobs"), ("actor_stats",), pairs),
    ), dataset_keys=("pairs",))


def remax_graph(batch: BatchShape) -> Graph:
    """ReMax: sampled and greedy generation, a reward for each, REINFORCE with the greedy baseline."""
    return Graph("remax", (
        MFC("sample_gen", "actor", "generate", ("prompts",), ("seq", "prompt_mask", "logprobs"), batch),
        MFC("greedy_gen", "actor", "generate", ("prompts",), ("greedy_seq",), batch),
        MFC("rew_inf", "reward", "inference", ("seq", "prompt_mask"), ("rewards",), batch),
        MFC("greedy_rew_inf", "reward", "inference", ("greedy_seq",), ("greedy_rewards",), batch),
        # greedy_seq too: the greedy response's no-EOS flag enters the baseline like the sampled one's.
        MFC("actor_train", "actor", "train",
            ("seq", "prompt_mask", "logprobs", "rewards", "greedy_seq", "greedy_rewards"), ("actor_stats",), batch),
    ))


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
            return Graph(graph.algorithm, tuple(kept), graph.dataset_keys)
        calls = kept
