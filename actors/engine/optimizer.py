"""AdamW with fp32 master weights and optimizer state sharded over data parallelism (ZeRO-1).

Model parameters live in the training dtype (bf16 on GPU, fp32 on CPU). The optimizer lays the
shard's parameters end to end in one flat fp32 vector of N elements (padded to N_pad, a multiple
of dp) and dp rank r owns the contiguous slice [r * S, (r + 1) * S), S = N_pad / dp: the fp32
master copy of those elements and AdamW's m and v. One step:

  1. flatten the gradients into an fp32 [N_pad] buffer, reduce-scatter (SUM) over dp -> [S];
  2. multiply by grad_scale (the engine passes 1 / global loss count, see engine.py);
  3. global gradient norm: squared slices summed over the whole mesh (dp x tp x pp), each
     element counted once: parameters replicated over tp are counted on tp rank 0 only and the
     last stage's copy of a tied embedding not at all (`norm_excluded` names them);
  4. clip, AdamW update of the master slice (decoupled weight decay, not on 1-D params:
     norms and biases);
  5. all-gather the master slices over dp and copy them into the parameters (cast to their dtype).

Gradients are SUMMED over dp, never averaged: the engine normalises the loss globally.
The learning rate follows linear warmup then cosine decay (`lr_at`).

Accumulation over micro-batches (`fp32_accumulation`): each micro-batch back-propagates an
un-normalised sum, so a bf16 `.grad` that accumulated them would be rounded to bf16 after every
addition (relative error growing with the micro-batch count). Inside the context, a hook moves
each low-precision parameter's `.grad` after every backward into an fp32 buffer [N_pad] laid out
like the flat gradient of step 1 (Megatron's main_grad) and frees it; step 1 then reads that
buffer. fp32 parameters (CPU runs) accumulate in their own `.grad` as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from actors.engine.process_groups import group_rank, group_size


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters and the learning-rate schedule.

    total_steps: steps of the whole run for the cosine decay (None keeps lr constant after warmup).
    max_grad_norm: clip threshold for the global gradient norm (None disables clipping).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"AdamWConfig.lr={self.lr}: must be >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas={self.betas}: each must be in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"AdamWConfig eps={self.eps}, weight_decay={self.weight_decay}: eps > 0, decay >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"AdamWConfig.max_grad_norm={self.max_grad_norm}: must be > 0 or None")
        if self.warmup_steps < 0:
            raise ValueError(f"AdamWConfig.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.total_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(f"AdamWConfig.total_steps={self.total_steps}: must be >= warmup_steps={self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"AdamWConfig.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")


def adamw_config_from(owner: str, values: dict[str, object]) -> AdamWConfig:
    """An AdamWConfig from a plain dict (as sent over Ray); unknown keys raise naming `owner`."""
    allowed = set(AdamWConfig.__dataclass_fields__)
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"optim for {owner}: unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}")
    fields = dict(values)
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])  # type: ignore[arg-type]
    return AdamWConfig(**fields)  # type: ignore[arg-type]


def lr_at(config: AdamWConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr over warmup_steps,
    then cosine decay to lr * min_lr_ratio at total_steps (constant lr when total_steps is None)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.total_steps is None or config.total_steps == config.warmup_steps:
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# What ShardedAdamW keeps per element of its slice (each a fp32 [S] tensor of the same name).
OPTIMIZER_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _reduce_scatter_flat(out: Tensor, flat: Tensor, group: ProcessGroup) -> None:
    """out [S] = this rank's slice of flat [S * world] summed over the group."""
    # reduce_scatter_single is the newer name (torch >= 2.12); older torch has only _tensor.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, flat, group=group)


