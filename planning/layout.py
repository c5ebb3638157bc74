"""Value types for where a model function call runs: its 3D layout and its device mesh.

A `ClusterSpec` is N nodes x M GPUs, GPUs numbered globally `node * M + local`. A `Mesh` is a
legal subset of them (ReaL's rule): 1, 2, 4, ... contiguous GPUs of one node, aligned to their
size, or whole contiguous nodes. A `Layout(dp, tp, pp)` places `dp * tp * pp` ranks on a mesh of
the same size, ranks ordered with tp fastest, then dp, then pp, so tp groups stay inside a node.

Everything here is pure Python, frozen and hashable, so plans can be cached and compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from planning.hardware import HardwareSpec


@dataclass(frozen=True, slots=True)
class Layout:
    """A (dp, tp, pp) decomposition of a mesh. Ranks: tp fastest, then dp, then pp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name}={value!r}: must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        """Rank inside the mesh of the shard (dp_rank, tp_rank, pp_rank)."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of a rank inside the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside layout {self}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return dp_rank, tp_rank, pp_rank

    def tp_group(self, dp_rank: int, pp_rank: int) -> list[int]:
        return [self.rank(dp_rank, t, pp_rank) for t in range(self.tp)]

    def dp_group(self, tp_rank: int, pp_rank: int) -> list[int]:
        return [self.rank(d, tp_rank, pp_rank) for d in range(self.dp)]

    def pp_group(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank(dp_rank, tp_rank, p) for p in range(self.pp)]

    def __str__(self) -> str:
        return f"dp{self.dp}tp{self.tp}pp{self.pp}"

    @staticmethod
    def parse(text: str) -> Layout:
        """Parse 'tp2,pp1', 'dp2tp2pp1' or 'd2t2p1' (missing degrees are 1)."""
        import re

        degrees = {"dp": 1, "tp": 1, "pp": 1}
        cleaned = text.replace(",", "").replace(" ", "").lower()
        matches = re.findall(r"(dp|tp|pp|d|t|p)(\d+)", cleaned)
        if not matches or "".join(k + v for k, v in matches) != cleaned:
            raise ValueError(f"layout {text!r}: expected e.g. 'tp2,pp1' or 'dp2tp2pp1'")
        for key, value in matches:
            degrees[{"d": "dp", "t": "tp", "p": "pp"}.get(key, key)] = int(value)
        return Layout(**degrees)


@dataclass(frozen=True, slots=True)
class Mesh:
    """A legal set of GPUs: `size` GPUs starting at global GPU index `start`.

    Either `size` is a power of two <= gpus_per_node and `start` is aligned to `size`
    (a sub-node mesh), or `size` and `start` are multiples of `gpus_per_node` (whole nodes).
    """

    start: int
    size: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        m = self.gpus_per_node
        if m < 1 or self.size < 1 or self.start < 0:
            raise ValueError(f"Mesh(start={self.start}, size={self.size}, gpus_per_node={m}) invalid")
        if self.size < m:
            if self.size & (self.size - 1) or self.start % self.size or m % self.size:
                raise ValueError(
                    f"mesh of {self.size} GPUs at {self.start}: a mesh smaller than a node must be a power of two "
                    f"dividing gpus_per_node={m} and start at a multiple of its size"
                )
        elif self.size % m or self.start % m:
            raise ValueError(f"mesh of {self.size} GPUs at {self.start}: multi-node meshes are whole nodes of {m}")

    @property
    def gpus(self) -> range:
        return range(self.start, self.start + self.size)

    @property
    def first_node(self) -> int:
        return self.start // self.gpus_per_node

    @property
    def n_nodes(self) -> int:
        return max(1, self.size // self.gpus_per_node)

    @property
    def nodes(self) -> range:
        return range(self.first_node, self.first_node + self.n_nodes)

    @property
    def gpus_in_node(self) -> int:
        """GPUs of this mesh on each of its nodes."""
        return min(self.size, self.gpus_per_node)

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def overlaps(self, other: Mesh) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size

    def contains(self, other: Mesh) -> bool:
        return self.start <= other.start and other.start + other.size <= self.start + self.size

    def __str__(self) -> str:
        m = self.gpus_per_node
        if self.size >= m:
            last = self.first_node + self.n_nodes - 1
            return f"n{self.first_node}" if last == self.first_node else f"n{self.first_node}-{last}"
        local = self.start % m
        node = self.first_node
        if self.size == 1:
            return f"n{node}:g{local}"
        return f"n{node}:g{local}-{local + self.size - 1}"

    @staticmethod
    def parse(text: str, gpus_per_node: int) -> Mesh:
        """Inverse of str(): 'n0', 'n0-3', 'n1:g4', 'n1:g0-3'."""
        import re

        m = re.fullmatch(r"n(\d+)(?:-(\d+))?(?::g(\d+)(?:-(\d+))?)?", text.strip())
        if not m:
            raise ValueError(f"mesh {text!r}: expected 'n0', 'n0-1', 'n0:g2' or 'n0:g0-3'")
        n0, n1, g0, g1 = m.groups()
        if g0 is None:
            first, last = int(n0), int(n1 if n1 is not None else n0)
            return Mesh(first * gpus_per_node, (last - first + 1) * gpus_per_node, gpus_per_node)
        if n1 is not None:
            raise ValueError(f"mesh {text!r}: a GPU range must be inside one node")
        lo, hi = int(g0), int(g1 if g1 is not None else g0)
        return Mesh(int(n0) * gpus_per_node + lo, hi - lo + 1, gpus_per_node)


@dataclass(frozen=True)
class ClusterSpec:
    """N nodes of M identical GPUs with the given hardware."""

    nodes: int
    gpus_per_node: int
    hardware: HardwareSpec

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster {self.nodes}x{self.gpus_per_node}: both must be positive")

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def full_mesh(self) -> Mesh:
        return Mesh(0, self.n_gpus, self.gpus_per_node)

    @cached_property
    def meshes(self) -> tuple[Mesh, ...]:
        """Every legal mesh, smallest first."""
        m = self.gpus_per_node
        out: list[Mesh] = []
        size = 1
        while size < m:
            if m % size == 0:
                out.extend(Mesh(start, size, m) for start in range(0, self.n_gpus, size))
            size *= 2
        for n in range(1, self.nodes + 1):
            out.extend(Mesh(first * m, n * m, m) for first in range(self.nodes - n + 1))
        return tuple(out)

    def layouts_for(self, mesh: Mesh) -> list[Layout]:
        """Every (dp, tp, pp) with product mesh.size and tp inside one node."""
        out = []
        for tp in _divisors(mesh.size):
            if tp > mesh.gpus_in_node or mesh.gpus_in_node % tp:
                continue
            for pp in _divisors(mesh.size // tp):
                out.append(Layout(dp=mesh.size // (tp * pp), tp=tp, pp=pp))
        return out


def _divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (O(sqrt n): big clusters have big meshes)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
