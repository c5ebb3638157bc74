"""The model engine: a plain LLaMA-family model, its parallel layers, and one rank's shard of it
under a (dp, tp, pp) layout with train and inference steps.

May import actors.kernels and actors.rl (the `LossSums` a loss returns), never generation,
realloc or worker. In dependency order:
  process_groups  `ParallelGroups`, the frozen per-layout groups every parallel component takes
  packing         `PackedBatch`: sequences concatenated with `cu_seqlens`, no padding
  attention       causal attention over packed batches (varlen / flash / SDPA) and the KV cache
  model           the plain decoder (Llama 2/3, Qwen2, Mistral), no torch.distributed
  tp_layers       Column/RowParallelLinear, VocabParallelEmbedding and the region mappings
  parallelize     keep_pp_stage -> apply_tp -> materialise: the shard one rank holds
  pipeline        micro-batch splitting, 1F1B training and fill-drain inference schedules
  logprobs        token logprobs and entropy from vocab-parallel logits
  optimizer       AdamW with fp32 master weights sharded over dp (ZeRO-1), LR schedule
  model_engine    `ModelEngine`: train and inference steps over `SequenceBatch`es, every batch's ids
                  checked against the vocabulary on the host first
  hf_io           safetensors slices into a shard, shards back into an HF directory
"""

from __future__ import annotations

from actors.engine.attention import CacheLayerShape, KVCache, attention_over_history, expand_kv_heads, packed_attention
from actors.engine.hf_io import export_hf_checkpoint, gather_tp_shards, load_hf_checkpoint, merge_stage_states
from actors.engine.model_engine import LossFn, ModelEngine, SequenceBatch, TokenIdError, check_token_ids
from actors.engine.optimizer import OPTIMIZER_STATE_KEYS, AdamWConfig, ShardedAdamW, adamw_config_from
from actors.engine.packing import PackedBatch, pack_sequences
from actors.engine.parallelize import build_model_shard, named_trainable_parameters, norm_excluded_names
from actors.engine.process_groups import (
    ParallelGroups,
    broadcast_from_first,
    build_parallel_groups,
    free_port,
    init_local_world,
    lookup_parallel_groups,
    node_address,
    world_timeout,
)
from actors.engine.tp_layers import reduce_from_tp_region

__all__ = [
    # process_groups.py
    "ParallelGroups", "broadcast_from_first", "build_parallel_groups", "free_port", "init_local_world",
    "lookup_parallel_groups", "node_address", "world_timeout",
    # packing.py
    "PackedBatch", "pack_sequences",
    # attention.py
    "CacheLayerShape", "KVCache", "attention_over_history", "expand_kv_heads", "packed_attention",
    # parallelize.py
    "build_model_shard", "named_trainable_parameters", "norm_excluded_names",
    # optimizer.py
    "AdamWConfig", "OPTIMIZER_STATE_KEYS", "ShardedAdamW", "adamw_config_from",
    # model_engine.py
    "LossFn", "ModelEngine", "SequenceBatch", "TokenIdError", "check_token_ids",
    # hf_io.py
    "export_hf_checkpoint", "gather_tp_shards", "load_hf_checkpoint", "merge_stage_states",
    # tp_layers.py (generation's FP8 MLP reduces its row-parallel output)
    "reduce_from_tp_region",
]
