"""Pipeline parallelism: micro-batch splitting, a 1F1B training schedule, fill-drain inference.

A packed batch is split into micro-batches by whole sequences (`split_by_tokens`: contiguous,
token-balanced, a pure function of the lengths, so every rank computes the same split and both
ends of a p2p transfer know its shape [T_mb, H] without sending it). Stages exchange hidden
states [T_mb, H] (forward) and their gradients (backward) with torch.distributed isend/irecv
(gloo on CPU, NCCL on GPU), addressed by global rank from ParallelGroups.pp_global_ranks.
Under tensor parallelism every tp rank of a stage talks to the same tp rank of the next stage
(the hidden state is replicated over tp).

Training uses the non-interleaved 1F1B schedule (PipeDream-flush / Megatron): stage r runs
min(pp - r - 1, n_micro) warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards; at most pp - r micro-batches' activations are alive at once.
Inference is fill-drain: forwards only, sends not awaited until the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from actors.engine.model import Transformer
from actors.engine.packing import PackedBatch
from actors.engine.process_groups import ParallelGroups
from actors.engine.shared_prefix import RowMap


def split_by_tokens(lengths: list[int], n_parts: int, group_size: int = 1) -> list[range]:
    """Contiguous ranges of sequence indices, one per part, balanced by token count.

    Cut k (1 <= k < n_parts) falls at the sequence boundary nearest to k/n_parts of the tokens,
    keeping every part non-empty. Deterministic: a pure function of (lengths, n_parts).
    group_size > 1 keeps consecutive groups of that many sequences together (DPO's chosen /
    rejected pairs): cuts fall only at group boundaries, so every part holds whole groups and
    n_parts may be at most len(lengths) // group_size.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: must be >= 1")
    if group_size > 1:
        return _split_groups(lengths, n_parts, group_size)
    n = len(lengths)
    if not 1 <= n_parts <= n:
        raise ValueError(f"n_parts={n_parts}: must be between 1 and the number of sequences ({n})")
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    cuts = [0]
    for k in range(1, n_parts):
        target = prefix[n] * k / n_parts
        # Leave room for the parts still to come, and keep this one non-empty.
        lo, hi = cuts[-1] + 1, n - (n_parts - k)
        best = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(best)
    cuts.append(n)
    return [range(cuts[i], cuts[i + 1]) for i in range(n_parts)]


