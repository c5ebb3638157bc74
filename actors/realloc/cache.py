"""Per-process caches of the reallocation executor (`actors.realloc.executor`): compiled rank programs,
copy-kernel tables and pull sessions, keyed by plan / program identity so that a repeated reallocation does no
planning work. Plain data and mapped tensors, no process groups."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from actors.kernels import triton_on, triton_runs
from actors.realloc.copies import DeviceTables, compile_copy_tables
from actors.realloc.program import RankProgram, compile_rank_program
from actors.realloc.pull import PullSession
from actors.realloc.schedule import ReallocSchedule, build_schedule, source_offsets
from planning.realloc_plan import ReallocPlan

T = TypeVar("T")


_Entry = tuple[ReallocPlan, tuple[str, ...], tuple[torch.Size, ...], RankProgram, ReallocSchedule]


class ProgramCache:
    """Compiled rank programs of recently executed plans, most recent last.

    Keyed by the plan's identity (plus rank, element size and bucket settings) rather than its
    value: hashing a plan of ~300 transfers costs more host time than the rest of a small
    reallocation. Each entry also holds the source names and shapes it was compiled for and is
    recompiled when they change. Entries keep their plan alive, so an id is never reused while
    its entry exists. An equal plan in a new object compiles once more, which is only slower.
    """

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()

    def get(self, plan: ReallocPlan, rank: int, element_bytes: int, settings: tuple[int, int, int],
            src_shards: dict[str, torch.Tensor]) -> tuple[RankProgram, ReallocSchedule]:
        """This rank's program and the schedule it was compiled from. settings: (bucket_bytes,
        direct_min_bytes, lead_bytes) of `build_schedule`."""
        key = (id(plan), rank, element_bytes) + settings
        names = tuple(src_shards)
        shapes = tuple([t.shape for t in src_shards.values()])
        entry = self._entries.get(key)
        if entry is not None and entry[0] is plan and entry[1] == names and entry[2] == shapes:
            self._entries.move_to_end(key)
            return entry[3], entry[4]
        shape_of = {name: tuple(shape) for name, shape in zip(names, shapes)}
        schedule = build_schedule(plan, element_bytes, *settings)
        offsets = source_offsets(plan, rank, shape_of)
        program = compile_rank_program(schedule, plan, rank, offsets, shape_of, element_bytes)
        self._entries[key] = (plan, names, shapes, program, schedule)
        self._entries.move_to_end(key)
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return program, schedule


PROGRAMS = ProgramCache(max_entries=32)  # plain data, no process groups; per process


class PerProgram(Generic[T]):
    """Values made for recently run programs (one per program and device), most recent last:
    the copy-kernel tables and pull sessions. Keyed like `ProgramCache` by identity; entries
    keep their program alive, so an id is never reused while its entry exists."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int, str], tuple[RankProgram, T]] = OrderedDict()

    def get(self, program: RankProgram, device: torch.device, make: Callable[[], T]) -> T:
        """The value for (program, device), made by `make()` the first time."""
        key = (id(program), str(device))
        entry = self._entries.get(key)
        if entry is None or entry[0] is not program:
            entry = (program, make())
            self._entries[key] = entry
            if len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)  # a pull session takes its mapped peer shards along
        self._entries.move_to_end(key)
        return entry[1]

    def clear(self) -> None:
        """Drop every value (for pull sessions: this process's mappings of its peers' shards)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


PULLS: PerProgram[PullSession] = PerProgram(max_entries=8)
TABLES: PerProgram[DeviceTables | None] = PerProgram(max_entries=32)


def device_tables(program: RankProgram, src: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                  copy_kernels: bool | None) -> DeviceTables | None:
    """The copy-kernel tables to run `program`'s NCCL rounds with on this call, or None for the
    torch copies. copy_kernels: None = on CUDA with triton when the shards are contiguous in
    `dtype`; True = required (raises where it cannot run); False = never."""
    if copy_kernels is False or (copy_kernels is None and not triton_on(device)):
        return None
    usable = all(t.dtype == dtype and t.is_contiguous() for t in src)
    if copy_kernels and not (triton_runs(device) and usable):
        raise ValueError(f"copy_kernels=True needs Triton on {device} (CUDA, or CPU with TRITON_INTERPRET=1) and "
                         f"source shards contiguous in {dtype}")
    if not usable:
        return None

    def make() -> DeviceTables | None:
        compiled = compile_copy_tables(program, [tuple(t.shape) for t in src], src[0].element_size() if src else 2)
        return None if compiled is None else DeviceTables(compiled, device)

    return TABLES.get(program, device, make)


__all__ = ["PROGRAMS", "PULLS", "TABLES", "PerProgram", "ProgramCache", "device_tables"]
