"""An execution plan: where each model function call runs (mesh, layout) and how (micro-batching).

The cost model (`planning.cost`) prices every call at several memory levels: training and
inference split each data-parallel replica's tokens into micro-batches of at most
`micro_batch_tokens`, generation runs a replica's sequences in `gen_rounds` rounds (one round's
KV cache alive at a time). The search and the simulator pick a level per call; the plan carries
that choice as a `CallExecution`, and the workers run exactly it, so the estimate and the run
describe the same program. Everything here is frozen and hashable.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.layout import Layout, Mesh


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one call runs."""

    mesh: Mesh
    layout: Layout

    def __post_init__(self) -> None:
        if self.layout.world_size != self.mesh.size:
            raise ValueError(f"layout {self.layout} has {self.layout.world_size} ranks but mesh {self.mesh} has {self.mesh.size} GPUs")
        if self.mesh.gpus_in_node % self.layout.tp:
            raise ValueError(f"layout {self.layout}: tp={self.layout.tp} groups would span nodes of mesh {self.mesh}")

    def gpu_of_rank(self, rank: int) -> int:
        """Global GPU index of mesh rank `rank` (ranks map to the mesh's GPUs in order)."""
        return self.mesh.start + rank


@dataclass(frozen=True, slots=True)
class CallExecution:
    """How one call runs on its placement.

    micro_batch_tokens: training and inference (logprobs, values, reward scores) cut each
        data-parallel replica's sequences (per minibatch when training) into
        ceil(tokens / micro_batch_tokens) micro-batches of whole sequences, balanced by tokens;
        at most one micro-batch's logits exist at a time. None for generation.
    gen_rounds: generation runs each replica's sequences in this many rounds, each with its own
        KV cache (freed before the next). None for other calls.
    """

    micro_batch_tokens: int | None = None
    gen_rounds: int | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_tokens", "gen_rounds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CallExecution.{name}={value!r}: must be a positive integer or None")
        if (self.micro_batch_tokens is None) == (self.gen_rounds is None):
            raise ValueError("CallExecution: set exactly one of micro_batch_tokens (train, inference) "
                             "and gen_rounds (generation)")

    def describe(self) -> str:
        """Short text for tables: '<=8192 tok/mb' or '2 rounds'."""
        if self.gen_rounds is not None:
            return f"{self.gen_rounds} round{'s' if self.gen_rounds > 1 else ''}"
        return f"<={self.micro_batch_tokens} tok/mb"

    def as_dict(self) -> dict[str, int]:
        """The fields that are set, as in `plan.json` and the config's `plan.manual.<call>`."""
        if self.gen_rounds is not None:
            return {"gen_rounds": self.gen_rounds}
        assert self.micro_batch_tokens is not None
        return {"micro_batch_tokens": self.micro_batch_tokens}


def check_execution_kind(call: str, kind: str, execution: CallExecution) -> None:
    """ValueError unless `execution` fits a call of `kind` (rounds for generate, a token budget
    for inference and train)."""
    if kind == "generate" and execution.gen_rounds is None:
        raise ValueError(f"call {call}: a generate call takes gen_rounds, not micro_batch_tokens")
    if kind != "generate" and execution.micro_batch_tokens is None:
        raise ValueError(f"call {call}: a {kind} call takes micro_batch_tokens, not gen_rounds")


# Elements of a rank's optimizer slice one offload chunk holds at most: the optimizer streams the
# host part through two GPU staging sets of (master, m, v) fp32 chunks (2 x 3 x 4 bytes x this =
# 384 MiB), one in flight while the other is updated. The cost model counts those buffers.
OFFLOAD_CHUNK_ELEMENTS = 16 * 2**20
# Chunk starts and the device/host boundary are multiples of this many elements.
OFFLOAD_ALIGN = 4096
# A small host part still streams in at least this many chunks, so the staging sets hold at most
# 2 / OFFLOAD_MIN_CHUNKS of it (one chunk the size of the part would save no GPU memory at all).
OFFLOAD_MIN_CHUNKS = 8


def offload_chunk_elements(host_elements: int) -> int:
    """Elements per streamed chunk for a host part of `host_elements`: OFFLOAD_CHUNK_ELEMENTS, or
    fewer for a small part (at least OFFLOAD_MIN_CHUNKS chunks), a multiple of OFFLOAD_ALIGN.
    The engine streams with it and the cost model prices its staging sets by it."""
    per_chunk = -(-int(host_elements) // OFFLOAD_MIN_CHUNKS)
    per_chunk = -(-per_chunk // OFFLOAD_ALIGN) * OFFLOAD_ALIGN
    return max(OFFLOAD_ALIGN, min(OFFLOAD_CHUNK_ELEMENTS, per_chunk))


@dataclass(frozen=True)
class ExecutionPlan:
    """Placement per call name, in the graph's call order, and the execution chosen for each
    call (empty until the search or the simulator fills it: `planning.simulate.complete_plan`).

    optimizer_offload: (role, fraction) for each trained role whose optimizer state (fp32 master
    weights and Adam m, v: 12 bytes per parameter of its dp shard) partly lives in pinned host
    memory: that fraction of every rank's slice (its tail) stays on the host and is streamed
    through the GPU in chunks for each optimizer step (actors.engine.optimizer). A role not
    named keeps all of it on the GPU."""

    placements: tuple[tuple[str, Placement], ...]
    executions: tuple[tuple[str, CallExecution], ...] = ()
    optimizer_offload: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for role, fraction in self.optimizer_offload:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
                raise ValueError(f"ExecutionPlan.optimizer_offload[{role!r}]={fraction!r}: must be in (0, 1]")

    def offload_fraction(self, role: str) -> float:
        """Fraction of `role`'s optimizer state in host memory (0.0: all on the GPU)."""
        return dict(self.optimizer_offload).get(role, 0.0)

    def with_offload(self, fractions: dict[str, float]) -> ExecutionPlan:
        """The same plan with these offload fractions (roles at 0 are left out), in role order."""
        kept = tuple(sorted((role, float(f)) for role, f in fractions.items() if f > 0.0))
        return ExecutionPlan(self.placements, self.executions, kept)

    def __getitem__(self, name: str) -> Placement:
        for call, placement in self.placements:
            if call == name:
                return placement
        raise KeyError(name)

    def execution(self, name: str) -> CallExecution | None:
        """How call `name` runs, or None when the plan does not say."""
        for call, execution in self.executions:
            if call == name:
                return execution
        return None

    def as_dict(self) -> dict[str, Placement]:
        return dict(self.placements)

    def with_executions(self, executions: dict[str, CallExecution]) -> ExecutionPlan:
        """The same placements with these executions (in call order; calls not named have none)."""
        names = [name for name, _ in self.placements]
        unknown = sorted(set(executions) - set(names))
        if unknown:
            raise ValueError(f"executions for calls {unknown}: not in the plan ({names})")
        return ExecutionPlan(self.placements, tuple((n, executions[n]) for n in names if n in executions),
                             self.optimizer_offload)

    def without_executions(self) -> ExecutionPlan:
        return ExecutionPlan(self.placements, optimizer_offload=self.optimizer_offload)

    @staticmethod
    def from_dict(placements: dict[str, Placement], executions: dict[str, CallExecution] | None = None) -> ExecutionPlan:
        return ExecutionPlan(tuple(placements.items())).with_executions(executions or {})
