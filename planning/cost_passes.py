"""Seconds and bytes of one model call's work at one execution, the parts `planning.cost` adds up.

`forward_backward`: inference (one forward) or training (forward, backward, optimizer step per
minibatch, gradient accumulation) of one replica's sequences in micro-batches; `generate_parts`:
prefill and decode in rounds (multi-turn through planning.cost_multiturn). Both return a
breakdown whose `_s` keys are seconds and `_bytes` keys bytes on the fullest GPU; `pass_time`
prices `passes` sweeps of the blocks over some tokens, the roofline `planning.cost` describes.
"""

from __future__ import annotations

import math

from planning.cost_multiturn import observation_bytes, observation_parts, trajectory
from planning.cost_terms import (
    GRAD_ACCUMULATION_TRAFFIC_PER_PARAM,
    OPTIMIZER_TRAFFIC_PER_PARAM,
    SAMPLING_BYTES_PER_LOGIT,
    CallGeometry,
    Links,
    activation_bytes,
    allreduce_s,
    decode_stage_s,
    forward_tokens,
    inference_bytes_per_token_layer,
    reduce_scatter_s,
    sampling_s,
)
from planning.dataflow import MFC
from planning.hardware import HardwareSpec
from planning.layout import Layout
from planning.offload import optimizer_parts

# HBM bytes moved per cached value an attention reads from an e4m3 (FP8) KV cache, as time: what
# a bf16 cache's read of that many bytes per value would take. The Triton decode kernel loads it
# as it is, on GPUs with e4m3 (HardwareSpec.fp8_matmul: compute capability 8.9 on): one byte, but
# measured no faster than a bf16 cache (H200, 2026-12-05, generate_bench.py --grpo-step: decode
# 2.055 s bf16, 2.054 s with the e4m3 cache; the kernel reads its half-size cache at ~60% of HBM
# where the bf16 one reaches ~95%), so it is priced as 2 until the kernel is tuned for it.
# Elsewhere decode runs SDPA on a widened copy: read 1, write 2, read 2. A multi-turn
# observation prefill always gathers the history token-major first (its in-place FlashAttention
# read takes the queries' dtype only): read 1, write 1, then widen and attend as above.
E4M3_TRITON_READ_BYTES = 2.0
E4M3_WIDENED_READ_BYTES = 5.0
E4M3_GATHERED_READ_BYTES = 7.0

# A forward over shared prompts (actors.engine.shared_prefix_attention) adds per block, micro-batch
# and pass the fixed time of about this many kernel launches (`HardwareSpec.kernel_overhead_s`):
# measured for the cascade (a second FlashAttention call, the merge, two copies; 240-480 us per
# block and micro-batch on an H200, docs/benchmarks.md, seventh step). Its successor, the K/V
# gather and one varlen call (fifteenth step), is priced the same: its gather and scatter kernels
# took ~0.34 ms per layer and micro-batch beside the attention kernels' 1.42 (seventeenth step,
# before its backward stopped widening every row), about the cascade's measured extra.
CASCADE_OVERHEAD_KERNELS = 5


def kv_read_bytes(fp8_cache: bool, hw: HardwareSpec, observation: bool = False) -> float:
    """Bytes moved per cached value read by a decode step (or, `observation`, by a multi-turn
    observation prefill, which reads a bf16 cache in place): 2 for a bf16 cache."""
    if not fp8_cache:
        return 2.0
    if observation:
        return E4M3_GATHERED_READ_BYTES
    return E4M3_TRITON_READ_BYTES if hw.fp8_matmul else E4M3_WIDENED_READ_BYTES


def pass_time(
    geo: CallGeometry, layout: Layout, links: Links, tokens: int, n_micro: int, ctx: float, passes: int,
) -> dict[str, float]:
    """Seconds of `passes` sweeps (1 = forward, 3 = forward + backward) over `tokens` tokens of
    one replica split into `n_micro` micro-batches, on the slowest pipeline stage."""
    hidden = geo.spec.hidden_size
    mb_tokens = tokens / n_micro
    # Roofline per micro-batch and pass: the matmuls cannot beat streaming the stage's bf16
    # weights from HBM once, so short micro-batches are memory-bound, not free.
    # Each micro-batch's GEMMs also pay a ramp and a partly filled last wave, about as long as
    # `gemm_ramp_tokens` more tokens (on an H200, 512: an 8B model's 1024-token micro-batches run
    # ~2/3 as fast as long ones).
    matmul_s = (mb_tokens + links.hw.gemm_ramp_tokens) * geo.stage_flops_per_token(ctx) / links.flops
    compute = passes * n_micro * max(matmul_s, 2.0 * geo.stage_params / links.hbm)
    # Norms, residuals, rotary, activations: memory-bound, and mostly not split by tp.
    elementwise = passes * tokens * geo.stage_layers * geo.layer_elementwise_bytes / links.elementwise_hbm
    overhead = passes * n_micro * geo.stage_layers * links.hw.kernel_overhead_s
    # 2 all-reduces of a (mb_tokens, hidden) bf16 activation per layer per direction.
    directions = 1 if passes == 1 else 2
    tp = directions * n_micro * geo.stage_layers * 2 * allreduce_s(mb_tokens * hidden * 2, layout.tp, links.tp_bw, links.lat)
    stage = compute + elementwise + overhead + tp
    out = {"compute_s": compute, "elementwise_s": elementwise, "kernel_overhead_s": overhead, "tp_comm_s": tp}
    if layout.pp > 1:
        out["pp_bubble_s"] = stage * (layout.pp - 1) / n_micro
        # Each micro-batch crosses pp-1 stage boundaries per direction; sends overlap compute
        # except along the pipeline's fill/drain path (n_micro + pp - 1 sends).
        send = links.lat + mb_tokens * hidden * 2 / links.pp_bw
        out["pp_p2p_s"] = directions * (n_micro + layout.pp - 1) * send
    return out