def _split_groups(lengths: list[int], n_parts: int, group_size: int) -> list[range]:
    """split_by_tokens over whole groups: balance the groups' token sums, then widen the ranges."""
    if len(lengths) % group_size:
        raise ValueError(f"group_size={group_size}: must divide the number of sequences ({len(lengths)})")
    group_lengths = [sum(lengths[g:g + group_size]) for g in range(0, len(lengths), group_size)]
    if not 1 <= n_parts <= len(group_lengths):
        raise ValueError(f"n_parts={n_parts}: must be between 1 and the number of groups of {group_size} "
                         f"sequences ({len(group_lengths)})")
    return [range(part.start * group_size, part.stop * group_size)
            for part in split_by_tokens(group_lengths, n_parts)]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on the device: token ids int64 [T_mb], its boundaries, and the loss inputs
    (per-token [T_mb] and per-sequence [B_mb] tensors keyed by name). With `rows`, tokens and
    packed are a compact stream of shared prefixes and suffixes (actors.engine.shared_prefix),
    and the loss inputs stay per row token [T_rows]."""

    tokens: Tensor
    packed: PackedBatch
    data: dict[str, Tensor] = field(default_factory=dict)
    rows: RowMap | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


class _P2P:
    """Batched isend/irecv of hidden states between neighbouring stages of one pipeline."""

    def __init__(self, groups: ParallelGroups, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups, self.hidden_size, self.dtype, self.device = groups, hidden_size, dtype, device

    def _buffer(self, n_tokens: int) -> Tensor:
        return torch.empty(n_tokens, self.hidden_size, dtype=self.dtype, device=self.device)

    def send_next_async(self, tensor: Tensor) -> list[dist.Work]:
        """Post a send to the next stage without waiting (wait on the returned works later).

        Always batched (batch_isend_irecv), like `exchange`: with NCCL a plain isend would run on
        a separate 2-rank communicator and never meet the peer's batched receive.
        """
        op = dist.P2POp(dist.isend, tensor, self.groups.next_stage_rank, self.groups.pp_group)
        return dist.batch_isend_irecv([op])

    def exchange(self, send_next: Tensor | None = None, send_prev: Tensor | None = None,
                 recv_prev_tokens: int | None = None,
                 recv_next_tokens: int | None = None) -> tuple[Tensor | None, Tensor | None]:
        """Post the given sends and receives together, wait for all; returns (from_prev, from_next)."""
        g = self.groups
        ops: list[dist.P2POp] = []
        from_prev = from_next = None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), g.next_stage_rank, g.pp_group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), g.prev_stage_rank, g.pp_group))
        if recv_prev_tokens is not None:
            from_prev = self._buffer(recv_prev_tokens)
            ops.append(dist.P2POp(dist.irecv, from_prev, g.prev_stage_rank, g.pp_group))
        if recv_next_tokens is not None:
            from_next = self._buffer(recv_next_tokens)
            ops.append(dist.P2POp(dist.irecv, from_next, g.next_stage_rank, g.pp_group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return from_prev, from_next


def _stage_forward(model: Transformer, mb: MicroBatch, received: Tensor | None) -> tuple[Tensor | None, Tensor]:
    """(input that needs a gradient or None on the first stage, the stage's output)."""
    if received is None:
        return None, model(mb.tokens, mb.packed)
    received.requires_grad_(True)
    return received, model(received, mb.packed)


def train_1f1b(model: Transformer, micro_batches: list[MicroBatch], groups: ParallelGroups,
               loss_fn: Callable[[Tensor, MicroBatch], Tensor], hidden_size: int, dtype: torch.dtype) -> None:
    """Forward and backward every micro-batch with the 1F1B schedule, accumulating .grad.

    loss_fn(head_output, micro_batch) -> scalar loss to back-propagate; called on the last stage
    only (head_output: logits [T_mb, V_local] or values [T_mb]). Every rank of the pipeline must
    call this with the same micro-batch split.
    """
    first, last = groups.is_first_stage, groups.is_last_stage
    n = len(micro_batches)
    p2p = _P2P(groups, hidden_size, dtype, micro_batches[0].tokens.device)
    tokens = [mb.n_tokens for mb in micro_batches]

    def forward(i: int, received: Tensor | None) -> tuple[Tensor | None, Tensor]:
        inp, out = _stage_forward(model, micro_batches[i], received)
        return inp, (loss_fn(out, micro_batches[i]) if last else out)

    def backward(inp: Tensor | None, out: Tensor, out_grad: Tensor | None) -> Tensor | None:
        torch.autograd.backward(out, grad_tensors=None if last else out_grad)
        return None if inp is None else inp.grad

    warmup = min(groups.layout.pp - groups.pp_rank - 1, n)
    steady = n - warmup
    pending: deque[tuple[Tensor | None, Tensor]] = deque()
    for i in range(warmup):
        received, _ = p2p.exchange(recv_prev_tokens=None if first else tokens[i])
        inp, out = forward(i, received)
        p2p.exchange(send_next=out.detach())
        pending.append((inp, out))
    received = None
    if steady > 0 and not first:
        received, _ = p2p.exchange(recv_prev_tokens=tokens[warmup])
    for k in range(steady):
        inp, out = forward(warmup + k, received)
        pending.append((inp, out))
        # Send this forward's output and receive the gradient of the oldest outstanding one (k).
        _, out_grad = p2p.exchange(send_next=None if last else out.detach(),
                                   recv_next_tokens=None if last else tokens[k])
        old_inp, old_out = pending.popleft()
        in_grad = backward(old_inp, old_out, out_grad)
        more = k < steady - 1
        received, _ = p2p.exchange(send_prev=in_grad,
                                   recv_prev_tokens=tokens[warmup + k + 1] if more and not first else None)
    for k in range(steady, n):
        _, out_grad = p2p.exchange(recv_next_tokens=None if last else tokens[k])
        old_inp, old_out = pending.popleft()
        p2p.exchange(send_prev=backward(old_inp, old_out, out_grad))


@torch.no_grad()
def forward_fill_drain(model: Transformer, micro_batches: list[MicroBatch], groups: ParallelGroups,
                       head_fn: Callable[[Tensor, MicroBatch], Tensor], hidden_size: int,
                       dtype: torch.dtype) -> list[Tensor]:
    """Forward every micro-batch through the pipeline; returns head_fn(head_output, mb) per
    micro-batch on the last stage and [] elsewhere."""
    first, last = groups.is_first_stage, groups.is_last_stage
    p2p = _P2P(groups, hidden_size, dtype, micro_batches[0].tokens.device)
    results: list[Tensor] = []
    sends: list[tuple[list[dist.Work], Tensor]] = []  # keep each tensor alive until its send completes
    for mb in micro_batches:
        received = None if first else p2p.exchange(recv_prev_tokens=mb.n_tokens)[0]
        out = model(mb.tokens if first else received, mb.packed)
        if last:
            results.append(head_fn(out, mb))
            del out  # this micro-batch's logits go before the next forward allocates its own
        else:
            out = out.contiguous()
            sends.append((p2p.send_next_async(out), out))
    for works, _ in sends:
        for work in works:
            work.wait()
    return results


__all__ = ["MicroBatch", "forward_fill_drain", "split_by_tokens", "train_1f1b"]
