"""An execution plan: the (mesh, layout) each model function call runs on."""

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


@dataclass(frozen=True)
class ExecutionPlan:
    """Placement per call name, in the graph's call order."""

    placements: tuple[tuple[str, Placement], ...]

    def __getitem__(self, name: str) -> Placement:
        for call, placement in self.placements:
            if call == name:
                return placement
        raise KeyError(name)

    def as_dict(self) -> dict[str, Placement]:
        return dict(self.placements)

    @staticmethod
    def from_dict(placements: dict[str, Placement]) -> ExecutionPlan:
        return ExecutionPlan(tuple(placements.items()))
