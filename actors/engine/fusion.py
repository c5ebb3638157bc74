"""Elementwise functions compiled into single kernels, one compiled graph for every token count.

The engine's elementwise work (RMSNorm, the residual add, the SwiGLU gate, rotary embeddings,
the shared-prefix attention merge) is a chain of memory-bound kernels in eager mode. `fused(fn)`
runs such a function through torch.compile, which emits one kernel for its forward and one for
its backward. Only the token dimension is symbolic, since a micro-batch's token count is the one
size that changes from call to call; widths, head counts and head_dim are compiled in. With every
size symbolic (`dynamic=True`) the kernels index with runtime divisions by the head count and
head_dim: on an H200 the rotary kernels then ran at a fifth of HBM bandwidth and the norms'
backward at a third (benchmarks/elementwise_bench.py, docs/benchmarks.md, issue 27, ninth step).

`dynamic=False` switches dynamo's automatic dynamic shapes off: a function called with a second
head count (rotary on q, then on k) compiles a second static graph instead of making the head
count symbolic for both. Each static signature (sizes other than tokens, dtypes, grad mode) is
one graph, hence the raised recompile limit for a process that holds several models or layouts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

# Graphs one fused function may compile in a process (dynamo's default is 8; past the limit a new
# signature would run eager).
FUSED_RECOMPILE_LIMIT = 64


@functools.cache
def fused(fn: Callable[..., object], token_dims: tuple[int | None, ...] | None = None) -> Callable[..., object]:
    """`fn` compiled once per process with only its token dimensions symbolic.

    token_dims: per positional argument, the dimension that counts tokens (None: none); by
    default dim 0 of every tensor argument of two or more dimensions (a norm's weight [H] has
    none). Called inside a compiled caller (the decode step), `fn` is traced into the caller's
    graph as it is.
    """
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    def run(*args: object) -> object:
        if torch.compiler.is_compiling():
            return fn(*args)
        dims = token_dims if token_dims is not None else [0 if isinstance(a, Tensor) and a.dim() > 1 else None
                                                          for a in args]
        for arg, dim in zip(args, dims):
            if dim is not None and isinstance(arg, Tensor):
                torch._dynamo.maybe_mark_dynamic(arg, dim)
        with torch._dynamo.config.patch(recompile_limit=FUSED_RECOMPILE_LIMIT):
            return compiled(*args)

    return run