def cascade_s(mfc: MFC, geo: CallGeometry, links: Links, n_micro: int, passes: int) -> float:
    """The shared prompts' cascade attention: fixed time per block, micro-batch and pass (0
    where the rows share no prompt)."""
    if mfc.batch.prompt_group <= 1 or mfc.batch.prompt_len == 0:
        return 0.0
    return passes * n_micro * geo.stage_layers * CASCADE_OVERHEAD_KERNELS * links.hw.kernel_overhead_s


def forward_backward(
    mfc: MFC, geo: CallGeometry, layout: Layout, links: Links, seqs: int, n_micro: int, offload: float = 0.0,
) -> tuple[dict[str, float], float]:
    """Inference (one forward) or training (forward + backward + optimizer per minibatch) of
    `seqs` sequences per replica in `n_micro` micro-batches, and the host bytes per GPU (the
    `offload` fraction of the optimizer state, planning.offload)."""
    train = mfc.kind == "train"
    steps = mfc.n_minibatches if train else 1
    tokens, ctx = forward_tokens(mfc.batch, seqs, steps)
    parts = {k: steps * v for k, v in pass_time(geo, layout, links, tokens, n_micro, ctx, 3 if train else 1).items()}
    if cascade := cascade_s(mfc, geo, links, n_micro, 3 if train else 1):
        parts["cascade_s"] = steps * cascade
    parts["weights_bytes"] = 2.0 * geo.stage_params
    parts["activation_bytes"] = activation_bytes(geo, layout, tokens / n_micro, min(layout.pp, n_micro), train,
                                                  mfc.with_entropy, links.hw.fused_elementwise)
    parts["micro_batches"] = float(n_micro)  # informational: neither seconds nor bytes
    if train and mfc.recompute_forward:
        # One forward over the replica's whole batch (every minibatch), in micro-batches of the
        # same token budget, before the optimizer steps.
        all_seqs = math.ceil(mfc.batch.n_seqs / layout.dp)
        n_all = min(all_seqs, max(1, math.ceil(all_seqs * n_micro / seqs)))
        all_tokens, all_ctx = forward_tokens(mfc.batch, all_seqs, 1)
        forward = pass_time(geo, layout, links, all_tokens, n_all, all_ctx, 1)
        parts["recompute_s"] = sum(forward.values()) + cascade_s(mfc, geo, links, n_all, 1)
    if train:
        # Gradients accumulate in fp32 (the optimizer's main_grad, actors.engine.optimizer), the
        # buffer ZeRO-1 reduce-scatters; the updated fp32 master slices are all-gathered back.
        grad_bytes = 4.0 * geo.stage_params
        parts["dp_comm_s"] = steps * 2 * reduce_scatter_s(grad_bytes, layout.dp, links.dp_bw, links.lat)
        shard = geo.stage_params / layout.dp
        parts["optimizer_s"] = steps * (shard * OPTIMIZER_TRAFFIC_PER_PARAM / links.opt_hbm + links.hw.kernel_overhead_s)
        # The linear layers (the blocks' projections, an untied head or a critic's score) add
        # their weight gradients into that buffer inside the GEMM (actors.engine.main_grad);
        # the rest (the embedding, a tied head, norms) pass through .grad and a hook.
        head = 0.0 if geo.spec.tie_embeddings and not geo.critic else geo.head_flops / 2
        hooked = max(0.0, geo.stage_params - geo.stage_layers * geo.layer_matmul_flops / 2 - head)
        parts["grad_accumulation_s"] = steps * n_micro * hooked * GRAD_ACCUMULATION_TRAFFIC_PER_PARAM / links.opt_hbm
        parts["grad_bytes"] = grad_bytes
        optimizer, host = optimizer_parts(shard, offload, links.hw.host_bw, steps)
        parts.update(optimizer)
        return parts, host
    return parts, 0.0


