"""The RLHF algorithms' dataflow graphs: PPO, GRPO, DPO, ReMax and the critic-free outcome-reward
algorithms (RLOO, REINFORCE++, REINFORCE++-baseline, DAPO, GSPO), built from `planning.dataflow`'s
MFC and Graph. Each builds the full graph, reference call included; `planning.dataflow.prune_graph`
then drops what a configuration leaves unread. `multi_turn` (planning.dataflow.MultiTurn) makes
the generate calls multi-turn.
"""

from __future__ import annotations

from dataclasses import replace

from planning.dataflow import MFC, BatchShape, Graph, MultiTurn


def _shapes(batch: BatchShape, multi_turn: MultiTurn | None) -> tuple[BatchShape, BatchShape]:
    """(the generate calls' shape, every other call's): the same single-turn; with `multi_turn`
    generation keeps one turn's gen_len and the others read prompt_len + the response budget."""
    if multi_turn is None:
        return batch, batch
    return batch, replace(batch, gen_len=multi_turn.budget(batch.gen_len))


def ppo_graph(batch: BatchShape, ppo_minibatches: int = 4, ppo_epochs: int = 1,
              recompute_logprobs: bool = True, multi_turn: MultiTurn | None = None) -> Graph:
    """PPO: actor generation; reward, ref and critic inference; the actor's logprobs of the
    rollout under its current weights (actor_inf -> old_logprobs: the behaviour policy of the PPO
    ratio and of the KL penalty in the reward, which both train calls need); actor and critic
    training. recompute_logprobs=False drops actor_inf and uses the generation's logprobs.
    multi_turn: multi-turn generation (module docstring)."""
    gen, batch = _shapes(batch, multi_turn)
    n_mb = ppo_minibatches * ppo_epochs
    seq = ("seq", "prompt_mask")
    old = ("old_logprobs",) if recompute_logprobs else ()
    train_inputs = seq + ("logprobs", "ref_logprobs", "rewards", "values", "no_eos_mask") + old
    calls = [
        MFC("actor_gen", "actor", "generate", ("prompts",), seq + ("logprobs", "no_eos_mask"), gen,
            multi_turn=multi_turn),
        MFC("rew_inf", "reward", "inference", seq, ("rewards",), batch),
        MFC("ref_inf", "ref", "inference", seq, ("ref_logprobs",), batch),
        MFC("critic_inf", "critic", "inference", seq, ("values",), batch),
    ]
    if recompute_logprobs:
        calls.append(MFC("actor_inf", "actor", "inference", seq, ("old_logprobs",), batch))
    calls += [
        MFC("actor_train", "actor", "train", train_inputs, ("actor_stats",), batch, n_mb),
        MFC("critic_train", "critic", "train", train_inputs, ("critic_stats",), batch, n_mb),
    ]
    return Graph("ppo", tuple(calls))


OUTCOME_ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo")


def outcome_graph(algorithm: str, batch: BatchShape, group_size: int, ppo_minibatches: int = 1,
                  gen_runs: float = 1.0, multi_turn: MultiTurn | None = None) -> Graph:
    """A critic-free outcome-reward algorithm (GRPO, RLOO, REINFORCE++, REINFORCE++-baseline,
    DAPO, GSPO): `group_size` samples per prompt, a reward per sequence, the reference's logprobs
    for a KL term (pruned when the config has none), actor training. gen_runs: expected generation
    rounds per iteration (DAPO's dynamic sampling), charged to generation and reward. multi_turn:
    multi-turn generation (module docstring)."""
    if algorithm not in OUTCOME_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: outcome graphs are {', '.join(OUTCOME_ALGORITHMS)}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: must be >= 1")
    gen, grouped = _shapes(BatchShape(batch.n_seqs * group_size, batch.prompt_len, batch.gen_len), multi_turn)
    gen = replace(gen, prompt_group=group_size)  # generation prefills each prompt once
    # Inference and training forwards hold each prompt once per micro-batch
    # (actors.engine.shared_prefix); a reward model reading other ids gets its own shape
    # (app.config.problem.reward_batch), priced whole.
    shared = replace(grouped, prompt_group=group_size)
    seq = ("seq", "prompt_mask")
    return Graph(algorithm, (
        MFC("actor_gen", "actor", "generate", ("prompts",), seq + ("logprobs", "no_eos_mask"), gen,
            expected_runs=gen_runs, multi_turn=multi_turn),
        MFC("rew_inf", "reward", "inference", seq, ("rewards",), shared, expected_runs=gen_runs),
        MFC("ref_inf", "ref", "inference", seq, ("ref_logprobs",), shared),
        MFC("actor_train", "actor", "train", seq + ("logprobs", "rewards", "ref_logprobs"), ("actor_stats",),
            shared, ppo_minibatches, recompute_forward=ppo_minibatches > 1),
    ))


def grpo_graph(batch: BatchShape, group_size: int, ppo_minibatches: int = 1,
               multi_turn: MultiTurn | None = None) -> Graph:
    """GRPO: `group_size` samples per prompt, group-normalised rewards, no critic."""
    return outcome_graph("grpo", batch, group_size, ppo_minibatches, multi_turn=multi_turn)


def dpo_graph(batch: BatchShape) -> Graph:
    """DPO: reference logprobs of chosen and rejected answers, then actor training on the pairs.

    batch.n_seqs is the number of pairs; each call sees 2 * n_seqs sequences, a pair's two
    answers after one prompt (held once per micro-batch: prompt_group 2).
    """
    pairs = BatchShape(2 * batch.n_seqs, batch.prompt_len, batch.gen_len, prompt_group=2)
    return Graph("dpo", (
        MFC("ref_inf", "ref", "inference", ("pairs",), ("ref_logprobs",), pairs),
        MFC("actor_train", "actor", "train", ("pairs", "ref_logprobs"), ("actor_stats",), pairs),
    ), dataset_keys=("pairs",))


def remax_graph(batch: BatchShape, multi_turn: MultiTurn | None = None) -> Graph:
    """ReMax: sampled and greedy generation, a reward for each, the reference's logprobs for the
    KL penalty in the reward (pruned when ppo.kl_coef is 0), REINFORCE with the greedy baseline.
    multi_turn: both generations are multi-turn (module docstring)."""
    gen, batch = _shapes(batch, multi_turn)
    seq = ("seq", "prompt_mask")
    return Graph("remax", (
        MFC("sample_gen", "actor", "generate", ("prompts",), seq + ("logprobs",), gen, multi_turn=multi_turn),
        MFC("greedy_gen", "actor", "generate", ("prompts",), ("greedy_seq",), gen, multi_turn=multi_turn),
        MFC("rew_inf", "reward", "inference", seq, ("rewards",), batch),
        MFC("greedy_rew_inf", "reward", "inference", ("greedy_seq",), ("greedy_rewards",), batch),
        MFC("ref_inf", "ref", "inference", seq, ("ref_logprobs",), batch),
        # greedy_seq too: the greedy response's no-EOS flag enters the baseline like the sampled one's.
        MFC("actor_train", "actor", "train",
            seq + ("logprobs", "rewards", "greedy_seq", "greedy_rewards", "ref_logprobs"), ("actor_stats",), batch),
    ))


__all__ = ["OUTCOME_ALGORITHMS", "dpo_graph", "grpo_graph", "outcome_graph", "ppo_graph", "remax_graph"]
