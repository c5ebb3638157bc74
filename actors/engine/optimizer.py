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

With `host_fraction` f > 0, the tail of each of the three fp32 [S] vectors (at least f of them)
lives in pinned host memory and steps 4-5 stream it through the GPU in chunks
(actors.engine.optimizer_offload): same arithmetic, same result, 12 bytes per element less on the GPU.

Gradients are SUMMED over dp, never averaged: the engine normalises the loss globally.
The learning rate follows linear warmup then cosine decay (`lr_at`).

Accumulation over micro-batches (`fp32_accumulation`): each micro-batch back-propagates an
un-normalised sum, so a bf16 `.grad` that accumulated them would be rounded to bf16 after every
addition (relative error growing with the micro-batch count). Inside the context, a hook moves
each low-precision parameter's `.grad` after every backward into an fp32 buffer [N_pad] laid out
like the flat gradient of step 1 (Megatron's main_grad) and frees it; step 1 then reads that
buffer. Each such parameter also carries its view of the buffer as `param.main_grad` there, and
the linear layers add their weight gradient into it directly, in the GEMM, so their `.grad` and
the hook's extra pass never happen (actors/engine/main_grad.py, which holds both mechanisms).
fp32 parameters (CPU runs) accumulate in their own `.grad` as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from actors.engine.adamw_config import AdamWConfig, adamw_config_from, lr_at
from actors.engine.main_grad import attach_main_grads
from actors.engine.optimizer_offload import OPTIMIZER_STATE_KEYS, ChunkStreamer, HostState, device_elements
from actors.engine.process_groups import all_gather_flat, group_rank, group_size, reduce_scatter_flat
from planning.plan import offload_chunk_elements

# Elements the optimizer's elementwise update and norm work on at a time (temporaries of 64 MiB).
UPDATE_CHUNK = 16 * 2**20


class ShardedAdamW:
    """ZeRO-1 AdamW over the parameters of one model shard (see the module docstring).

    params: (name, parameter) of the shard, in a fixed order identical on every dp rank.
    dp_group: the ranks holding the same shard; norm_group: every rank of the mesh (None when
    alone). norm_excluded: names whose gradient must not be counted in the norm on this rank.
    host_fraction: at least this fraction of the slice's state lives in host memory (the module
    docstring); master/exp_avg/exp_avg_sq then hold the device part [0, split) only.
    """

    def __init__(self, params: list[tuple[str, nn.Parameter]], config: AdamWConfig,
                 dp_group: ProcessGroup | None, norm_group: ProcessGroup | None,
                 norm_excluded: frozenset[str] = frozenset(), host_fraction: float = 0.0) -> None:
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
        self.device = device
        self.host_fraction = host_fraction
        self.split = device_elements(self.slice_size, host_fraction)  # [0, split) on the device
        self.master = torch.zeros(self.split, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        n_host = self.slice_size - self.split
        self.host = HostState(n_host, pin=device.type == "cuda") if n_host else None
        self.offload_chunk = offload_chunk_elements(n_host)  # elements per streamed chunk
        self.reload_master()
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

    def _segments(self, key: str) -> list[tuple[int, Tensor]]:
        """Where `key`'s slice lives: (first slice element, tensor) for the device part and the
        host part (when there is one)."""
        out = [(0, getattr(self, key))]
        if self.host is not None:
            out.append((self.split, self.host.parts[key]))
        return out

    def _write_slice(self, key: str, flats: list[Tensor]) -> None:
        """Set `key` over the slice from whole flattened per-parameter tensors (any device or
        dtype; elements past N stay as they are: zero)."""
        hi = self.lo + self.slice_size
        segments = [(lo, lo + t.numel(), t) for lo, t in self._segments(key)]
        for offset, flat in zip(self.offsets, flats):
            start, end = max(offset, self.lo) - self.lo, min(offset + flat.numel(), hi) - self.lo
            for seg_lo, seg_hi, tensor in segments:
                a, b = max(start, seg_lo), min(end, seg_hi)
                if a < b:
                    tensor[a - seg_lo:b - seg_lo].copy_(flat[a + self.lo - offset:b + self.lo - offset])

    def _whole(self, key: str, device: torch.device) -> Tensor:
        """fp32 [S]: `key` over the whole slice on `device` (a view of the live state when it is
        all there, else a new tensor)."""
        parts = [t if t.device == device else t.to(device) for _, t in self._segments(key)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.no_grad()
    def reload_master(self) -> None:
        """Take the fp32 master slice from the parameters' current values (after they were
        overwritten, e.g. by a checkpoint load); AdamW's m and v are kept."""
        self._write_slice("master", [p.detach().flatten() for p in self.params])

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
            self.main_grad = torch.zeros(self.slice_size * dp, dtype=torch.float32, device=self.device)
        views = [(p, self.main_grad[offset:offset + p.numel()].view(p.shape)) for p, offset in low]
        with attach_main_grads(views):
            yield

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
            flat = torch.zeros(self.slice_size * dp, dtype=torch.float32, device=self.device)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[offset:offset + p.numel()] += p.grad.flatten()
        if dp == 1:
            return flat
        out = torch.empty(self.slice_size, dtype=torch.float32, device=flat.device)
        reduce_scatter_flat(out, flat, self.dp_group)
        return out

    def _into_params(self, values: Tensor, base: int) -> None:
        """Copy master values of slice elements [base, base + len) into the parameters (dp = 1:
        the slice is the whole model), cast to their dtype."""
        end = base + values.numel()
        for p, offset in zip(self.params, self.offsets):
            a, b = max(offset, base), min(offset + p.numel(), end)
            if a == offset and b == offset + p.numel():
                p.detach().copy_(values[a - base:b - base].view_as(p))
            elif a < b:  # a parameter across a chunk boundary: its piece in this chunk
                p.detach().view(-1)[a - offset:b - offset].copy_(values[a - base:b - base])

    def _write_back(self, tail: Tensor | None) -> None:
        """All-gather the master slices over dp and copy them into the parameters. tail: the
        host part's updated master, gathered on the device while it streamed (dp > 1 only)."""
        dp = group_size(self.dp_group)
        if dp == 1:
            self._into_params(self.master, 0)  # the host part was written while it streamed
            return
        local = self.master if tail is None else torch.cat([self.master, tail])
        full = torch.empty(self.slice_size * dp, dtype=torch.float32, device=self.device)
        all_gather_flat(full, local, self.dp_group)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                p.copy_(full[offset:offset + p.numel()].view_as(p))

    def global_grad_norm(self, grad_slice: Tensor) -> float:
        """L2 norm of the whole model's gradient from each rank's slice (counted-once mask)."""
        # In pieces of UPDATE_CHUNK elements: square() of a whole 8B-parameter slice would be a
        # 30 GiB temporary.
        parts = [grad_slice[a:min(end, a + UPDATE_CHUNK)].square().sum()
                 for start, end in self.norm_ranges for a in range(start, end, UPDATE_CHUNK)]
        sumsq = torch.stack(parts).sum() if parts else grad_slice.new_zeros(())
        if group_size(self.norm_group) > 1:
            dist.all_reduce(sumsq, group=self.norm_group)
        return float(sumsq.sqrt())

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0, skip: bool = False) -> dict[str, float]:
        """One AdamW step from the parameters' .grad; returns {"grad_norm", "lr", "skipped"} and,
        with a host part, "offload_s" (the streamed update's wall seconds).

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
        self._update(self.master, self.exp_avg, self.exp_avg_sq, grad[:self.split], lr, 0)
        started = time.perf_counter()
        tail = self._update_host(grad, lr)
        stats = {"grad_norm": norm, "lr": lr, "skipped": 0.0}
        if self.host is not None:  # seconds until the host part was back (the device part's update too)
            stats["offload_s"] = time.perf_counter() - started
        self._write_back(tail)
        return stats

    def _update_host(self, grad: Tensor, lr: float) -> Tensor | None:
        """The AdamW update of the host part, chunk by chunk on the device; each updated master
        chunk goes straight into the parameters (dp = 1) or into the returned fp32 [S - split]
        device tensor the dp all-gather needs (dp > 1; None without a host part)."""
        if self.host is None:
            return None
        dp = group_size(self.dp_group)
        tail = torch.empty(self.host.n, dtype=torch.float32, device=self.device) if dp > 1 else None

        def update(staged: dict[str, Tensor], a: int, b: int) -> None:
            base = self.split + a
            self._update(staged["master"], staged["exp_avg"], staged["exp_avg_sq"], grad[base:self.split + b], lr, base)
            if tail is None:
                self._into_params(staged["master"], base)
            else:
                tail[a:b].copy_(staged["master"])

        ChunkStreamer(self.host, self.device, self.offload_chunk).run(update)
        return tail

    # ---- the whole state, for moving the optimizer to another layout --------------------------
    @torch.no_grad()
    def full_state(self, key: str, on_host: bool = False) -> dict[str, Tensor]:
        """One of OPTIMIZER_STATE_KEYS for every parameter of this shard: name -> fp32 tensor shaped like the
        parameter, the dp slices gathered (collective over the dp group). Like the parameters
        themselves these can be resharded to another layout (`actors.realloc`).

        on_host: return host tensors; with dp = 1, those of the host part are views of the live
        state (no copy of tens of GiB: read them before the next step)."""
        if key not in OPTIMIZER_STATE_KEYS:
            raise ValueError(f"ShardedAdamW.full_state({key!r}): allowed: {', '.join(OPTIMIZER_STATE_KEYS)}")
        dp = group_size(self.dp_group)
        if dp == 1:
            if on_host:
                return self._host_views(key)
            full = self._whole(key, self.device)
        else:
            full = torch.empty(self.slice_size * dp, dtype=torch.float32, device=self.device)
            all_gather_flat(full, self._whole(key, self.device), self.dp_group)
        if on_host:
            full = full.cpu()
        return {name: full[offset:offset + p.numel()].view(p.shape).clone()
                for name, p, offset in zip(self.names, self.params, self.offsets)}

    def _host_views(self, key: str) -> dict[str, Tensor]:
        """dp = 1: per-parameter host tensors of `key` (views of the host part where a parameter
        lies in it entirely, copies of device pieces otherwise)."""
        out = {}
        for name, p, offset in zip(self.names, self.params, self.offsets):
            pieces = []
            for lo, tensor in self._segments(key):
                a, b = max(offset, lo), min(offset + p.numel(), lo + tensor.numel())
                if a < b:
                    piece = tensor[a - lo:b - lo]
                    pieces.append(piece if piece.device.type == "cpu" else piece.cpu())
            out[name] = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(p.shape)
        return out

    @torch.no_grad()
    def load_full_state(self, key: str, state: dict[str, Tensor]) -> None:
        """Take this rank's slice of one of OPTIMIZER_STATE_KEYS from whole per-parameter tensors (as
        `full_state` gives them, possibly moved from another layout; any device)."""
        missing = [name for name in self.names if name not in state]
        if missing or key not in OPTIMIZER_STATE_KEYS:
            raise ValueError(f"ShardedAdamW.load_full_state({key!r}): missing parameters {missing[:4]}")
        self._write_slice(key, [state[name].flatten() for name in self.names])

    STATE_KINDS = OPTIMIZER_STATE_KEYS

    @torch.no_grad()
    def per_parameter_state(self, on_host: bool = False) -> dict[str, dict[str, Tensor]]:
        """The fp32 master weights and AdamW moments as per-parameter tensors of this shard:
        {kind: {name: fp32 tensor shaped like the parameter}} for kind in STATE_KINDS (collective
        over dp, `full_state`, host tensors with on_host). Keyed by HF name like the weights, a
        checkpoint of them can be resharded onto another layout by the reallocation planner."""
        return {kind: self.full_state(kind, on_host) for kind in self.STATE_KINDS}

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

    def _update(self, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, lr: float, base: int) -> None:
        """AdamW on slice elements [base, base + n): master/m/v/grad fp32 [n], updated in place
        (torch.optim.AdamW's arithmetic, per-element decay), UPDATE_CHUNK elements at a time: the
        denominator is a temporary as large as what it covers (elementwise, so the same result)."""
        for a in range(0, master.numel(), UPDATE_CHUNK):
            b = min(master.numel(), a + UPDATE_CHUNK)
            self._update_piece(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], lr, base + a)

    def _update_piece(self, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, lr: float,
                      base: int) -> None:
        beta1, beta2 = self.config.betas
        t = self.steps_done
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if self.config.weight_decay:
            end = base + master.numel()
            for start, stop in self.decay_ranges:
                a, b = max(start, base), min(stop, end)
                if a < b:
                    master[a - base:b - base].mul_(1.0 - lr * self.config.weight_decay)
        bias1, bias2 = 1.0 - beta1**t, 1.0 - beta2**t
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.config.eps)
        master.addcdiv_(exp_avg, denom, value=-lr / bias1)


__all__ = ["OPTIMIZER_STATE_KEYS", "AdamWConfig", "ShardedAdamW", "adamw_config_from", "lr_at"]