def generate_parts(mfc: MFC, geo: CallGeometry, layout: Layout, links: Links, seqs: int, rounds: int) -> dict[str, float]:
    """`rounds` rounds, each a prefill of its prompts then gen_len decode steps, memory- or
    compute-bound per step; only one round's KV cache is alive at a time. Multi-turn: every
    turn's decode steps, observation prefills and environment waits (planning.cost_multiturn)."""
    batch = mfc.batch
    traj = trajectory(batch, mfc.multi_turn)
    spec = geo.spec
    per_round = math.ceil(seqs / rounds)
    # A round prefills its prompts in one packed pass (pp = 1), each distinct prompt once (a
    # group of samples shares it), or every row's prompt in one pass per pipeline micro-batch.
    distinct = math.ceil(per_round / batch.prompt_group) if layout.pp == 1 else per_round
    prompt_tokens = distinct * max(batch.prompt_len, 1)
    n_prefill = min(per_round, layout.pp)
    prefill = pass_time(geo, layout, links, prompt_tokens, n_prefill, batch.prompt_len / 2, 1)
    parts = {"prefill_s": prefill.pop("compute_s")}
    parts.update(prefill)
    # Decode: a round is cut into min(seqs, pp) micro-batches so every stage has work; each
    # step every stage streams its weights once per micro-batch plus that micro-batch's KV cache.
    weights = 2.0 * geo.stage_params
    n_mb = min(per_round, layout.pp)
    mb = per_round / n_mb
    # Rows of one prompt read its cached K/V from one copy (the Triton decode attention's shared
    # prefix, pp = 1): HBM serves a group's prompt slots once, L2 the rest.
    shared = batch.prompt_len * (1 - 1 / batch.prompt_group) if layout.pp == 1 else 0.0
    kv_itemsize = 1.0 if mfc.fp8_kv_cache else 2.0  # held
    per_mb_stage = decode_stage_s(geo, links, mb, traj.ctx - shared, mfc.fp8_decode,
                                  kv_read_bytes(mfc.fp8_kv_cache, links.hw))
    tp_s = geo.stage_layers * 2 * allreduce_s(mb * spec.hidden_size * 2, layout.tp, links.tp_bw, links.lat)
    slots = max(n_mb, layout.pp)  # a step takes max(n_mb, pp) stage slots in steady state
    steps = traj.decode_steps
    parts["decode_s"] = steps * slots * per_mb_stage
    # The last stage samples every micro-batch every step; it is then the busiest stage.
    parts["sampling_s"] = steps * slots * sampling_s(spec.vocab_size, mb, layout.tp, links, mfc.truncated_sampling)
    parts["kernel_overhead_s"] = parts.get("kernel_overhead_s", 0.0) + steps * slots * geo.stage_layers * links.hw.kernel_overhead_s
    parts["setup_s"] = geo.stage_layers * links.hw.generate_setup_s
    parts["tp_comm_s"] = parts.get("tp_comm_s", 0.0) + steps * slots * tp_s
    if layout.pp > 1:
        send = links.lat + mb * spec.hidden_size * 2 / links.pp_bw
        parts["pp_p2p_s"] = parts.get("pp_p2p_s", 0.0) + steps * slots * send
        parts["pp_bubble_s"] = parts.get("pp_bubble_s", 0.0) + (layout.pp - 1) * per_mb_stage  # pipeline fill
    if mfc.multi_turn is not None:
        parts.update(observation_parts(geo, layout, links, per_round, traj,
                                       kv_read_bytes(mfc.fp8_kv_cache, links.hw, observation=True)))
    parts = {k: rounds * v for k, v in parts.items()}
    parts["weights_bytes"] = weights
    if mfc.fp8_decode:  # the call's FP8 copies (one byte per weight; the row scales are noise)
        parts["fp8_weights_bytes"] = geo.fp8_stage_params()
    kv_per_slot = geo.kv_bytes_per_token_layer * geo.stage_layers * kv_itemsize / 2.0
    parts["kv_cache_bytes"] = per_round * traj.kv_slots * kv_per_slot
    # Prefill keeps the logits of each prompt's last token only, so its peak is a block's working
    # set (plus, for shared prompts, a layer's K/V copied out to every row); sampling's
    # [rows, vocab] buffers (gathered on tp rank 0) are the other candidate.
    prefill_bytes = prompt_tokens / n_prefill * inference_bytes_per_token_layer(spec, layout.tp)
    if distinct < per_round:
        prefill_bytes += per_round * batch.prompt_len * geo.kv_bytes_per_token_layer
    parts["activation_bytes"] = max(prefill_bytes, per_round * spec.vocab_size * SAMPLING_BYTES_PER_LOGIT,
                                    observation_bytes(geo, layout, per_round, traj))
    parts["generation_rounds"] = float(rounds)  # informational
    return parts
