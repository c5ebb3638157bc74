"""Batched generation with a static KV cache: packed prefill, decode loop, per-sequence stopping.

    out = generate(model, prompts, GenerationConfig(max_new_tokens=64, eos_token_id=2), groups)

`model` is a `Transformer` (or its tensor-parallel shard; pipeline stages go through
actors.generation.pipelined, which `generate` dispatches to when groups.layout.pp > 1). Prompts are 1-D
token tensors of different lengths. The call:
1. checks that the KV cache (n_seqs x (max_prompt + max_new_tokens) per layer), the fused
   [q; k; v] weights and the logits fit in free memory, failing with the bytes needed and
   available before allocating anything;
2. prefills all prompts packed (varlen attention), writing K/V into the cache;
3. decodes one token per sequence per step until every sequence has emitted EOS or
   max_new_tokens tokens. Finished sequences keep a fixed slot in the (static-shape) step, but
   their tokens are ignored; the loop ends when all are done;
4. frees the cache and returns a frozen `GenerationOutput` (packed prompt+response ids,
   logprobs and top-k/top-p kept counts per response token, response lengths, no-EOS mask).

On CUDA with `use_cuda_graph` the decode step (the model forward over the cache) is captured as a
CUDA graph within the call; sampling (a fused kernel for greedy and untruncated sampling, see
actors.kernels.fused_sampling) runs eagerly after it. With the default Triton decode attention one
graph serves every step (the kernel reads each sequence's own length); with "sdpa"/"matmul" there
is one graph per attention-length bucket (the cache read up to the longest sequence, rounded up to
`attend_bucket` slots). `DecodeStep` re-captures (and re-concatenates the fused [q; k; v]
weights) whenever the parameters' data_ptr()s change (weights moved by reallocation) or after
`invalidate()`. `compile_decode` adds torch.compile under the graph, which fuses the many small
elementwise kernels of a step (1.4x on an H200, docs/benchmarks.md).
The cache is `actors.generation.kv_cache.HeadMajorKVCache` (head-major K/V, GQA folded into the query axis).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from actors.engine import ParallelGroups
from actors.generation.decoding import (
    DecodeStep,
    GenerationConfig,
    GenerationOutput,
    ResponseRecorder,
    attend_length,
    prepare_cache,
)
from actors.generation.kv_cache import FusedQKV
from actors.generation.pipelined import generate_pipelined
from actors.generation.sampling import sample_tensor_parallel


@torch.no_grad()
def generate(model: nn.Module, prompts: list[Tensor], config: GenerationConfig,
             groups: ParallelGroups | None = None) -> GenerationOutput:
    """Generate for prompts (1-D int token tensors); see the module docstring.

    groups: this rank's process groups (tp ranks of one pipeline call it with the same prompts);
    None runs serially. With groups.layout.pp > 1, `model` is this rank's pipeline stage.
    """
    if groups is not None and groups.layout.pp > 1:
        return generate_pipelined(model, prompts, config, groups)
    tp_group = groups.tp_group if groups is not None else None
    device = next(model.parameters()).device
    prompt_tokens, batch, cache = prepare_cache(model, prompts, config, device)
    recorder = ResponseRecorder(len(prompts), config, device)
    logits = model(prompt_tokens, batch, cache, head_indices=batch.last_token_indices())  # [B, V_local]
    cache.qkv = FusedQKV(model) if config.fuse_qkv else None
    decode = DecodeStep(model, cache, config.use_cuda_graph, config.compile_decode)
    for step in range(config.max_new_tokens):
        uniforms = config.step_uniforms(step, len(prompts), device)
        sampled = sample_tensor_parallel(logits, config.sampling, uniforms, tp_group)
        next_tokens = recorder.record(None, step, sampled)
        # The finished check syncs with the device; without a stop token nothing can finish early.
        if step + 1 == config.max_new_tokens or (config.stop_token is not None and recorder.all_finished()):
            break
        logits = decode(next_tokens, attend_length(batch.max_seqlen, step, config, cache.max_len))
    del decode, cache  # the cache (and a captured graph's pool) is freed with the call
    return recorder.output(prompts, prompt_tokens)


__all__ = ["generate"]
