"""Token sampling for generation: greedy, temperature, top-k, top-p, and the matching truncation
the train side applies so its logprobs use the distribution the tokens were sampled from.

Order of operations (as in transformers): divide by the temperature, keep the top-k logits, then
keep the smallest set of the remaining tokens whose probability mass reaches top-p. Truncation
works on the vocabulary sorted by logit, so the kept set of a row is "its first n sorted tokens";
without truncation nothing is sorted: greedy and inverse-CDF sampling run over the vocabulary in
its own order, fused into one kernel per step on CUDA (actors.kernels.fused_sampling).

How the truncation is kept for later logprobs (the choice, documented): generation returns, for
every sampled token, `kept_count` = how many tokens the top-k/top-p set held (int32, one per
token). The train side calls `truncate_logits(logits, params, kept_counts)` and keeps the
`kept_count` highest logits of its own forward. Storing counts instead of a [T, V] mask costs 4
bytes per token, and unlike recomputing top-p from recomputed logits it keeps exactly as many
tokens as sampling did even when tiny numeric differences move the top-p boundary.

Randomness: one uniform number per sequence per decode step, drawn from a generator seeded by
(seed, step) over the whole local batch, then inverse-CDF sampling. The sample of sequence i at
step k is therefore the same whatever the micro-batching or pipeline order (pp=1 equals pp=2).

Tensor parallelism: logits arrive vocab-parallel [B, V/tp]; `sample_tensor_parallel` gathers them
on tp rank 0 only, samples there and broadcasts tokens, logprobs and kept counts, so the ranks can
never diverge. On the train side `allowed_tokens` turns kept counts into the bool [T, V_local]
`allowed` mask that actors.engine.logprobs takes, without gathering the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from actors.kernels import sample_rows, sample_rows_reference, triton_on


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an int >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Sampling keeps only part of the vocabulary (top-k or top-p active, not greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True)
class SampledTokens:
    """One sampling step for B sequences: tokens int64 [B], logprobs float32 [B] of those tokens
    under the sampled distribution, kept_counts int32 [B] (size of the top-k/top-p set; V when
    there is no truncation, 1 under greedy)."""

    tokens: Tensor
    logprobs: Tensor
    kept_counts: Tensor


def step_uniforms(seed: int, step: int, n_seqs: int, device: torch.device | str) -> Tensor:
    """float32 [n_seqs] in [0, 1): the random numbers of decode step `step` for every sequence.

    A fresh generator per (seed, step) makes the draw independent of how sequences are grouped
    into micro-batches or in which order stages reach them.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + step * 7919 + 17) % (2**63))
    return torch.rand(n_seqs, generator=gen, device=device, dtype=torch.float32)


def _scaled_sorted(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Temperature-scaled float32 logits sorted per row, descending: (values [B, V], index [B, V])."""
    scaled = logits.float()
    if not params.greedy and params.temperature != 1.0:
        scaled = scaled / params.temperature
    return torch.sort(scaled, dim=-1, descending=True)


def _kept_counts(sorted_logits: Tensor, params: SamplingParams) -> Tensor:
    """int32 [B]: size of the top-k then top-p set of each row of descending logits [B, V]."""
    n_rows, vocab = sorted_logits.shape
    rank = torch.arange(vocab, device=sorted_logits.device)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if params.top_k > 0:
        keep &= rank[None, :] < params.top_k
    if params.top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        # Keep token r when the mass strictly before it is below top_p: the smallest prefix whose
        # mass reaches top_p (the first token is always kept).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < params.top_p
    return keep.sum(dim=-1).clamp(min=1).to(torch.int32)


def _mask_beyond(sorted_logits: Tensor, kept_counts: Tensor) -> Tensor:
    """Sorted logits [B, V] with every rank >= kept_counts[b] set to -inf."""
    rank = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    return sorted_logits.masked_fill(rank[None, :] >= kept_counts[:, None].to(rank.dtype), float("-inf"))


def truncate_logits(logits: Tensor, params: SamplingParams, kept_counts: Tensor | None = None) -> Tensor:
    """float32 [N, V]: logits scaled and truncated as sampling did; dropped tokens are -inf.

    The train side calls this on its own full-vocabulary logits [N, V] of the response tokens
    and takes log_softmax. kept_counts int [N] from `GenerationOutput.kept_counts` keeps exactly
    as many tokens as sampling kept; without it top-k/top-p are recomputed from these logits.
    Greedy params leave the logits unscaled and untruncated (logprobs of the plain softmax).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: shape {tuple(logits.shape)}; expected [N, V]")
    if not params.truncates:
        scaled = logits.float()
        return scaled / params.temperature if not params.greedy and params.temperature != 1.0 else scaled
    sorted_logits, order = _scaled_sorted(logits, params)
    counts = kept_counts.to(logits.device) if kept_counts is not None else _kept_counts(sorted_logits, params)
    if counts.shape != (logits.shape[0],):
        raise ValueError(f"kept_counts: shape {tuple(counts.shape)}; expected [{logits.shape[0]}]")
    masked_sorted = _mask_beyond(sorted_logits, counts)
    # Undo the sort: position order[b, r] of the output receives sorted value r.
    return torch.empty_like(masked_sorted).scatter_(-1, order, masked_sorted)


def sample_logits(logits: Tensor, params: SamplingParams, uniforms: Tensor | None) -> SampledTokens:
    """Sample one token per row of full-vocabulary logits [B, V].

    uniforms float [B] in [0, 1) drive inverse-CDF sampling (unused and may be None when greedy).
    Logprobs are of the sampled token under the temperature-scaled, truncated distribution; under
    greedy, under the plain softmax.
    """
    n_rows, vocab = logits.shape
    if not params.greedy and (uniforms is None or uniforms.shape != (n_rows,)):
        got = None if uniforms is None else tuple(uniforms.shape)
        raise ValueError(f"uniforms: need float [{n_rows}] for sampling, got {got}")
    if not params.truncates:
        # Greedy, or inverse CDF over the whole vocabulary in its own order: one fused kernel
        # on CUDA (actors.kernels.fused_sampling), its torch twin elsewhere.
        temperature = 0.0 if params.greedy else params.temperature
        row_uniforms = None if params.greedy else uniforms
        if triton_on(logits.device):
            tokens, logprobs = sample_rows(logits.contiguous(), temperature, row_uniforms)
        else:
            tokens, logprobs = sample_rows_reference(logits, temperature, row_uniforms)
        counts = torch.full((n_rows,), 1 if params.greedy else vocab, dtype=torch.int32, device=logits.device)
        return SampledTokens(tokens, logprobs, counts)
    sorted_logits, order = _scaled_sorted(logits, params)
    counts = _kept_counts(sorted_logits, params)
    sorted_logits = _mask_beyond(sorted_logits, counts)
    logp_sorted = torch.log_softmax(sorted_logits, dim=-1)  # [B, V], -inf beyond the kept set
    cdf = torch.cumsum(logp_sorted.exp(), dim=-1)  # [B, V], ends at ~1
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]  # [B, 1]
    # First rank whose cdf exceeds u: a kept token (clamped, in case rounding runs past the set).
    rank = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    rank = torch.minimum(rank, counts.to(rank.dtype) - 1)
    tokens = order.gather(-1, rank[:, None]).squeeze(-1)
    logprobs = logp_sorted.gather(-1, rank[:, None]).squeeze(-1)
    return SampledTokens(tokens, logprobs, counts)


