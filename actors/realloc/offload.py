"""Where a model's weights live between calls on one worker: CPU offload and the copy rules.

`offload_to_cpu` / `reload_to_device` move a dict of shards to (pinned, when CUDA exists) host
memory and back with non-blocking copies. `ModelCopies` is the bookkeeping the worker keeps per
model, expressing the memory rules of parameter reallocation:

- a trainable model's home copy (the training placement, whose optimizer state lives beside it)
  never moves; a copy made for generation or inference under another placement is released after
  the call unless the next call of this model wants the same placement, and every such copy is
  dropped after a training step (it is stale);
- a model that is never trained (ref, reward) keeps one copy, under the placement of its last
  call; between calls it can be offloaded to CPU. Its weights never change, so the host copy
  stays valid and later offloads of the same placement just drop the device tensors.

Decisions depend only on placements, which every rank knows, so all ranks of the world agree on
which copies exist (a rank outside a copy's mesh holds an empty dict for it) and therefore on
which reallocations to run. Tensors are only dropped here; the caching allocator reuses them.
"""

from __future__ import annotations

import torch

from planning.plan import Placement


def offload_to_cpu(shards: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Copy `shards` to host memory; pinned when CUDA is available so copies can be asynchronous.

    into: host tensors of matching shapes and dtypes to reuse (pinning fresh memory is slow).
    Returns only once the host copies are complete.
    """
    pin = torch.cuda.is_available()
    out: dict[str, torch.Tensor] = {}
    any_cuda = False
    for name, tensor in shards.items():
        host = into.get(name) if into else None
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        host.copy_(tensor, non_blocking=pin and tensor.is_cuda)
        any_cuda |= tensor.is_cuda
        out[name] = host
    if any_cuda:
        # A non-blocking device-to-host copy is valid only once the stream has run it.
        torch.cuda.synchronize()
    return out


def reload_to_device(cpu_shards: dict[str, torch.Tensor], device: torch.device | str,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fresh device copies of host shards (non-blocking from pinned memory; stream-ordered)."""
    device = torch.device(device)
    return {
        name: t.to(device=device, dtype=dtype or t.dtype, non_blocking=t.is_pinned(), copy=True)
        for name, t in cpu_shards.items()
    }


class ModelCopies:
    """This rank's copies of one model, keyed by placement, and when to release them.

    Usage by the worker, for a call of this model under placement P followed by one under N:

        if not copies.holds(P):
            copies.reload(device)                     # no-op unless offloaded
            if not copies.holds(P):
                src = copies.source_for(P)
                new, _ = execute_reallocation(plan(src, P), rank, copies.shards(src), ...)
                copies.add(P, new)
        ... run the call on copies.shards(P) ...
        copies.after_call(P, N)                       # N None when unknown
        copies.after_train()                          # after a train call only
    """

    def __init__(self, name: str, trainable: bool, offload_idle: bool = True) -> None:
        self.name = name
        self.trainable = trainable
        self.offload_idle = offload_idle and not trainable
        self._device: dict[Placement, dict[str, torch.Tensor]] = {}  # copies in device memory
        self._home: Placement | None = None
        self._host: tuple[Placement, dict[str, torch.Tensor]] | None = None  # offloaded frozen copy

    # ---- state -------------------------------------------------------------------------------
    @property
    def home(self) -> Placement:
        """The placement reallocations start from: the training placement, or the frozen copy's."""
        if self._home is None:
            raise ValueError(f"model {self.name}: no weights loaded; call load() first")
        return self._home

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Placements with a copy in device memory."""
        return tuple(self._device)

    @property
    def offloaded(self) -> bool:
        """The home copy sits in host memory only (after offload(), before reload())."""
        return self._host is not None and self._host[0] == self._home and self._home not in self._device

    def holds(self, placement: Placement) -> bool:
        return placement in self._device

    def shards(self, placement: Placement) -> dict[str, torch.Tensor]:
        """This rank's shards of the copy under `placement` (empty when outside its mesh)."""
        if placement not in self._device:
            held = ", ".join(f"{p.mesh}/{p.layout}" for p in self._device) or "none"
            raise KeyError(f"model {self.name}: no copy under {placement.mesh}/{placement.layout} (held: {held})")
        return self._device[placement]

    def source_for(self, placement: Placement) -> Placement:
        """The copy to reallocate from to reach `placement`: always the home copy."""
        if self.offloaded:
            raise ValueError(f"model {self.name}: offloaded to CPU; call reload() before reallocating")
        return self.home

    # ---- transitions ---------------------------------------------------------------------------
    def load(self, placement: Placement, shards: dict[str, torch.Tensor]) -> None:
        """Initial weights (from a checkpoint or init) under `placement`, which becomes home."""
        self._device = {placement: shards}
        self._home = placement
        self._host = None

    def add(self, placement: Placement, shards: dict[str, torch.Tensor]) -> None:
        """A copy made by reallocation. A frozen model's newest copy becomes its home."""
        self._device[placement] = shards
        if not self.trainable:
            self._home = placement

    def after_call(self, placement: Placement, next_placement: Placement | None) -> None:
        """Release what the rules say is no longer needed once the call under `placement` is done."""
        keep = next_placement == placement
        if self.trainable:
            if placement != self._home and not keep:
                self._device.pop(placement, None)
            return
        # Frozen: one copy only, the one just used; offloaded unless the next call reuses it.
        self._device = {p: s for p, s in self._device.items() if p == placement}
        self._home = placement
        if self.offload_idle and not keep:
            self.offload()

    def after_train(self) -> None:
        """A training step changed the home copy: every other copy is stale."""
        if not self.trainable:
            raise ValueError(f"model {self.name}: after_train() on a model that is not trainable")
        self._device = {p: s for p, s in self._device.items() if p == self._home}

    def offload(self) -> None:
        """Move the home copy of a frozen model to host memory (reusing a valid host copy)."""
        if self.trainable:
            raise ValueError(f"model {self.name}: a trainable model stays in place with its optimizer")
        home = self.home
        if home not in self._device:
            return  # already offloaded, or this rank holds no copy
        if self._host is None or self._host[0] != home:
            self._host = (home, offload_to_cpu(self._device[home]))
        del self._device[home]

    def reload(self, device: torch.device | str) -> None:
        """Bring an offloaded home copy back to `device`; the host copy stays for later offloads."""
        if not self.offloaded:
            return
        assert self._host is not None
        self._device[self._host[0]] = reload_to_device(self._host[1], device)

    def release_all(self) -> None:
        """Drop every copy, device and host (the home placement is remembered, nothing is held)."""
        self._device.clear()
        self._host = None


__all__ = ["ModelCopies", "offload_to_cpu", "reload_to_device"]
