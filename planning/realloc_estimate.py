"""Closed-form estimate of a reallocation's time, for the search's inner loop.

`planning.realloc_plan.estimate_realloc_s` plans the transfers parameter by parameter, which
takes 10-200 ms for a 70B model on 100+ GPUs: too slow to call for every plan the MCMC
proposes. `approx_realloc_s` follows the same cost rules with per-GPU arithmetic instead of
per-tensor routing (one pass over the destination GPUs):

* a destination GPU receives what its shard needs minus what the same GPU already holds
  (layer-range overlap of the two pipeline stages x overlap of the two tp slices);
* it is received over NVLink when the source mesh has GPUs of that stage on the same node, over
  the NIC otherwise; senders share the load evenly (the exact router picks the least loaded);
* each (destination node, stage, tp slice) that misses anything costs one message per tensor
  piece (latency), and local copies read and write HBM once, as in `realloc_time_s`.

The search ranks plans with this estimate and re-scores its best plans with the exact one, so
the reported time is always the exact estimate's (`planning.search`).
"""

from __future__ import annotations

from functools import lru_cache

from planning.layout import ClusterSpec
from planning.models import ModelSpec, pipeline_partition
from planning.plan import Placement
from planning.realloc_plan import check_compatible

# A pipeline stage: (first block, end block, embedding params, head + final norm params).
Stage = tuple[int, int, float, float]


@lru_cache(maxsize=1024)
def _stages(spec: ModelSpec, critic: bool, pp: int) -> tuple[Stage, ...]:
    """Per stage: (first block, end block, embedding params, head + final norm params)."""
    h = spec.hidden_size
    embed = float(spec.vocab_size * h)
    if critic:
        head = float(h)
    else:
        head = 0.0 if (spec.tie_embeddings and pp == 1) else embed
    partition = pipeline_partition(spec, pp, critic)
    last = len(partition) - 1
    return tuple((a, b, embed if s == 0 else 0.0, head + h if s == last else 0.0) for s, (a, b) in enumerate(partition))


def _overlap(spec: ModelSpec, src: Stage, dst: Stage) -> float:
    """Unsharded parameters two stages both hold."""
    blocks = max(0, min(src[1], dst[1]) - max(src[0], dst[0]))
    return blocks * spec.block_params + min(src[2], dst[2]) + min(src[3], dst[3])


def _tensors(spec: ModelSpec, stage: Stage) -> int:
    per_block = 9 + (3 if spec.qkv_bias else 0)
    return (stage[1] - stage[0]) * per_block + (1 if stage[2] else 0) + (2 if stage[3] else 0)


def approx_realloc_s(
    spec: ModelSpec, critic: bool, src: Placement, dst: Placement, cluster: ClusterSpec, dtype_bytes: int = 2,
) -> float | str:
    """Estimated seconds to move the weights from `src` to `dst`, or why it is impossible."""
    if src == dst:
        return 0.0
    try:
        check_compatible(spec, src, dst)
        s_stages = _stages(spec, critic, src.layout.pp)
        d_stages = _stages(spec, critic, dst.layout.pp)
    except ValueError as err:
        return str(err)
    hw = cluster.hardware
    m = cluster.gpus_per_node
    recv_max, group_need, local_total = _receive_side(spec, src, dst, s_stages, d_stages, m, dtype_bytes)
    send_intra: dict[int, float] = {}  # destination node -> bytes its same-node sources send
    send_inter = 0.0
    steps = 0
    pieces = max(1, src.layout.tp // dst.layout.tp)  # source pieces per destination slice
    counted: set[tuple[int, int, int]] = set()
    for (node, p_d, t_d, kind), nbytes in group_need.items():
        if kind == "intra":
            send_intra[node] = send_intra.get(node, 0.0) + nbytes
        else:
            send_inter += nbytes
        if (node, p_d, t_d) not in counted:
            counted.add((node, p_d, t_d))
            steps += _tensors(spec, d_stages[p_d]) * pieces
    link_s = max(
        recv_max["intra"] / hw.intra_node_bw,
        recv_max["inter"] / hw.inter_node_bw,
        max(send_intra.values(), default=0.0) / min(src.mesh.size, m) / hw.intra_node_bw,
        send_inter / src.mesh.size / hw.inter_node_bw,
    )
    return link_s + steps * hw.collective_latency_s + 2 * local_total * dtype_bytes / hw.hbm_bw


def _receive_side(
    spec: ModelSpec, src: Placement, dst: Placement, s_stages: tuple[Stage, ...], d_stages: tuple[Stage, ...], m: int,
    dtype_bytes: int,
) -> tuple[dict[str, float], dict[tuple[int, int, int, str], float], float]:
    """Per destination GPU: bytes it misses, split NVLink / NIC by what its node's sources hold.

    Returns (largest receive per link kind, bytes per (node, dst stage, dst tp slice, kind) --
    one broadcast serves a whole node --, parameters already in place summed over GPUs)."""
    s_lay, d_lay = src.layout, dst.layout
    # Source stages present on each node (a tp group never leaves its node, so all its slices are).
    on_node: dict[int, set[int]] = {}
    for rank in range(s_lay.world_size):
        on_node.setdefault((src.mesh.start + rank) // m, set()).add(rank // (s_lay.tp * s_lay.dp))
    full = [_overlap(spec, stage, stage) for stage in d_stages]  # unsharded params per destination stage
    overlaps: dict[tuple[int, int], float] = {}
    near_cache: dict[tuple[int, int], float] = {}  # (node, dst stage) -> params its node's sources hold

    def overlap(p_s: int, p_d: int) -> float:
        found = overlaps.get((p_s, p_d))
        if found is None:
            found = overlaps[(p_s, p_d)] = _overlap(spec, s_stages[p_s], d_stages[p_d])
        return found

    recv_max = {"intra": 0.0, "inter": 0.0}
    group_need: dict[tuple[int, int, int, str], float] = {}
    local_total = 0.0
    coarse_tp, fine_tp = min(s_lay.tp, d_lay.tp), max(s_lay.tp, d_lay.tp)
    for rank in range(d_lay.world_size):
        _, t_d, p_d = d_lay.coords(rank)
        gpu = dst.mesh.start + rank
        node = gpu // m
        local = 0.0
        if src.mesh.start <= gpu < src.mesh.start + src.mesh.size:
            _, t_s, p_s = s_lay.coords(gpu - src.mesh.start)
            fine, coarse = (t_s, t_d) if s_lay.tp >= d_lay.tp else (t_d, t_s)
            if fine // (fine_tp // coarse_tp) == coarse:  # the two tp slices intersect
                local = overlap(p_s, p_d) / fine_tp
        local_total += local
        missing = full[p_d] / d_lay.tp - local
        if missing <= 0:
            continue
        near = near_cache.get((node, p_d))
        if near is None:
            near = near_cache[(node, p_d)] = sum(overlap(s, p_d) for s in on_node.get(node, ()))
        intra_frac = min(1.0, near / full[p_d]) if full[p_d] else 0.0
        for kind, share in (("intra", intra_frac), ("inter", 1.0 - intra_frac)):
            nbytes = missing * share * dtype_bytes
            if nbytes > 0:
                recv_max[kind] = max(recv_max[kind], nbytes)
                key = (node, p_d, t_d, kind)
                group_need[key] = max(group_need.get(key, 0.0), nbytes)
    return recv_max, group_need, local_total