def _all_gather_flat(full: Tensor, part: Tensor, group: ProcessGroup) -> None:
    """full [S * world] = every rank's part [S] in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(full, part, group=group)


class ShardedAdamW:
    """ZeRO-1 AdamW over the parameters of one model shard (see the module docstring).

    params: (name, parameter) of the shard, in a fixed order identical on every dp rank.
    dp_group: the ranks holding the same shard; norm_group: every rank of the mesh (None when
    alone). norm_excluded: names whose gradient must not be counted in the norm on this rank.
    """

    def __init__(self, params: list[tuple[str, nn.Parameter]], config: AdamWConfig,
                 dp_group: ProcessGroup | None, norm_group: ProcessGroup | None,
                 norm_excluded: frozenset[str] = frozenset()) -> None:
        if not params:
            raise ValueError("ShardedAdamW: params is empty")
        unknown = norm_excluded - {name for name, _ in params}
        if unknown:
            raise ValueError(f"norm_excluded names {sorted(unknown)}: not among the parameters")
        self.config = config
        self.names = [name for name, _ in params]
        self.params = [p for _, p in params]
        self.dp_group, self.norm_group = dp_group, norm_group
        self.steps_done = 0
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        dp = group_size(dp_group)
        self.n_elements = total
        self.slice_size = -(-total // dp)  # S: ceil(N / dp)
        self.lo = group_rank(dp_group) * self.slice_size
        device = self.params[0].device
        # Where in this rank's slice weight decay applies (matrices) and which gradient elements
        # count in the norm, as [start, end) ranges: per-element fp32 flags would cost 8 bytes per
        # parameter on every GPU holding the model (9.2 GiB for a 1.24B model).
        self.decay_ranges = self._slice_ranges([p.dim() >= 2 for p in self.params])
        self.norm_ranges = self._slice_ranges([name not in norm_excluded for name in self.names])
        self.master = torch.zeros(self.slice_size, dtype=torch.float32, device=device)
        self.reload_master()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.main_grad: Tensor | None = None  # fp32 [N_pad] while gradients accumulate (fp32_accumulation)

    def _slice_ranges(self, selected: list[bool]) -> list[tuple[int, int]]:
        """[start, end) ranges of this rank's slice covered by the selected parameters, adjacent
        ones merged (in slice coordinates, clipped to the slice)."""
        ranges: list[tuple[int, int]] = []
        hi = self.lo + self.slice_size
        for p, offset, chosen in zip(self.params, self.offsets, selected):
            start, end = max(offset, self.lo) - self.lo, min(offset + p.numel(), hi) - self.lo
            if not chosen or start >= end:
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    def _gather_slice(self, flats: list[Tensor], device: torch.device) -> Tensor:
        """fp32 [S]: elements [lo, lo + S) of the concatenation of `flats` (zeros past N)."""
        out = torch.zeros(self.slice_size, dtype=torch.float32, device=device)
        hi = self.lo + self.slice_size
        for offset, flat in zip(self.offsets, flats):
            start, end = max(offset, self.lo), min(offset + flat.numel(), hi)
            if start < end:
                out[start - self.lo:end - self.lo] = flat[start - offset:end - offset]
        return out

    @torch.no_grad()
    def reload_master(self) -> None:
        """Take the fp32 master slice from the parameters' current values (after they were
        overwritten, e.g. by a checkpoint load); AdamW's m and v are kept."""
        self.master.copy_(self._gather_slice([p.detach().float().flatten() for p in self.params], self.master.device))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.main_grad = None

    @contextmanager
    def fp32_accumulation(self) -> Iterator[None]:
        """Accumulate the gradients of parameters below fp32 in `main_grad` (module docstring)."""
        low = [(p, offset) for p, offset in zip(self.params, self.offsets) if p.dtype != torch.float32]
        if not low:
            yield
            return
        if self.main_grad is None:
            dp = group_size(self.dp_group)
            self.main_grad = torch.zeros(self.slice_size * dp, dtype=torch.float32, device=self.master.device)
        main = self.main_grad
        handles = [p.register_post_accumulate_grad_hook(_mover(main[offset:offset + p.numel()].view(p.shape)))
                   for p, offset in low]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def grad_of(self, name: str) -> Tensor | None:
        """The gradient accumulated so far for parameter `name`: its fp32 main_grad view inside
        fp32_accumulation, else its .grad (None when it has none)."""
        index = self.names.index(name)
        p, offset = self.params[index], self.offsets[index]
        if self.main_grad is not None and p.dtype != torch.float32:
            return self.main_grad[offset:offset + p.numel()].view(p.shape)
        return p.grad

    def reduced_grad(self) -> Tensor:
        """fp32 [S]: this rank's slice of the gradient summed over dp (before grad_scale)."""
        dp = group_size(self.dp_group)
        # The fp32 accumulation buffer is the flat gradient itself (no second [N_pad] copy);
        # the optimizer drops it here, so it does not stay allocated between calls.
        flat, self.main_grad = self.main_grad, None
        if flat is None:
            flat = torch.zeros(self.slice_size * dp, dtype=torch.float32, device=self.master.device)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[offset:offset + p.numel()] += p.grad.flatten()
        if dp == 1:
            return flat
        out = torch.empty(self.slice_size, dtype=torch.float32, device=flat.device)
        _reduce_scatter_flat(out, flat, self.dp_group)
        return out

    def _write_back(self) -> None:
        """All-gather the master slices over dp and copy them into the parameters."""
        dp = group_size(self.dp_group)
        if dp == 1:
            full = self.master
        else:
            full = torch.empty(self.slice_size * dp, dtype=torch.float32, device=self.master.device)
            _all_gather_flat(full, self.master, self.dp_group)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                p.copy_(full[offset:offset + p.numel()].view_as(p))

    def global_grad_norm(self, grad_slice: Tensor) -> float:
        """L2 norm of the whole model's gradient from each rank's slice (counted-once mask)."""
        parts = [grad_slice[start:end].square().sum() for start, end in self.norm_ranges]
        sumsq = torch.stack(parts).sum() if parts else grad_slice.new_zeros(())
        if group_size(self.norm_group) > 1:
            dist.all_reduce(sumsq, group=self.norm_group)
        return float(sumsq.sqrt())

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0, skip: bool = False) -> dict[str, float]:
        """One AdamW step from the parameters' .grad; returns {"grad_norm", "lr", "skipped"}.

        A non-finite gradient norm skips the update on every rank (they all see the same norm);
        so does `skip` (the engine passes it for a non-finite loss, which is the same on every
        rank too). A skipped step leaves weights, moments and the step count untouched.
        """
        grad = self.reduced_grad().mul_(grad_scale)
        norm = self.global_grad_norm(grad)
        lr = lr_at(self.config, self.steps_done)
        if skip or not math.isfinite(norm):
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        if self.config.max_grad_norm is not None and norm > self.config.max_grad_norm:
            grad.mul_(self.config.max_grad_norm / (norm + 1e-6))
        self.steps_done += 1
        self._adamw_update(grad, lr)
        self._write_back()
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ---- the whole state, for moving the optimizer to another layout --------------------------
    @torch.no_grad()
    def full_state(self, key: str) -> dict[str, Tensor]:
        """One of OPTIMIZER_STATE_KEYS for every parameter of this shard: name -> fp32 tensor shaped like the
        parameter, the dp slices gathered (collective over the dp group). Like the parameters
        themselves these can be resharded to another layout (`actors.realloc`)."""
        if key not in OPTIMIZER_STATE_KEYS:
            raise ValueError(f"ShardedAdamW.full_state({key!r}): allowed: {', '.join(OPTIMIZER_STATE_KEYS)}")
        part = getattr(self, key)
        dp = group_size(self.dp_group)
        full = part
        if dp > 1:
            full = torch.empty(self.slice_size * dp, dtype=torch.float32, device=part.device)
            _all_gather_flat(full, part, self.dp_group)
        return {name: full[offset:offset + p.numel()].view(p.shape).clone()
                for name, p, offset in zip(self.names, self.params, self.offsets)}

    @torch.no_grad()
    def load_full_state(self, key: str, state: dict[str, Tensor]) -> None:
        """Take this rank's slice of one of OPTIMIZER_STATE_KEYS from whole per-parameter tensors (as
        `full_state` gives them, possibly moved from another layout)."""
        missing = [name for name in self.names if name not in state]
        if missing or key not in OPTIMIZER_STATE_KEYS:
            raise ValueError(f"ShardedAdamW.load_full_state({key!r}): missing parameters {missing[:4]}")
        flats = [state[name].to(device=self.master.device, dtype=torch.float32).flatten() for name in self.names]
        getattr(self, key).copy_(self._gather_slice(flats, self.master.device))

    STATE_KINDS = OPTIMIZER_STATE_KEYS

    @torch.no_grad()
    def per_parameter_state(self) -> dict[str, dict[str, Tensor]]:
        """The fp32 master weights and AdamW moments as per-parameter tensors of this shard:
        {kind: {name: fp32 tensor shaped like the parameter}} for kind in STATE_KINDS (collective
        over dp, `full_state`). Keyed by HF name like the weights, a checkpoint of them can be
        resharded onto another layout by the reallocation planner."""
        return {kind: self.full_state(kind) for kind in self.STATE_KINDS}

    @torch.no_grad()
    def load_per_parameter_state(self, state: dict[str, dict[str, Tensor]], steps_done: int) -> None:
        """Take this rank's [S] slices of master, exp_avg and exp_avg_sq from per-parameter
        tensors of the whole shard (as `per_parameter_state` returns them, for this layout) and
        the step count of the LR schedule and bias corrections. The parameters are not touched."""
        if steps_done < 0:
            raise ValueError(f"steps_done={steps_done}: must be >= 0")
        for kind in self.STATE_KINDS:
            given = state.get(kind, {})
            missing = [name for name in self.names if name not in given]
            if missing:
                raise ValueError(f"optimizer state {kind!r}: no tensor for {missing[:3]} ({len(missing)} missing)")
            for name, p in zip(self.names, self.params):
                if tuple(given[name].shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {kind}/{name}: shape {tuple(given[name].shape)}, the "
                                     f"parameter's is {tuple(p.shape)}")
            self.load_full_state(kind, given)
        self.steps_done = steps_done

    def _adamw_update(self, grad: Tensor, lr: float) -> None:
        """Update master/m/v [S] in place (torch.optim.AdamW's arithmetic, per-element decay)."""
        beta1, beta2 = self.config.betas
        t = self.steps_done
        self.exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if self.config.weight_decay:
            for start, end in self.decay_ranges:
                self.master[start:end].mul_(1.0 - lr * self.config.weight_decay)
        bias1, bias2 = 1.0 - beta1**t, 1.0 - beta2**t
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.config.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)


def _mover(target: Tensor) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook adding a parameter's .grad into `target` (fp32, same shape)
    and freeing it, so the next backward starts a fresh low-precision gradient."""

    def hook(param: Tensor) -> None:
        if param.grad is not None:
            target.add_(param.grad)
            param.grad = None

    return hook


__all__ = ["OPTIMIZER_STATE_KEYS", "AdamWConfig", "ShardedAdamW", "adamw_config_from", "lr_at"]
