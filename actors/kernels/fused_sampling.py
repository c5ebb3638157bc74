"""Greedy and untruncated temperature sampling of one token per row in one Triton kernel.

Why: each decode step samples from logits [B, V] (V = 128k for Llama 3). In torch that is a
float32 copy, a log-softmax, an argmax or a sort, a cumsum and gathers: ~0.3 ms of HBM traffic per
step at B = 256 on an H200, ~7% of the step, and a sort of every row when sampling. The kernel
reads each row once (greedy) or twice (sampling) in its own dtype and writes two numbers.

Logits x [V] scaled to z = x / temperature (greedy: z = x). A first kernel splits every row into
chunks and gives per chunk m_c = max z, s_c = sum exp(z - m_c) and its first argmax (programs
(row, chunk): a decode batch has too few rows to fill the GPU one program per row). A second
kernel, one program per row, combines them: m = max m_c, s = sum s_c exp(m_c - m), and
- greedy: token = the first argmax of the first chunk reaching m; logprob = -log s.
- sampling (inverse CDF in vocabulary order): the first chunk whose running mass exceeds u * s
  (u the row's uniform in [0, 1)), then the first index inside it where the running sum of
  exp(z - m) does; logprob = z_token - m - log s. Only that chunk is read a second time.
Truncated sampling (top-k / top-p) needs the sorted row and stays in torch (actors.generation.sampling).

`sample_rows_reference` is the torch twin with the same definition (same tokens up to float
rounding at a CDF boundary); actors.generation.sampling uses it on CPU and the kernel on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.kernels.switch import triton_installed

if triton_installed():
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(row_ptr, cols, n_cols, inv_temp):
        """z = x * inv_temp in float32 at `cols` of a row, -inf past its end."""
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        return (x * inv_temp).to(tl.float32)  # cast: a float argument may arrive as float64

    @triton.jit
    def _chunk_stats_kernel(logits_ptr, m_ptr, s_ptr, arg_ptr, n_cols, stride_row, chunk, inv_temp,
                            N_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, c): m = max z, s = sum exp(z - m), first argmax over chunk c of the row."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        row_ptr = logits_ptr + row * stride_row
        m = tl.full([1], float("-inf"), tl.float32)
        s = tl.zeros([1], tl.float32)
        best = tl.full([1], 0, tl.int32)
        for start in range(c * chunk, tl.minimum(c * chunk + chunk, n_cols), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _scaled(row_ptr, cols, tl.minimum(c * chunk + chunk, n_cols), inv_temp)
            block_max = tl.max(z, axis=0)
            block_arg = tl.min(tl.where(z == block_max, cols, n_cols), axis=0)
            best = tl.where(block_max > m, block_arg, best)  # strictly greater: keep the first maximum
            m_new = tl.maximum(m, block_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        out = row * N_CHUNKS + c + tl.arange(0, 1)
        tl.store(m_ptr + out, m)
        tl.store(s_ptr + out, s)
        tl.store(arg_ptr + out, best)

    @triton.jit
    def _pick_kernel(logits_ptr, m_ptr, s_ptr, arg_ptr, uniforms_ptr, tokens_ptr, logprobs_ptr, n_cols, stride_row,
                     chunk, inv_temp, N_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr,
                     BLOCK: tl.constexpr):
        """Program row: combine the chunk statistics; greedy takes the first chunk's argmax at the
        row max, sampling finds the chunk where the CDF crosses u * s and scans only that chunk."""
        row = tl.program_id(0)
        one = tl.arange(0, 1)
        cs = tl.arange(0, CHUNKS_PAD)
        ok = cs < N_CHUNKS
        m_c = tl.load(m_ptr + row * N_CHUNKS + cs, mask=ok, other=float("-inf"))  # [CHUNKS_PAD]
        s_c = tl.load(s_ptr + row * N_CHUNKS + cs, mask=ok, other=0.0)
        m = tl.max(m_c, axis=0)
        w_c = s_c * tl.exp(m_c - m)  # each chunk's mass relative to the row max
        s = tl.sum(w_c, axis=0)
        if GREEDY:
            first = tl.min(tl.where(ok & (m_c == m), cs, N_CHUNKS), axis=0)
            token = tl.load(arg_ptr + row * N_CHUNKS + first + one)
            tl.store(tokens_ptr + row + one, token.to(tl.int64))
            tl.store(logprobs_ptr + row + one, -tl.log(s) + tl.zeros([1], tl.float32))
        else:
            target = tl.load(uniforms_ptr + row + one).to(tl.float32) * s  # [1]
            cum = tl.cumsum(w_c, axis=0)
            hit = tl.minimum(tl.min(tl.where(ok & (cum > target), cs, N_CHUNKS - 1), axis=0), N_CHUNKS - 1)
            running = tl.sum(tl.where(cs < hit, w_c, 0.0), axis=0) + tl.zeros([1], tl.float32)
            row_ptr = logits_ptr + row * stride_row
            end = tl.minimum(hit * chunk + chunk, n_cols)
            token = tl.full([1], 0, tl.int32) + end - 1  # rounding past the chunk: its last token
            for start in range(hit * chunk, end, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                p = tl.exp(_scaled(row_ptr, cols, end, inv_temp) - m)  # [BLOCK], 0 past the end
                cdf = tl.cumsum(p, axis=0) + running
                token = tl.minimum(token, tl.min(tl.where((cdf > target) & (cols < end), cols, n_cols), axis=0))
                running += tl.sum(p, axis=0)
            z_token = _scaled(row_ptr, token, n_cols, inv_temp)
            tl.store(tokens_ptr + row + one, token.to(tl.int64))
            tl.store(logprobs_ptr + row + one, z_token - m - tl.log(s))


def sample_rows(logits: Tensor, temperature: float, uniforms: Tensor | None, block: int = 4096,
                max_chunks: int = 16) -> tuple[Tensor, Tensor]:
    """(tokens int64 [B], logprobs float32 [B]) from logits [B, V] with the Triton kernels.

    temperature 0 (or uniforms None) is greedy with logprobs of the plain softmax; otherwise
    uniforms float [B] in [0, 1) drive inverse-CDF sampling from softmax(logits / temperature).
    Each row is split into up to `max_chunks` chunks read in parallel (a decode batch has too few
    rows to fill the GPU one program per row), then one program per row combines them."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: need [B, V] with unit last stride, got shape {tuple(logits.shape)}")
    n_rows, vocab = logits.shape
    greedy = temperature <= 0 or uniforms is None
    if not greedy and (uniforms.shape != (n_rows,) or uniforms.device != logits.device):
        raise ValueError(f"uniforms: need float [{n_rows}] on {logits.device}, got {tuple(uniforms.shape)} on {uniforms.device}")
    block = min(block, triton.next_power_of_2(vocab))
    n_chunks = min(max_chunks, triton.cdiv(vocab, block))
    chunk = triton.cdiv(triton.cdiv(vocab, n_chunks), block) * block  # whole blocks per chunk
    n_chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    m_c = torch.empty(n_rows, n_chunks, dtype=torch.float32, device=device)
    s_c = torch.empty_like(m_c)
    arg_c = torch.empty(n_rows, n_chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(n_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(n_rows, dtype=torch.float32, device=device)
    inv_temp = 1.0 if greedy else 1.0 / temperature
    warps = 8 if block >= 2048 else 4
    _chunk_stats_kernel[(n_rows, n_chunks)](logits, m_c, s_c, arg_c, vocab, logits.stride(0), chunk, inv_temp,
                                            N_CHUNKS=n_chunks, BLOCK=block, num_warps=warps)
    _pick_kernel[(n_rows,)](logits, m_c, s_c, arg_c, logprobs if greedy else uniforms, tokens, logprobs, vocab,
                            logits.stride(0), chunk, inv_temp, N_CHUNKS=n_chunks,
                            CHUNKS_PAD=max(2, triton.next_power_of_2(n_chunks)), GREEDY=greedy, BLOCK=block,
                            num_warps=warps)
    return tokens, logprobs


def sample_rows_reference(logits: Tensor, temperature: float, uniforms: Tensor | None) -> tuple[Tensor, Tensor]:
    """The torch twin of `sample_rows`: same definition, float32 math."""
    greedy = temperature <= 0 or uniforms is None
    z = logits.float() if greedy or temperature == 1.0 else logits.float() / temperature  # [B, V]
    m = z.max(dim=-1, keepdim=True).values  # [B, 1]
    e = torch.exp(z - m)
    log_s = e.sum(dim=-1).log()  # [B]
    if greedy:
        return torch.argmax(z, dim=-1), -log_s  # first maximum, like transformers
    cdf = torch.cumsum(e, dim=-1)  # [B, V], unnormalised
    target = (uniforms.float() * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=z.shape[-1] - 1)
    picked = z.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, picked - m.squeeze(-1) - log_s


__all__ = ["sample_rows", "sample_rows_reference"]
