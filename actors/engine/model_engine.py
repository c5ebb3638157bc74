"""ModelEngine: one rank's model shard under a (dp, tp, pp) layout, with train and inference steps.

Batches (`SequenceBatch`) are packed token streams plus named per-token [T] and per-sequence
[B] tensors. Every rank of the mesh is given the same global batch; dp rank d keeps the
sequences `split_by_tokens(lengths, dp)[d]` (contiguous, token-balanced) and splits them again
into micro-batches, so the split is identical on all ranks without talking. The number of
micro-batches of a share of N tokens is max(n_micro, ceil(N / micro_batch_tokens)) when a token
budget is given (what the plan's `CallExecution` says), else n_micro; never more than the
share's sequences (groups). Inference reduces each micro-batch's logits [T_mb, V/tp] to [T_mb]
before the next one runs, so at most one micro-batch of logits exists at a time.

Output convention (the one of actors.rl.advantages): entry i is about token i.
  forward_logprobs: logprobs[i] = log p(token_i | tokens before it in its sequence); each
                    sequence's first entry is 0 (nothing predicts it).
  forward_values (shift=True, critics): values[i] = V(state before token i) = the value head at
                    position i - 1; first entry 0. shift=False (reward models): the head's output
                    at position i, so a sequence's score is its entry at its last token.

Loss normalisation rule (exactly the serial full-batch gradient under any layout and any
micro-batch count): `loss_fn(out [T_mb], data) -> LossSums` (actors.rl.losses) returns SUMS and
a count. Each micro-batch back-propagates its un-normalised sum; the counts are summed over
micro-batches and dp; the optimizer multiplies the dp-summed gradient by 1 / global count before
clipping. Metrics are reported the same way: loss and each statistic summed, divided by the
global count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from actors.engine.logprobs import (
    shift_to_token_positions,
    token_logprobs,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from actors.engine.model import Transformer
from actors.engine.optimizer import AdamWConfig, ShardedAdamW
from actors.engine.packing import PackedBatch
from actors.engine.parallelize import (
    build_model_shard,
    named_trainable_parameters,
    norm_excluded_names,
    sync_model_parallel_grads,
)
from actors.engine.pipeline import MicroBatch, forward_fill_drain, split_by_tokens, train_1f1b
from actors.engine.process_groups import ParallelGroups
from actors.engine.shared_prefix import head_targets, rows_at_positions, rows_per_token, shared_layout
from actors.rl import LossSums
from planning.models import ModelSpec

LossFn = Callable[[Tensor, dict[str, Tensor]], LossSums]


class TokenIdError(ValueError):
    """Token ids outside a model's vocabulary, found on the host before they reach its embedding
    (where they would be a CUDA device-side assert, or an IndexError on CPU)."""


def check_token_ids(tokens: Tensor, vocab_size: int, what: str) -> None:
    """TokenIdError naming `what`, the offending id and the vocabulary unless every id of `tokens`
    is in [0, vocab_size). One min/max over the ids (on the host for the engine's batches, which
    are moved to the device micro-batch by micro-batch): microseconds per thousand tokens."""
    if tokens.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(tokens))
    if 0 <= low and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    raise TokenIdError(f"{what}: token id {bad} (largest {high}) is outside its vocabulary of {vocab_size} ids "
                       f"(0..{vocab_size - 1}); the ids come from a tokenizer this model does not share "
                       "(see models.<role>.tokenizer)")


@dataclass(frozen=True)
class SequenceBatch:
    """A packed batch on the host or device.

    tokens: int64 [T]; lengths: per-sequence token counts (sum T); token_data: per-token [T, ...]
    tensors (loss masks, advantages, old logprobs); seq_data: per-sequence [B, ...] tensors.
    group_size: consecutive sequences that dp and micro-batch splits never separate (2 for DPO's
    chosen/rejected pairs; B must be a multiple of it).
    prefix_lengths: per sequence, how many leading tokens (its prompt) it may share with the
    sequences next to it: a micro-batch then holds each shared prompt once
    (actors.engine.shared_prefix); None: every sequence on its own.
    """

    tokens: Tensor
    lengths: tuple[int, ...]
    token_data: dict[str, Tensor] = field(default_factory=dict)
    seq_data: dict[str, Tensor] = field(default_factory=dict)
    group_size: int = 1
    prefix_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        total = sum(self.lengths)
        if self.tokens.dim() != 1 or self.tokens.numel() != total:
            raise ValueError(f"tokens: shape {tuple(self.tokens.shape)}; must be [sum(lengths)] = [{total}]")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths={self.lengths}: need at least one sequence, each of length >= 1")
        if self.group_size < 1 or len(self.lengths) % self.group_size:
            raise ValueError(f"group_size={self.group_size}: must be >= 1 and divide the {len(self.lengths)} sequences")
        if self.prefix_lengths is not None and len(self.prefix_lengths) != len(self.lengths):
            raise ValueError(f"prefix_lengths: {len(self.prefix_lengths)} entries; must be one per sequence "
                             f"({len(self.lengths)})")
        for name, value in self.token_data.items():
            if value.shape[:1] != (total,):
                raise ValueError(f"token_data[{name!r}]: shape {tuple(value.shape)}; must start with T={total}")
        for name, value in self.seq_data.items():
            if value.shape[:1] != (len(self.lengths),):
                raise ValueError(f"seq_data[{name!r}]: shape {tuple(value.shape)}; "
                                 f"must start with B={len(self.lengths)}")

    def select(self, seqs: range) -> SequenceBatch:
        """The contiguous sub-batch of sequences `seqs`."""
        start = sum(self.lengths[:seqs.start])
        end = start + sum(self.lengths[seqs.start:seqs.stop])
        return SequenceBatch(
            tokens=self.tokens[start:end],
            lengths=tuple(self.lengths[seqs.start:seqs.stop]),
            token_data={k: v[start:end] for k, v in self.token_data.items()},
            seq_data={k: v[seqs.start:seqs.stop] for k, v in self.seq_data.items()},
            group_size=self.group_size,
            prefix_lengths=None if self.prefix_lengths is None else self.prefix_lengths[seqs.start:seqs.stop],
        )

    def micro_batch(self, device: torch.device | str, share_prefixes: bool = True) -> MicroBatch:
        """On `device`, with the loss inputs merged into one dict (plus the rows' "cu_seqlens"
        int32 [B+1]); with prefix_lengths and `share_prefixes`, as a compact stream of shared
        prefixes where neighbouring rows share one (`shared_layout`)."""
        packed = PackedBatch.from_lengths(list(self.lengths), device)
        data = {k: v.to(device) for k, v in {**self.token_data, **self.seq_data}.items()}
        data["cu_seqlens"] = packed.cu_seqlens
        if self.prefix_lengths is not None and share_prefixes:
            compact = shared_layout(self.tokens, self.lengths, self.prefix_lengths, device)
            if compact is not None:
                return MicroBatch(compact[0], compact[1], data, compact[2])
        return MicroBatch(self.tokens.to(device), packed, data)


def _about_next_token(per_position: Tensor, mb: MicroBatch) -> Tensor:
    """Head outputs about the next token -> [T_mb] per (row) token in the token convention: shifted
    by one inside each sequence, or through the row map of a compact micro-batch."""
    if mb.rows is None:
        return shift_to_token_positions(per_position, mb.packed.cu_seqlens)
    return rows_per_token(per_position, mb.packed, mb.rows)


class ModelEngine:
    """One rank's shard of an actor or critic, its groups and (for training) its optimizer.

    Every rank of the layout's mesh calls the same methods with the same arguments in the same
    order (they are collective over the mesh).
    """

    def __init__(self, spec: ModelSpec, critic: bool, groups: ParallelGroups, device: torch.device | str,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0,
                 optim_config: AdamWConfig | None = None, model: Transformer | None = None,
                 optimizer_host_fraction: float = 0.0) -> None:
        self.spec, self.critic, self.groups = spec, critic, groups
        self.device, self.dtype = torch.device(device), dtype
        coords = (groups.dp_rank, groups.tp_rank, groups.pp_rank)
        # A given model (e.g. filled by a checkpoint load or a reallocation) must be this rank's shard.
        self.model = model if model is not None else build_model_shard(
            spec, critic, groups.layout, coords, groups, self.device, dtype, seed)
        self.optim_config = optim_config
        # Fraction of the optimizer state kept in host memory (the plan's optimizer_offload).
        self.optimizer_host_fraction = optimizer_host_fraction
        self._optimizer: ShardedAdamW | None = None
        if groups.pp_group is not None:
            # A first collective over the pipeline group sets up its communicator on every member
            # (NCCL needs this before batched p2p calls that involve only some of them).
            dist.all_reduce(torch.zeros(1, device=self.device), group=groups.pp_group)

    @property
    def optimizer(self) -> ShardedAdamW:
        """The ZeRO-1 optimizer, created on first use so that its fp32 master copy is taken from
        the weights as they are then (after any checkpoint load). Call its `reload_master()` after
        overwriting the weights later."""
        if self._optimizer is None:
            if self.optim_config is None:
                raise ValueError("optimizer: this engine was built without optim_config and none was set")
            self._optimizer = ShardedAdamW(named_trainable_parameters(self.model), self.optim_config,
                                           self.groups.dp_group, self.groups.mesh_group,
                                           norm_excluded_names(self.model, self.spec, self.groups),
                                           self.optimizer_host_fraction)
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: ShardedAdamW) -> None:
        """Install an optimizer built elsewhere (e.g. after a checkpoint load)."""
        self._optimizer = optimizer

    def drop_optimizer(self) -> None:
        """Forget the optimizer (its state moved with the model's home to another placement)."""
        self._optimizer = None

    # ---- batch splitting -------------------------------------------------------------------------
    def check_token_ids(self, batch: SequenceBatch, step: str) -> None:
        """Every id of the whole batch inside this model's vocabulary (`check_token_ids`), once per
        train step or forward, before any rank touches its embedding: all ranks see the same batch,
        so they all raise together and none waits in a collective for the others."""
        kind = "critic/reward model" if self.critic else "model"
        check_token_ids(batch.tokens, self.spec.vocab_size, f"{step} of {kind} {self.spec.name!r}")

    def dp_share(self, batch: SequenceBatch) -> SequenceBatch:
        """The sequences of `batch` this dp rank processes."""
        parts = split_by_tokens(list(batch.lengths), self.groups.layout.dp, batch.group_size)
        return batch.select(parts[self.groups.dp_rank])

    def micro_batch_split(self, share: SequenceBatch, n_micro: int = 1,
                          micro_batch_tokens: int | None = None) -> list[range]:
        """Sequence ranges of the micro-batches of a dp share (see the module docstring)."""
        if n_micro < 1:
            raise ValueError(f"n_micro={n_micro}: must be >= 1")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={micro_batch_tokens}: must be >= 1 or None")
        count = n_micro
        if micro_batch_tokens is not None:
            count = max(count, -(-share.tokens.numel() // micro_batch_tokens))
        n_groups = len(share.lengths) // share.group_size
        return split_by_tokens(list(share.lengths), min(count, n_groups), share.group_size)

    def _micro_batches(self, share: SequenceBatch, n_micro: int, micro_batch_tokens: int | None) -> list[MicroBatch]:
        # A sliding window's masks are positional; the compact stream's attention has none.
        share_prefixes = self.spec.sliding_window is None
        return [share.select(part).micro_batch(self.device, share_prefixes)
                for part in self.micro_batch_split(share, n_micro, micro_batch_tokens)]

    # ---- heads -------------------------------------------------------------------------------------
    def _per_token(self, out: Tensor, mb: MicroBatch, temperature: float, shift: bool) -> Tensor:
        """Head output -> float32 [T_mb] in the token convention (see module docstring)."""
        if self.critic:
            if not shift:
                return out if mb.rows is None else rows_at_positions(out, mb.rows)
            return _about_next_token(out, mb)
        if mb.rows is None:
            return token_logprobs(out, mb.tokens, mb.packed.cu_seqlens, self.groups.tp_group, temperature)
        # A compact micro-batch's head rows [T_c + B]: each predicts its own target (shared_prefix).
        targets = head_targets(mb.tokens, mb.packed, mb.rows)
        return _about_next_token(vocab_parallel_logprobs(out, targets, self.groups.tp_group, temperature), mb)

    # ---- training ----------------------------------------------------------------------------------
    def backward_step(self, batch: SequenceBatch, loss_fn: LossFn, n_micro: int = 1, temperature: float = 1.0,
                      with_entropy: bool = False, shift_values: bool = True,
                      micro_batch_tokens: int | None = None,
                      grad_of: Callable[[str], Tensor | None] | None = None) -> tuple[dict[str, float], float]:
        """Forward + backward over this rank's share, leaving un-normalised gradient sums in .grad
        or, inside the optimizer's fp32_accumulation, in its fp32 main_grad (grad_of finds them)
        (tp/tied-embedding fix-ups applied, dp not yet reduced). Returns (metrics, global count).

        loss_fn gets (logprobs or values [T_mb], data) where data holds the micro-batch's
        token_data and seq_data, "cu_seqlens" and, with `with_entropy` (actors only), the
        differentiable per-token "entropy" [T_mb] in the same token convention.
        """
        sums: list[LossSums] = []

        def micro_loss(out: Tensor, mb: MicroBatch) -> Tensor:
            data = dict(mb.data)
            if with_entropy and not self.critic:
                data["entropy"] = _about_next_token(vocab_parallel_entropy(out, self.groups.tp_group, temperature), mb)
            result = loss_fn(self._per_token(out, mb, temperature, shift_values), data)
            sums.append(result)
            return result.loss

        self.check_token_ids(batch, "train step")
        micro = self._micro_batches(self.dp_share(batch), n_micro, micro_batch_tokens)
        train_1f1b(self.model, micro, self.groups, micro_loss, self.spec.hidden_size, self.dtype)
        sync_model_parallel_grads(self.model, self.groups, grad_of)
        return self._reduce_metrics(sums)

    def _reduce_metrics(self, sums: list[LossSums]) -> tuple[dict[str, float], float]:
        """Sum the last stage's loss sums over micro-batches and dp (maxima: their max), share them
        along the pipeline. Returns (loss and stats divided by the global count, maxima as they
        are; the global count)."""
        g = self.groups
        payload: list[object] = [None]
        if g.is_last_stage:
            keys, max_keys = sorted(sums[0].stats), sorted(sums[0].maxima)
            values = torch.stack([
                torch.stack([s.loss.detach().float(), s.count.float(), *[s.stats[k].float() for k in keys]])
                for s in sums
            ]).sum(dim=0)
            maxima = (torch.stack([torch.stack([s.maxima[k].float() for k in max_keys]) for s in sums]).amax(dim=0)
                      if max_keys else None)
            if g.dp_group is not None:
                dist.all_reduce(values, group=g.dp_group)
                if maxima is not None:
                    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=g.dp_group)
            payload = [(keys, values.tolist(), max_keys, [] if maxima is None else maxima.tolist())]
        if g.pp_group is not None:
            dist.broadcast_object_list(payload, src=g.last_stage_rank, group=g.pp_group)
        keys, values, max_keys, max_values = payload[0]
        loss, count, stats = values[0], values[1], values[2:]
        denom = count if count > 0 else 1.0
        metrics = {"loss": loss / denom, "count": count, **{k: v / denom for k, v in zip(keys, stats)},
                   **dict(zip(max_keys, max_values))}
        return metrics, count

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, n_micro: int = 1, temperature: float = 1.0,
                   with_entropy: bool = False, shift_values: bool = True,
                   micro_batch_tokens: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch`; returns loss, statistics, grad_norm and lr. Gradients of
        bf16/fp16 parameters are summed over micro-batches in fp32 (the optimizer's main_grad).
        A non-finite loss (the same on every rank: reduced over the mesh) skips the update."""
        optimizer = self.optimizer
        optimizer.zero_grad()
        with optimizer.fp32_accumulation():
            metrics, count = self.backward_step(batch, loss_fn, n_micro, temperature, with_entropy, shift_values,
                                                micro_batch_tokens, optimizer.grad_of)
        finite = math.isfinite(metrics["loss"])
        metrics.update(optimizer.step(grad_scale=1.0 / count if count > 0 else 0.0, skip=not finite))
        return metrics

    # ---- inference ---------------------------------------------------------------------------------
    def _forward(self, batch: SequenceBatch, n_micro: int, temperature: float, shift: bool, gather_dp: bool,
                 micro_batch_tokens: int | None) -> Tensor:
        self.check_token_ids(batch, "forward_values" if self.critic else "forward_logprobs")
        share = self.dp_share(batch)
        micro = self._micro_batches(share, n_micro, micro_batch_tokens)
        self.model.eval()
        try:
            outs = forward_fill_drain(self.model, micro, self.groups,
                                      lambda out, mb: self._per_token(out, mb, temperature, shift),
                                      self.spec.hidden_size, self.dtype)
        finally:
            self.model.train()
        g = self.groups
        local = torch.cat(outs) if outs else torch.empty(share.tokens.numel(), device=self.device)
        if g.pp_group is not None:
            dist.broadcast(local, src=g.last_stage_rank, group=g.pp_group)
        if not gather_dp or g.dp_group is None:
            return local
        return self._gather_dp(local, batch)

    def _gather_dp(self, local: Tensor, batch: SequenceBatch) -> Tensor:
        """Concatenate every dp rank's [T_share] output in dp order -> [T]."""
        parts = split_by_tokens(list(batch.lengths), self.groups.layout.dp, batch.group_size)
        sizes = [sum(batch.lengths[p.start:p.stop]) for p in parts]
        padded = torch.zeros(max(sizes), dtype=local.dtype, device=local.device)
        padded[:local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=self.groups.dp_group)
        return torch.cat([g[:n] for g, n in zip(gathered, sizes)])

    def forward_logprobs(self, batch: SequenceBatch, n_micro: int = 1, temperature: float = 1.0,
                         gather_dp: bool = True, micro_batch_tokens: int | None = None) -> Tensor:
        """float32 [T] token logprobs (module docstring), on every rank; [T_share] without gather_dp."""
        if self.critic:
            raise ValueError("forward_logprobs: this engine holds a critic; use forward_values")
        return self._forward(batch, n_micro, temperature, False, gather_dp, micro_batch_tokens)

    def forward_values(self, batch: SequenceBatch, n_micro: int = 1, shift: bool = True,
                       gather_dp: bool = True, micro_batch_tokens: int | None = None) -> Tensor:
        """float32 [T] values (critic, shift=True) or per-position scores (reward, shift=False)."""
        if not self.critic:
            raise ValueError("forward_values: this engine holds an actor; use forward_logprobs")
        return self._forward(batch, n_micro, 1.0, shift, gather_dp, micro_batch_tokens)


__all__ = ["LossFn", "ModelEngine", "SequenceBatch", "TokenIdError", "check_token_ids"]
