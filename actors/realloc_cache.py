"""Per-process caches of the reallocation executor (`actors/realloc.py`): compiled rank programs
and pull sessions, keyed by plan / program identity so that a repeated reallocation does no
planning work. Plain data and mapped tensors, no process groups."""

from __future__ import annotations

from collections import OrderedDict

import torch

from actors.realloc_program import RankProgram, compile_rank_program
from actors.realloc_pull import PullSession
from actors.realloc_schedule import ReallocSchedule, build_schedule, source_offsets
from planning.realloc_plan import ReallocPlan


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


class PullCache:
    """Pull sessions (mapped peer shards, copy table) of recently run programs, by identity."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int, str], tuple[RankProgram, PullSession]] = OrderedDict()

    def get(self, plan: ReallocPlan, schedule: ReallocSchedule, program: RankProgram, rank: int,
            names: tuple[str, ...], device: torch.device) -> PullSession:
        key = (id(program), str(device))
        entry = self._entries.get(key)
        if entry is None or entry[0] is not program:
            entry = (program, PullSession(plan, schedule, program, rank, names, device))
            self._entries[key] = entry
            if len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)  # drops its mapped peer shards
        self._entries.move_to_end(key)
        return entry[1]

    def clear(self) -> None:
        """Drop every session and with it this process's mappings of its peers' shards."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


PULLS = PullCache(max_entries=8)


__all__ = ["PROGRAMS", "PULLS", "ProgramCache", "PullCache"]
