"""One-off jobs on Ray with a single placement: the workers behind `score` and `generate --ray`.

`LayoutJob` starts one `ModelWorker` per rank of a layout (a local Ray with virtual GPUs when
this machine has no CUDA and `RAY_ADDRESS` is unset; the Ray cluster otherwise), joins them in
one torch.distributed world, creates the layout's process groups, loads an HF checkpoint as a
frozen model, and runs `CallSpec`s on it in batches: the call goes to every rank, and only the
data owners' shards (tp rank 0 of the last pipeline stage of each dp rank) are fetched.
"""

from __future__ import annotations

from typing import Any

import ray

from actors.worker import CallSpec, ModelWorker, placement_group_sets
from app.runtime import init_world, join_virtual_cluster
from app.schedule import data_owners
from cluster.placement import WorkerGroup, create_workers
from cluster.resources import RayStartOptions, connect
from planning.layout import ClusterSpec, Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement

JOB_ROLE = "ref"  # a frozen model: scoring and generation never train
TIMEOUT_S = 600.0


class LayoutJob:
    """Workers holding one frozen HF model under one layout. Use as a context manager."""

    def __init__(self, model_dir: str, spec: ModelSpec, layout: Layout, timeout_s: float = TIMEOUT_S) -> None:
        self._started_ray = not ray.is_initialized()
        virtual = _virtual_gpus(layout)
        join_virtual_cluster(virtual > 0)
        info = connect(RayStartOptions(virtual_gpus=virtual, include_dashboard=False))
        if info.spec.gpus_per_node < layout.world_size:
            raise ValueError(f"--layout {layout}: needs {layout.world_size} GPUs on one node; the Ray cluster has "
                             f"{info.spec.gpus_per_node} per node")
        cluster = ClusterSpec(1, layout.world_size, info.spec.hardware)
        self.placement = Placement(Mesh(0, layout.world_size, layout.world_size), layout)
        self.timeout_s = timeout_s
        self.workers: WorkerGroup | None = create_workers(
            ModelWorker, cluster, {"world_size": layout.world_size, "device": info.device},
            rank_kwargs=[{"rank": r} for r in range(layout.world_size)], cpus_per_worker=0.0 if info.virtual else 1.0,
            name_prefix="job-worker",
        )
        try:
            init_world(self.workers, info.backend, timeout_s)
            self.workers.run("ensure_groups", placement_group_sets(self.placement), timeout_s=timeout_s)
            self.workers.run("load_model", JOB_ROLE, spec, False, self.placement, model_dir, 0, False, {},
                             timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise

    def run(self, name: str, kind: str, rows: dict[str, list[Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
        """Run one call over `rows` (per-row columns); the owners' output shards in row order."""
        assert self.workers is not None
        n_rows = len(next(iter(rows.values())))
        spec = CallSpec(name, JOB_ROLE, kind, self.placement, 0, n_rows, params)
        shard = ray.put({"row_start": 0, "n": n_rows, **rows})
        refs = [self.workers.actor(r).run_call.options(num_returns=2).remote(spec, shard)
                for r in self.placement.mesh.gpus]
        ray.get([meta for meta, _ in refs], timeout=self.timeout_s)  # raises the first worker error
        owners = data_owners(self.placement, n_rows)
        return ray.get([refs[o.rank][1] for o in owners], timeout=self.timeout_s)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> LayoutJob:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _virtual_gpus(layout: Layout) -> int:
    """Virtual GPUs (the layout's ranks) on a machine without CUDA, else 0 (real GPUs)."""
    import torch

    return 0 if torch.cuda.is_available() else layout.world_size


def column(shards: list[dict[str, Any]], key: str) -> list[Any]:
    """One column of owner shards concatenated in row order."""
    ordered = sorted(shards, key=lambda s: int(s["row_start"]))
    return [value for shard in ordered for value in shard[key]]


__all__ = ["JOB_ROLE", "LayoutJob", "column"]