def sample_tensor_parallel(
    local_logits: Tensor,
    params: SamplingParams,
    uniforms: Tensor | None,
    tp_group: ProcessGroup | None,
) -> SampledTokens:
    """Sample from vocab-parallel logits [B, V/tp]: gather on tp rank 0, sample, broadcast.

    Every rank returns the same tokens / logprobs / kept counts (rank 0's). With tp_group None
    this is `sample_logits`.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return sample_logits(local_logits, params, uniforms)
    root = dist.get_global_rank(tp_group, 0)
    is_root = dist.get_rank(tp_group) == 0
    local_logits = local_logits.contiguous()
    shards = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(tp_group))] if is_root else None
    dist.gather(local_logits, shards, dst=root, group=tp_group)
    n_rows = local_logits.shape[0]
    if is_root:
        # Shard r holds vocabulary rows [r * V/tp, (r+1) * V/tp): concatenation restores order.
        sampled = sample_logits(torch.cat(shards, dim=-1), params, uniforms)
        tokens, logprobs, counts = sampled.tokens, sampled.logprobs.float(), sampled.kept_counts
    else:
        device = local_logits.device
        tokens = torch.empty(n_rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(n_rows, dtype=torch.float32, device=device)
        counts = torch.empty(n_rows, dtype=torch.int32, device=device)
    for tensor in (tokens, logprobs, counts):
        dist.broadcast(tensor, src=root, group=tp_group)
    return SampledTokens(tokens, logprobs, counts)


def allowed_tokens(local_logits: Tensor, params: SamplingParams, kept_counts: Tensor | None = None,
                   tp_group: ProcessGroup | None = None) -> Tensor | None:
    """bool [N, V_local]: True where sampling kept the token, the `allowed` mask of
    actors.engine.logprobs (vocab-parallel logprobs/entropy over the truncated distribution); None
    when sampling did not truncate. local_logits [N, V_local] are this tp rank's vocab slice.

    Under tp the full vocabulary is never gathered: each rank sends its top-k' scaled logits
    (k' = the largest kept count, [N, k'] per rank), every rank finds the kept_count-th largest
    value of the union (it contains the global top kept_count) and keeps the local logits at or
    above it (tokens tied with the threshold are all kept). Without kept_counts the counts are
    recomputed from the gathered full rows (memory [N, V]).
    """
    if not params.truncates:
        return None
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp == 1:
        return torch.isfinite(truncate_logits(local_logits, params, kept_counts))
    scaled = local_logits.float() / params.temperature
    if kept_counts is None:
        shards = [torch.empty_like(scaled) for _ in range(tp)]
        dist.all_gather(shards, scaled.contiguous(), group=tp_group)
        kept_counts = _kept_counts(torch.sort(torch.cat(shards, dim=-1), dim=-1, descending=True).values, params)
    counts = kept_counts.to(device=scaled.device, dtype=torch.int64)
    k = min(int(counts.max()), scaled.shape[-1])
    local_top = scaled.topk(k, dim=-1).values.contiguous()  # [N, k], descending
    tops = [torch.empty_like(local_top) for _ in range(tp)]
    dist.all_gather(tops, local_top, group=tp_group)
    union = torch.sort(torch.cat(tops, dim=-1), dim=-1, descending=True).values  # [N, tp * k]
    threshold = union.gather(-1, (counts - 1)[:, None])  # [N, 1]
    return scaled >= threshold


def token_logprobs_full(logits: Tensor, tokens: Tensor, params: SamplingParams,
                        kept_counts: Tensor | None = None) -> Tensor:
    """float32 [N]: logprob of tokens [N] under the sampling distribution of full logits [N, V]."""
    logp = F.log_softmax(truncate_logits(logits, params, kept_counts), dim=-1)
    return logp.gather(-1, tokens.to(torch.int64)[:, None]).squeeze(-1)


__all__ = [
    "SampledTokens", "allowed_tokens", "SamplingParams", "sample_logits", "sample_tensor_parallel", "step_uniforms",
    "token_logprobs_full", "truncate_logits",
]
