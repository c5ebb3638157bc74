"""Config sections that only training reads: data, reward, sampling, PPO, DPO, tracking, checkpoints.

They sit beside the planning sections of `app.config.experiment` in `ExperimentConfig` (which imports
them from here to keep that module small) and follow its rules: `extra="forbid"`, frozen, and a
bad value surfaces as a `ConfigError` naming the dotted field, the value and what is allowed.
`python -m app plan` ignores them; `python -m app train` checks the ones that need files or
imports (dataset, reward function) in `app.run.runtime.preflight`, before any worker starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KL_CONTROLLERS = ("fixed", "adaptive")
KL_ESTIMATORS = ("k1", "abs", "mse", "k2", "low_var_kl", "k3")
KLEstimator = Literal["k1", "abs", "mse", "k2", "low_var_kl", "k3"]  # the same names, for the config fields
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


class TrainSection(BaseModel):
    # The same rules as app.config._Section (kept separate so this module does not import it).
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


class DataConfig(TrainSection):
    """Prompt dataset: "toy" (the built-in count-on task) or a JSONL / Parquet file.

    tokenizer: "toy" (the toy task's character tokenizer) or an HF model directory.
    max_prompt_len: longest prompt in tokens (None: batch.prompt_len); too_long says what happens
    to longer ones. toy_size / seed: how many toy prompts to generate and the shuffle seed.
    """

    path: str = "toy"
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    tokenizer: str = "toy"
    chat_template: bool = False
    max_prompt_len: int | None = Field(None, ge=1)
    too_long: Literal["error", "drop", "truncate_left"] = "error"
    toy_size: int = Field(1024, ge=1)
    shuffle: bool = True
    seed: int = 0


class RewardConfig(TrainSection):
    """Rule-based reward `module:function` (or `file.py:function`); null uses the reward model
    (models.reward, defaulting to the critic's shape) as a learned reward instead. timeout_s:
    a call of the function (one response) taking longer ends the run, naming the sample."""

    function: str | None = "app.data.rewards:toy_reward"
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0)  # the longest one call of the function may take


class RolloutConfig(TrainSection):
    """Multi-turn rollouts: the actor acts, an environment answers, for up to max_turns turns.

    env: the environment class, 'module:Class' or 'path/to/file.py:Class' (app.envs: `reset(sample)`
    returns the first observation, `step(action_text)` returns (observation, reward, done, info));
    null: single-turn generation scored by reward.function (the default). Each turn samples at
    most batch.gen_len tokens; the observation's ids (the chat-template delta when
    data.chat_template is on, else its plain tokens, at most max_observation_tokens: longer ones
    are truncated and counted) are appended after them and masked out of every loss.
    max_response_tokens: the whole trajectory after the prompt, sampled and observed tokens
    together (null: max_turns * (batch.gen_len + max_observation_tokens)); a trajectory that
    reaches it ends, counted. env_timeout_s: one reset or step taking longer ends that trajectory
    (counted, reason kept), never the run; env_workers: threads per generation worker stepping
    environments beside the decode loop (threads cost little for environments that wait on a tool,
    a sandbox or the network; trajectories of a turn that outnumber them queue, so a 20 ms step
    over 512 trajectories and 8 threads waits 1.3 s; CPU-bound Python environments share the
    GIL). observation_role: the chat role of observations ("user", or "tool" for tool results).
    reward_discount: per-step rewards summed as sum_t discount^t r_t into the trajectory's outcome
    reward. env_step_s: the planner's guess of one environment step's seconds before a run
    measures it (recalibration replaces it).
    env_kwargs: keyword arguments for the environment's constructor.
    """

    env: str | None = None
    env_kwargs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    max_turns: int = Field(4, ge=1, le=1024)
    max_observation_tokens: int = Field(64, ge=1)
    max_response_tokens: int | None = Field(None, ge=2)
    env_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    env_workers: int = Field(64, ge=1, le=4096)
    observation_role: Literal["user", "tool"] = "user"
    reward_discount: float = Field(1.0, ge=0.0, le=1.0)
    env_step_s: float = Field(0.01, ge=0.0)

    def response_budget(self, gen_len: int) -> int:
        """Tokens a trajectory may hold after its prompt (sampled and observed together)."""
        if self.max_response_tokens is not None:
            return self.max_response_tokens
        return self.max_turns * (gen_len + self.max_observation_tokens)


class SamplingConfig(TrainSection):
    """How the actor samples during generation (gen length is batch.gen_len). temperature 0 = greedy.

    compile: on CUDA, run the decode step through torch.compile under its CUDA graph (fuses the
    small elementwise kernels of a step; costs a compile per generation shape on first use). On
    by default: 5% faster decode on an H200 at the peer bench's shape (docs/benchmarks.md, issue
    27); ignored on CPU.
    fp8: decode with FP8 (e4m3) copies of the actor's MLP and head weights, quantized at the start
    of every generation call (actors.generation.fp8_weights); prefill, training and every other
    call keep bf16. The responses are then sampled from a slightly different policy than the one
    trained, so ppo.rollout_is 'auto' turns on token-level importance weights with it. Off by
    default: it changes what is sampled (docs/benchmarks.md, issue 27, has its speed and gap).
    Needs a GPU with FP8 matmuls (compute capability >= 8.9: the h100-80g and h200-141g presets);
    a cluster.gpu without them is refused, and so is such a GPU at run time. The CPU emulates it
    (slower, same numbers), which is how the tests run it.
    kv_cache_dtype: auto (the actor's dtype) or fp8 (e4m3 without a scale: half the KV cache's
    memory and of decode attention's reads; K/V rounded to 3 mantissa bits). Like fp8, it makes
    ppo.rollout_is 'auto' turn importance weights on. On GPUs below compute capability 8.9 (A100)
    Triton has no e4m3, so the cache is read by the slower SDPA decode path there.
    compact_fraction: once the rows still generating are at most this fraction of the decode
    step's rows, the finished ones leave the step (their cache moves out, a smaller step goes
    on; the samples do not change). 0 keeps every row to the end. Pays where responses end at
    different lengths: 1.66x faster decode on an H100 with lengths of mean 178 of 512
    (docs/benchmarks.md, issue 27, nineteenth step). Single- and multi-turn generation, not under pp.
    """

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    compile: bool = True
    fp8: bool = False
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    compact_fraction: float = Field(0.75, ge=0.0, lt=1.0)

    @property
    def lossy_rollout(self) -> bool:
        """Whether generation samples from a rounded copy of the actor (FP8 weights or cache)."""
        return self.fp8 or self.kv_cache_dtype == "fp8"


class PPOConfig(TrainSection):
    """PPO hyperparameters (minibatches and epochs are batch.ppo_minibatches / batch.ppo_epochs);
    every algorithm that generates reads its policy-loss knobs.

    kl_coef: weight of the KL penalty folded into the rewards; kl_controller adaptive adjusts it
    towards kl_target, a per-token KL (actor/kl is a per-token mean; veRL's 0.1), over kl_horizon
    sequences (Ziegler et al.). gamma / lam: GAE. clip_eps / value_clip_eps: PPO ratio and value
    clipping; clip_eps_high: DAPO's clip-higher upper bound (null: clip_eps; 0.28 for dapo);
    dual_clip: cap on the loss of negative advantages (> 1, null: off). adv_norm: whiten
    advantages. entropy_coef: entropy bonus. no_eos_penalty: subtracted from the score of a
    response cut at batch.gen_len. recompute_logprobs: the behaviour policy is the actor's own
    logprobs under its current weights (PPO's actor_inf call), not the generation's.
    rollout_is: truncated importance weights for the gap between the rollout's logprobs and those
    (token | sequence | none; auto: token when run.max_staleness > 0, or when sampling.fp8 or
    sampling.kv_cache_dtype fp8 is on and recompute_logprobs is true; else none), truncated at
    rollout_is_threshold.
    """

    actor_lr: float = Field(1e-5, gt=0.0, le=1.0)
    critic_lr: float = Field(5e-5, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    kl_coef: float = Field(0.05, ge=0.0)
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = Field(0.1, gt=0.0)
    kl_horizon: int = Field(10000, ge=1)
    kl_estimator: KLEstimator = "k1"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    clip_eps: float = Field(0.2, gt=0.0)
    value_clip_eps: float = Field(0.2, gt=0.0)
    adv_norm: bool = True
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    clip_eps_high: float | None = Field(None, gt=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    no_eos_penalty: float = Field(0.0, ge=0.0)
    recompute_logprobs: bool = True
    rollout_is: Literal["auto", "none", "token", "sequence"] = "auto"
    rollout_is_threshold: float = Field(2.0, ge=1.0)


class GRPOConfig(TrainSection):
    """GRPO (algorithm: grpo): the KL to the reference is a loss term, not a reward penalty
    (ppo.kl_coef does not apply). kl_loss_coef / kl_loss_estimator as veRL's actor.kl_loss_coef
    (0.001) and kl_loss_type (low_var_kl); scale_by_std: divide the group-centred rewards by the
    group's std (False: Dr. GRPO). The group size is batch.group_size; clipping, epochs,
    minibatches and loss aggregation come from the ppo section."""

    kl_loss_coef: float = Field(0.001, ge=0.0)
    kl_loss_estimator: KLEstimator = "low_var_kl"
    scale_by_std: bool = True


class DAPOConfig(TrainSection):
    """DAPO (algorithm: dapo, Yu et al. 2025): GRPO advantages with clip-higher
    (ppo.clip_eps_high, 0.28 unless set), the token-mean loss (ppo.loss_agg), overlong shaping and
    dynamic sampling. overlong_buffer: the last tokens before batch.gen_len over which the score
    falls linearly by up to overlong_penalty (0: off). dynamic_sampling: drop groups whose rewards
    are all equal and generate more prompts until batch.prompts groups remain, at most
    max_gen_rounds rounds (then the batch is filled with dropped groups); the planner charges
    generation 1 / (1 - expected_drop_rate) rounds. Its KL is grpo.kl_loss_coef (DAPO: 0)."""

    overlong_buffer: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0.0)
    dynamic_sampling: bool = True
    max_gen_rounds: int = Field(4, ge=1)
    expected_drop_rate: float = Field(0.3, ge=0.0, lt=1.0)


class GSPOConfig(TrainSection):
    """GSPO (algorithm: gspo, Zheng et al. 2025): GRPO advantages, one importance ratio per
    sequence (the mean token log-ratio) clipped to [1 - clip_eps, 1 + clip_eps_high]; these ranges
    replace ppo.clip_eps for GSPO. Its KL is grpo.kl_loss_coef."""

    clip_eps: float = Field(3e-4, gt=0.0)
    clip_eps_high: float = Field(4e-4, gt=0.0)


class DPOConfig(TrainSection):
    """DPO (algorithm: dpo). beta: strength of the implicit KL to the reference; label_smoothing:
    conservative DPO's assumed label noise; lr: the actor's learning rate. Preference files
    (data.path) hold data.prompt_key, chosen_key and rejected_key fields per line; data.path "toy"
    generates the built-in toy pairs (app/algorithms/dpo.py)."""

    beta: float = Field(0.1, gt=0.0)
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    lr: float = Field(1e-6, gt=0.0, le=1.0)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


class TrackingConfig(TrainSection):
    """Where metrics go: always metrics.jsonl; the console line and W&B (offline without an API key)."""

    project: str = "realray"
    wandb: bool = True
    console: bool = True


class CheckpointConfig(TrainSection):
    """Checkpoints under <run dir>/checkpoints/iter_N: HF exports of the trained models plus what
    an exact resume needs. every: after every N iterations (0: never in between; a recovered
    worker failure resumes from the last one, so 0 restarts from iteration 0); at_end: after
    the last; keep: the newest K complete checkpoints stay, older ones are deleted (0: all)."""

    every: int = Field(10, ge=0)
    at_end: bool = True
    keep: int = Field(2, ge=0)


__all__ = [
    "CheckpointConfig", "DAPOConfig", "DPOConfig", "DataConfig", "GSPOConfig", "KL_CONTROLLERS", "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS", "PPOConfig", "RewardConfig", "RolloutConfig", "SamplingConfig", "TrackingConfig",
    "TrainSection",
]
