"""Elementwise functions compiled into single kernels, one compiled graph for every token count.

The engine's elementwise work (RMSNorm, the residual add, the SwiGLU gate, rotary embeddings,
the shared-prefix attention merge) is a chain of memory-bound kernels in eager mode. `fused(fn)`
runs such a function through torch.compile, which emits one kernel for its forward and one for
its backward. Only the token dimension is symbolic, since a micro-batch's token count is the one
size that changes from call to call: widths, head counts and head_dim are compiled in. With
every size symbolic (`dynamic=True`) the kernels split their flat index with runtime divisions
by the head count and head_dim; on an H200 the rotary kernels then ran at a fifth of HBM
bandwidth and the norms' backward at a third (benchmarks/elementwise_bench.py,
docs/benchmarks.md, issue 27, ninth step).

`dynamic=False` switches dynamo's automatic dynamic shapes off, and each call marks the token
dimension of its tensor arguments dynamic (maybe_mark_dynamic): a function called with a second
head count (rotary on q, then on k) compiles a second graph instead of making the head count
symbolic for both. Each static signature (sizes other than tokens, dtype, grad mode) is one
graph; the first call of a signature runs under a raised recompile limit, since past dynamo's
default of 8 graphs per function a new signature would run eager (a process may hold several
models and layouts). Later calls skip that context: it costs ~25 us a call, which a small
model's forward, bound by the host, would pay thousands of times.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

# Graphs one fused function may compile in a process (dynamo's default is 8).
FUSED_RECOMPILE_LIMIT = 64


def _mark_tokens_dynamic(args: tuple[object, ...], token_dims: tuple[int | None, ...] | None) -> Hashable:
    """Marks each tensor argument's token dim dynamic (by default dim 0 of every tensor of two
    or more dimensions; a norm's weight [H] has none); returns the static signature (what
    selects the compiled graph)."""
    key: list[Hashable] = [torch.is_grad_enabled()]
    for i, arg in enumerate(args):
        if not isinstance(arg, Tensor):
            key.append(arg if isinstance(arg, Hashable) else type(arg))
            continue
        dim = token_dims[i] if token_dims is not None else (0 if arg.dim() > 1 else None)
        if dim is not None:
            torch._dynamo.maybe_mark_dynamic(arg, dim)
        sizes = tuple(-1 if d == dim else n for d, n in enumerate(arg.shape))
        key.append((sizes, arg.dtype, arg.device, arg.requires_grad))
    return tuple(key)


@functools.cache
def fused(fn: Callable[..., object], token_dims: tuple[int | None, ...] | None = None) -> Callable[..., object]:
    """`fn` compiled once per process with only its token dimensions symbolic.

    token_dims: per positional argument, the dimension that counts tokens (None: none); by
    default dim 0 of every tensor argument of two or more dimensions. Called inside a compiled
    caller (the decode step), `fn` is traced into the caller's graph as it is.
    """
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    seen: set[Hashable] = set()

    def run(*args: object) -> object:
        if torch.compiler.is_compiling():
            return fn(*args)
        signature = _mark_tokens_dynamic(args, token_dims)
        if signature in seen:
            return compiled(*args)
        seen.add(signature)
        with torch._dynamo.config.patch(recompile_limit=FUSED_RECOMPILE_LIMIT):
            return compiled(*args)

    return run
