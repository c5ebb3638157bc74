"""Per-GPU shapes, memory terms and communication formulas the cost model (`planning.cost`) is
built from.

`call_geometry` turns (model, critic?, tp, pp) into what one GPU of the fullest pipeline stage
holds and computes: parameters, decoder blocks, FLOPs per token and KV-cache bytes. It is cached
because the stage partition is a dynamic programme over layers and the search asks for the same
(model, layout) thousands of times. `Links` holds a placement's effective rates (peaks times
the efficiency factors). `activation_bytes` and the per-token counts it uses give the
transient memory of a call as the engine allocates it (tests/planning/test_cost_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planning.dataflow import BatchShape
from planning.efficiency import OpEfficiency
from planning.hardware import HardwareSpec
from planning.layout import Layout
from planning.models import ModelSpec, kv_replicated, pipeline_partition, validate_tp
from planning.plan import Placement

# HBM bytes one optimizer step moves per parameter of its shard, kernel by kernel as
# actors.engine.optimizer runs it on fp32 slices, counted in 4-byte reads (r) and writes (w):
# zero the gradient buffer (w), scale it (r w), the norm's square and sum (r w r), clipping
# (r w), m and v (mul r w, add / addcmul r r w: 5 each), weight decay (r w), the denominator's
# sqrt, divide and +eps (6), addcdiv (r r r w): 30 x 4 bytes; then the bf16 copy into the
# parameters (read 4, write 2): 126 bytes. Measured on an H200 (issue 27, docs/benchmarks.md):
# a 1B model's training call costs ~35 ms more per extra optimizer step; 126 x 1.24B / 4.3 TB/s
# is 36 ms.
OPTIMIZER_TRAFFIC_PER_PARAM = 126
# And per micro-batch of a train call, for each parameter outside the linear layers (the
# embedding, a tied head, norms; linear layers accumulate in their GEMM): backward writes its bf16
# gradient (2 bytes), which the accumulation hook adds into the fp32 buffer (read 2 + 4, write 4).
GRAD_ACCUMULATION_TRAFFIC_PER_PARAM = 12
# Host seconds per response token of a model-free call (`MFC.model_free`: a rule-based reward
# decodes every response with the actor's tokenizer and scores it on the workers' host threads).
# The peer bench's 512 x 512 response tokens and a length rule (benchmarks/reward_host_bench.py):
# 76-89 ms a call on the 2-core development machine since responses decode in the tokenizer's
# parallel backend and the rows score in one helper-thread task (actors.worker.texts,
# actors.worker.guards), 205-305 ms before; on the H200 host the peer bench's call took 0.072 s
# against this price's 0.079 (0.12-0.27 s before: issue 27, docs/benchmarks.md, eleventh and
# twelfth steps).
MODEL_FREE_S_PER_TOKEN = 3e-7
# The same call where the actor's tokenizer decodes through a byte table (a byte-level BPE:
# actors.worker.byte_level), set from the GPU host: the peer bench's call took 0.028-0.046 s
# (median 0.035) on an H100 machine's host, 16.5 ms on the 2-core development machine (75 ms
# there through the backend's decode_batch): issue 27, thirtieth step.
BYTE_TABLE_S_PER_TOKEN = 1.3e-7
# Bytes per [token, vocab/tp] logit while training: the bf16 logits the fused logprob kernel
# saves for backward and the bf16 gradient it writes (actors.kernels.fused_logprobs).
TRAIN_LOGIT_BYTES = 4
# More with an entropy bonus (ppo.entropy_coef > 0): the entropy saves float32 probabilities and
# shifted logits, and its backward holds two more float32 [token, vocab/tp] temporaries.
ENTROPY_LOGIT_BYTES = 16
# Bytes per [row, vocab] logit while sampling a step: gathered bf16 logits, fp32 scaled and
# sorted values, int64 sort indices, fp32 cumulative probabilities (top-k/top-p; less without).
SAMPLING_BYTES_PER_LOGIT = 22
# HBM sweeps over the [rows, vocab] fp32 logits per sampling step: scale/softmax, a segmented
# sort for top-p (a few radix passes over keys + indices), cumsum and the final pick.
SAMPLING_PASSES = 8
# Greedy or plain temperature sampling: the head writes the bf16 logits and the fused kernel
# reads them once (actors.kernels.fused_sampling; ~0.05 s over the peer bench's 512 decode steps
# of 512 rows, where 8 fp32 sweeps priced 0.51 s).
FUSED_SAMPLING_BYTES_PER_LOGIT = 4
# FP8 decode (sampling.fp8): how much faster the MLPs' and head's matmuls run with e4m3 operands,
# their activations' per-row quantization included, priced as bf16-equivalent FLOPs. Fitted to
# the whole decode on an H200 (benchmarks/generate_bench.py --grpo-step, 2026-12-05, fifteenth
# step: 2.055 s in bf16, 1.713 s with FP8 weights; this factor prices the peer bench's generation
# 0.338 s faster, measured 0.342). The GEMMs alone gave 1.3 (fp8_gemm_bench.py: 1.659 ms of bf16
# [gate; up], down and head per step against 1.277 ms with the quantization); inside the compiled
# step the quantization fuses into the norm and gate kernels before it.
FP8_DECODE_SPEEDUP = 1.9
# torch._scaled_mm takes e4m3 weights whose two dims are multiples of 16; the worker keeps any
# other weight in bf16 (actors.generation.fp8_weights.FP8_ALIGN, which a test holds equal).
FP8_ALIGN = 16


# Non-matmul work of a decoder block in the engine's forward/backward passes (RMSNorms, residual
# adds, rotary, the SiLU gate, casts and copies around them), as effective HBM bytes per token per
# block per pass. Without sequence parallelism the ops on [tokens, hidden] run whole on every tp
# rank; those on the MLP's [tokens, intermediate / tp] split with it. Fitted on two H200s
# (2026-11-30, `benchmarks/engine_bench.py --profile`, Llama-3.2-1B, forward of 64.9k tokens):
# GPU time of kernels that are neither matmul, attention, NCCL nor logprobs was 128.1 ms at tp=1
# and 100.0 ms per GPU at tp=2, i.e. 71.9 ms replicated + 56.2 ms split; per token and block at
# the measured 4.145 TB/s that is 140 bytes per hidden unit and 27 bytes per intermediate unit
# (the training step's three passes gave within 8% of the same). Decode steps are not charged:
# their compiled, fused step is fitted as a whole (efficiency `decode`). Since issue 27 the engine
# fuses these ops on CUDA; fitted to whole calls of 1B-8B models (PRESET_EFFICIENCY) the term
# kept about this size (h200 factor 1.07, 1.30 since the ninth step): it also carries what the
# FLOP count prices too low (attention below the GEMM rate, the logprob kernels), which
# whole-call times cannot tell apart.
ELEMENTWISE_BYTES_PER_HIDDEN = 140.0
ELEMENTWISE_BYTES_PER_INTERMEDIATE = 27.0


@dataclass(frozen=True)
class CallGeometry:
    """What one GPU of a (tp, pp) layout holds and computes, on its fullest / slowest stage.

    stage_params: parameters on the fullest GPU (tp-split ones divided by tp).
    stage_layers: decoder blocks of the deepest stage.
    stage_blocks: decoder blocks per stage; the last stage also runs the head.
    layer_matmul_flops: forward FLOPs per token of one block's matmuls on one GPU.
    attn_flops_per_ctx: forward attention FLOPs per token per key attended, one block, one GPU.
    head_flops: forward FLOPs per token of the LM / value head on one GPU.
    kv_bytes_per_token_layer: bf16 K and V one GPU caches per token per block.
    layer_elementwise_bytes: HBM bytes one block's non-matmul ops move per token and pass on one
        GPU (see ELEMENTWISE_BYTES_PER_HIDDEN).
    layer_mlp_params: one block's MLP weights on one GPU (gate, up and down), the part of a
        block an FP8 decode copies (actors.generation.fp8_weights).
    """

    spec: ModelSpec
    critic: bool
    stage_params: float
    stage_layers: int
    stage_blocks: tuple[int, ...]
    layer_matmul_flops: float
    attn_flops_per_ctx: float
    head_flops: float
    kv_bytes_per_token_layer: float
    layer_elementwise_bytes: float = 0.0
    layer_mlp_params: float = 0.0

    def fp8_stage_params(self) -> float:
        """Weights of the deepest stage an FP8 decode holds as FP8 copies: its blocks' MLPs
        and the head (an actor's LM head on the last stage; pp = 1 takes both together). A
        weight whose local dims are not multiples of FP8_ALIGN stays bf16, as the worker does."""
        h = self.spec.hidden_size
        local_ffn = self.layer_mlp_params / (3.0 * h)  # intermediate_size / tp
        local_vocab = self.head_flops / (2.0 * h)  # vocab_size / tp (1 for a critic's value head)
        mlps = self.stage_layers * self.layer_mlp_params if fp8_aligned(h, local_ffn) else 0.0
        head = self.head_flops / 2 if not self.critic and fp8_aligned(h, local_vocab) else 0.0
        return mlps + head

    def stage_flops_per_token(self, ctx: float) -> float:
        """Forward FLOPs per token on the slowest stage, attending to `ctx` keys on average."""
        window = self.spec.sliding_window
        ctx = min(ctx, window) if window else ctx
        per_block = self.layer_matmul_flops + self.attn_flops_per_ctx * ctx
        last = len(self.stage_blocks) - 1
        return max(b * per_block + (self.head_flops if s == last else 0.0) for s, b in enumerate(self.stage_blocks))


def fp8_aligned(*dims: float) -> bool:
    """Whether every dim is a whole multiple of FP8_ALIGN (dims may come from float arithmetic)."""
    return all(round(d) == d and round(d) % FP8_ALIGN == 0 for d in dims)


def call_geometry(spec: ModelSpec, critic: bool, layout: Layout) -> CallGeometry | str:
    """The geometry of (spec, tp, pp), or a string saying why the layout cannot shard the model."""
    return _geometry(spec, critic, layout.tp, layout.pp)


@lru_cache(maxsize=4096)
def _geometry(spec: ModelSpec, critic: bool, tp: int, pp: int) -> CallGeometry | str:
    try:
        validate_tp(spec, tp)
        partition = pipeline_partition(spec, pp, critic)
    except ValueError as err:
        return str(err)
    h, d = spec.hidden_size, spec.head_dim
    q_dim, kv_dim = spec.n_heads * d, spec.n_kv_heads * d
    kv_split = 1 if kv_replicated(spec, tp) else tp
    # One block on one GPU: q and o column/row split, k and v split unless replicated, MLP split.
    block_matmul = (2 * h * q_dim + 3 * h * spec.intermediate_size) / tp + 2 * h * kv_dim / kv_split
    block_other = 2 * h + ((q_dim / tp + 2 * kv_dim / kv_split) if spec.qkv_bias else 0)
    embed = spec.vocab_size * h / tp
    if critic:
        head = float(h)
    else:
        head = 0.0 if (spec.tie_embeddings and pp == 1) else embed
    blocks = tuple(end - start for start, end in partition)
    stage_params = []
    for s, b in enumerate(blocks):
        params = b * (block_matmul + block_other)
        params += embed if s == 0 else 0.0
        params += (head + h) if s == len(blocks) - 1 else 0.0
        stage_params.append(params)
    head_cols = 1 if critic else spec.vocab_size / tp
    return CallGeometry(
        spec=spec,
        critic=critic,
        stage_params=max(stage_params),
        stage_layers=max(blocks),
        stage_blocks=blocks,
        layer_matmul_flops=2.0 * block_matmul,
        # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add x q_dim/tp per key.
        attn_flops_per_ctx=4.0 * q_dim / tp,
        head_flops=2.0 * h * head_cols,
        kv_bytes_per_token_layer=2 * 2 * kv_dim / kv_split,
        layer_elementwise_bytes=(ELEMENTWISE_BYTES_PER_HIDDEN * h
                                 + ELEMENTWISE_BYTES_PER_INTERMEDIATE * spec.intermediate_size / tp),
        layer_mlp_params=3.0 * h * spec.intermediate_size / tp,
    )


def activation_bytes_per_token_layer(spec: ModelSpec, tp: int, fused: bool = False) -> float:
    """Bytes one block stores per token for backward (no recomputation, no sequence parallelism).

    Eager (`fused=False`, the CPU setup), whole on every tp rank: each of the two RMSNorms saves
    its float32 input (it normalises in float32, as HF does), its bf16 normalised value and its
    output (the projections' input): 8 h bytes each. Split by tp (bf16): q, the attention
    output, K and V as the attention kernel saves them, gate, up, the SiLU output and the
    product. K and V are counted expanded to the query heads, as the varlen kernel of
    torch < 2.12 takes them (GQA kernels save less). Fused (CUDA: the engine compiles the norms,
    rotary and SwiGLU gate, `actors.engine.model.set_elementwise_fusion`): a norm keeps its bf16
    input and output (4 h bytes), the gate its bf16 gate and up, the down projection its input;
    on an H200 that is 53.1 GiB against 53.9 measured for the 1B training call of 16 x 16384
    tokens (61.1 GiB counted eager)."""
    h, d = spec.hidden_size, spec.head_dim
    q_dim, kv_dim = spec.n_heads * d, spec.n_kv_heads * d
    kv_split = 1 if kv_replicated(spec, tp) else tp
    whole_bytes = 2 * (4 if fused else 8) * h
    mlp = (3 if fused else 4) * spec.intermediate_size
    split = (2 * q_dim + mlp) / tp + 2 * max(q_dim / tp, kv_dim / kv_split)
    return whole_bytes + 2.0 * split


def inference_bytes_per_token_layer(spec: ModelSpec, tp: int) -> float:
    """bf16 working set of one block per token in a forward without autograd, at its fullest: the
    residual stream, the norm output and the block input whole, plus either the MLP's gate
    activation, up projection and their product, or attention's q, k, v, rotated q and k, and
    output (split by tp), whichever is larger. Earlier blocks' tensors are already freed."""
    h, d = spec.hidden_size, spec.head_dim
    q_dim, kv_dim = spec.n_heads * d, spec.n_kv_heads * d
    kv_split = 1 if kv_replicated(spec, tp) else tp
    mlp = 3 * spec.intermediate_size / tp
    attention = 3 * q_dim / tp + 4 * kv_dim / kv_split
    return 2.0 * (4 * h + max(mlp, attention))


def activation_bytes(geo: CallGeometry, layout: Layout, mb_tokens: float, in_flight: int, train: bool,
                      with_entropy: bool = False, fused: bool = False) -> float:
    """Activation memory of the fullest stage: stored activations of `in_flight` micro-batches
    plus the logits and their gradient on the last stage (train), or the larger of one block's
    working set and the head's (inference: the blocks' tensors are freed before the head runs)."""
    head_cols = 1 if geo.critic else geo.spec.vocab_size / layout.tp
    if train:
        logit_bytes = TRAIN_LOGIT_BYTES + (ENTROPY_LOGIT_BYTES if with_entropy and not geo.critic else 0)
        logits = mb_tokens * head_cols * logit_bytes
        stored = activation_bytes_per_token_layer(geo.spec, layout.tp, fused)
        return in_flight * mb_tokens * stored * geo.stage_layers + logits
    block = mb_tokens * inference_bytes_per_token_layer(geo.spec, layout.tp)
    # The fused logprob kernels read the bf16 logits in place; the final hidden states and their
    # norm stay alive beside them.
    head = mb_tokens * (head_cols * 2 + 2 * geo.spec.hidden_size * 2)
    return max(block, head)


class Links:
    """Effective rates for one placement: FLOP/s, HBM bytes/s and the bandwidth of each group."""

    def __init__(self, hw: HardwareSpec, eff: OpEfficiency, placement: Placement) -> None:
        layout, mesh = placement.layout, placement.mesh
        m = mesh.gpus_per_node
        self.hw = hw
        self.flops = hw.peak_flops * eff.gemm
        self.hbm = hw.hbm_bw * eff.decode
        self.opt_hbm = hw.hbm_bw * eff.optimizer
        self.elementwise_hbm = hw.hbm_bw * eff.elementwise
        self.tp_bw = hw.intra_node_bw * eff.comm * eff.tp_comm
        self.dp_bw = dp_bandwidth(hw, layout, m) * eff.comm
        self.pp_bw = p2p_bandwidth(hw, mesh.size, m) * eff.comm
        self.lat = hw.collective_latency_s


def allreduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n of the bytes through each link."""
    if n <= 1:
        return 0.0
    return latency + 2.0 * (n - 1) / n * nbytes / bw


def reduce_scatter_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring reduce-scatter (or all-gather) of `nbytes` over `n` ranks: (n-1)/n of the bytes."""
    if n <= 1:
        return 0.0
    return latency + (n - 1) / n * nbytes / bw


def dp_bandwidth(hw: HardwareSpec, layout: Layout, gpus_per_node: int) -> float:
    """A dp group spans dp*tp consecutive GPUs (tp fastest): the NIC once that leaves a node."""
    return hw.inter_node_bw if layout.dp * layout.tp > gpus_per_node else hw.intra_node_bw


def p2p_bandwidth(hw: HardwareSpec, mesh_size: int, gpus_per_node: int) -> float:
    """Neighbouring stages are dp*tp GPUs apart: some boundary crosses a node once the mesh does."""
    return hw.inter_node_bw if mesh_size > gpus_per_node else hw.intra_node_bw


def decode_stage_s(geo: CallGeometry, links: Links, rows: float, ctx: float, fp8: bool = False,
                   kv_itemsize: float = 2.0) -> float:
    """One decode step of `rows` sequences reading `ctx` cached keys from HBM on average, on the slowest
    stage: the projections and the head (one token per row) then the attention, as separate
    kernels. The projections are bound by streaming the stage's bf16 weights for small batches
    and by their FLOPs for large ones (2 * rows * params: at 512 rows a 1B model's step is
    compute-bound on an H200); the attention reads each row's cached K/V once, which no batch
    size amortises. The two do not overlap (one stream), so their times add. `fp8`: the MLPs and
    head stream one byte per weight and multiply FP8_DECODE_SPEEDUP times faster, on hardware with
    FP8 matmuls (`HardwareSpec.fp8_matmul`; the CPU's emulation is priced as bf16); `kv_itemsize`:
    HBM bytes moved per cached value read (2 for bf16; an FP8 cache: cost_passes.kv_read_bytes)."""
    flops = rows * geo.stage_flops_per_token(0.0)
    weight_bytes = 2.0 * geo.stage_params
    if fp8 and links.hw.fp8_matmul:
        fp8_params = geo.fp8_stage_params()
        weight_bytes -= fp8_params  # one byte instead of two
        flops -= 2.0 * rows * fp8_params * (1.0 - 1.0 / FP8_DECODE_SPEEDUP)  # as bf16-equivalent FLOPs
    projections = max(weight_bytes / links.hbm, flops / links.flops)
    kv_read = rows * ctx * geo.kv_bytes_per_token_layer * geo.stage_layers * kv_itemsize / 2.0
    return projections + kv_read / links.hbm


def forward_tokens(batch: BatchShape, seqs: float, minibatches: int) -> tuple[float, float]:
    """(tokens, mean attention context per token) of a replica's forward over `seqs` rows in one
    of `minibatches` shuffled minibatches. Each prompt its rows share is held once
    (actors.engine.shared_prefix): a prompt of g rows is in a given minibatch with probability
    1 - (1 - 1/m)^g and its rows there share one copy (groups cut at micro-batch boundaries are
    not counted; DPO's pairs, which its minibatches keep whole, are priced as shuffled rows too:
    a little less sharing than runs). The held-once prompt tokens attend p/2 keys on average,
    every answer token still p + its position: sharing removes tokens, not the answers'
    attention."""
    p, n = batch.prompt_len, batch.gen_len
    g, m = batch.prompt_group, max(minibatches, 1)
    if g <= 1 or p == 0:
        return seqs * batch.seq_len, batch.seq_len / 2
    distinct = min(seqs, seqs * m / g * (1.0 - (1.0 - 1.0 / m) ** g))  # prompts among the rows
    tokens = distinct * p + seqs * n
    return tokens, (distinct * p * p / 2 + seqs * n * (p + n / 2)) / tokens


def sampling_s(vocab: int, rows: float, tp: int, links: Links, truncated: bool = False) -> float:
    """One sampling step of `rows` sequences, as `actors.generation.sampling.sample_tensor_parallel` does it:
    under tp, tp rank 0 gathers the vocab-parallel bf16 logits [rows, vocab/tp] of the others
    and broadcasts tokens, logprobs and kept counts (3 latency-bound broadcasts). With top-k /
    top-p (`truncated`) it samples over [rows, vocab] fp32 logits: softmax, sort and cumsum,
    modelled as SAMPLING_PASSES read+write sweeps of HBM; greedy or plain temperature sampling
    is one fused kernel reading the bf16 logits the head wrote (actors.kernels.fused_sampling)."""
    comm = 0.0
    if tp > 1:
        comm = links.lat + (tp - 1) * rows * vocab / tp * 2 / links.tp_bw + 3 * links.lat
    per_logit = SAMPLING_PASSES * 2 * 4 if truncated else FUSED_SAMPLING_BYTES_PER_LOGIT
    return comm + per_logit * rows * vocab / links.hbm + links.hw.kernel_overhead_s
