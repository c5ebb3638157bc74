"""Data plumbing of the model worker: row ranges, producer shards, packed batches, imports by name.

A call's data travels between workers as *shards*: plain dicts
`{"row_start": int, "n": int, key: list with one entry per row, ...}` where an entry is a 1-D
CPU tensor (token ids, per-response-token logprobs or values), a float (reward), a bool
(no_eos) or a string (prompt/response/answer text); a column of tensors is a `RowTensors`
list, which crosses the object store as one packed tensor. A consumer merges the shards it is given
(in any order, possibly overlapping: equal rows simply repeat) and keeps the rows it needs.

Row ownership (one rule for every call, so the driver can route data without asking): the
call's `n_rows` sequences are split contiguously over its data-parallel ranks,
rows [d * n / dp, (d + 1) * n / dp) for dp rank d, and the "data owner" of dp rank d (tp rank 0 of
the last pipeline stage) returns them.

Per-token tensors of a packed batch follow actors.rl.advantages: entry i is about token i; a
sequence of prompt length p and response length r occupies [p + r] entries and its response
entries are p .. p + r - 1 (the first token is always a prompt token).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from planning.layout import Layout

META_KEYS = ("row_start", "n")


# ---- rows ---------------------------------------------------------------------------------------


def dp_rows(n_rows: int, dp: int, dp_rank: int) -> range:
    """Rows of dp rank `dp_rank`: a contiguous near-even split of n_rows over dp (every rank >= 0)."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank}: must be in [0, dp={dp})")
    if n_rows < dp:
        raise ValueError(f"n_rows={n_rows}: a call split over dp={dp} ranks needs at least {dp} rows")
    return range(dp_rank * n_rows // dp, (dp_rank + 1) * n_rows // dp)


def is_data_owner(layout: Layout, mesh_rank: int) -> bool:
    """tp rank 0 of the last pipeline stage: the rank that returns its dp rank's rows."""
    _, tp_rank, pp_rank = layout.coords(mesh_rank)
    return tp_rank == 0 and pp_rank == layout.pp - 1


# ---- shards ---------------------------------------------------------------------------------------


class RowTensors(list):
    """A column of per-row tensors: a list, used as one, that pickles as ONE flat byte buffer and
    the rows' dtype and shapes when every entry is a CPU tensor of one dtype (else as a plain list).

    Shards cross the object store between calls; pickled one by one, 512 rows of prompt ids,
    response ids and logprobs cost ~0.1-0.2 s each way (1,536 tensor headers), so every call
    waited that long for its inputs. The buffer goes as a numpy array, which Ray's serializer
    writes out of band (one copy into the object store, no torch.save archive per tensor) and
    reads back as a read-only view of it; unpickling copies it once and the rows are views of that
    copy (one copy, not one per row). On one worker, a generation shard of 512 rows reached the
    reward call 12 ms after the generation call ended instead of 18-27, the training call 5 ms
    after the reward call instead of 10 (benchmarks/shard_hop_bench.py; docs/benchmarks.md,
    issue 27, thirtieth step). A row kept alone keeps its column's buffer alive; shards are built
    by `make_shard`, whose columns repack as one.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        rows = list(self)
        packable = rows and all(isinstance(t, Tensor) and t.device.type == "cpu" and t.dtype == rows[0].dtype
                                for t in rows)
        if not packable:
            return RowTensors, (rows,)
        flat = torch.cat([t.detach().reshape(-1) for t in rows])
        # Bytes, whatever the dtype (numpy has no bfloat16): a 1-D contiguous tensor views as uint8.
        return _unpack_rows, (flat.view(torch.uint8).numpy(), flat.dtype, [tuple(t.shape) for t in rows])


def _unpack_rows(buffer: np.ndarray, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> RowTensors:
    """The rows of a packed column: views of one tensor over a writable copy of `buffer`."""
    flat = torch.from_numpy(buffer if buffer.flags.writeable else buffer.copy()).view(dtype)
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return RowTensors(part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes))


def make_shard(row_start: int, columns: dict[str, list[Any]]) -> dict[str, Any]:
    """A shard of rows [row_start, row_start + n) from equal-length per-row columns (columns of
    tensors become `RowTensors`, which travel packed)."""
    lengths = {key: len(values) for key, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"shard columns have different row counts: {lengths}")
    n = next(iter(lengths.values()), 0)
    packed = {key: RowTensors(values) if values and all(isinstance(v, Tensor) for v in values) else values
              for key, values in columns.items()}
    return {"row_start": row_start, "n": n, **packed}


def merge_shards(shards: Sequence[dict[str, Any] | None], rows: range, keys: Sequence[str],
                 optional: Sequence[str] = ()) -> dict[str, list[Any]]:
    """Columns `keys` (required) and `optional` (kept when every row has them) for `rows`.

    Raises ValueError naming the key and the first missing rows when a required key does not
    cover every row of `rows`.
    """
    table: dict[str, dict[int, Any]] = {key: {} for key in (*keys, *optional)}
    for shard in shards:
        if shard is None:
            continue
        start = int(shard["row_start"])
        for key, column in table.items():
            values = shard.get(key)
            if values is None:
                continue
            for offset, value in enumerate(values):
                if start + offset in rows:
                    column[start + offset] = value
    out: dict[str, list[Any]] = {}
    for key, column in table.items():
        missing = [r for r in rows if r not in column]
        if missing and key in keys:
            have = sorted({k for s in shards if s is not None for k in s if k not in META_KEYS})
            raise ValueError(f"input key {key!r}: rows {missing[:8]} of {rows.start}..{rows.stop - 1} missing "
                             f"from the producer shards (keys given: {have})")
        if not missing:
            out[key] = [column[r] for r in rows]
    return out


# ---- packed batches -------------------------------------------------------------------------------


def pack_rows(prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor]) -> tuple[Tensor, list[int], Tensor]:
    """Packed prompt+response tokens int64 [T], per-row lengths, response mask float32 [T]."""
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(f"pack_rows: {len(prompt_ids)} prompts and {len(response_ids)} responses; need equal, >= 1")
    pieces, masks, lengths = [], [], []
    for p, r in zip(prompt_ids, response_ids):
        if p.numel() < 1 or r.numel() < 1:
            raise ValueError(f"pack_rows: prompt of {p.numel()} and response of {r.numel()} tokens; both need >= 1")
        pieces += [p.long().flatten(), r.long().flatten()]
        masks += [torch.zeros(p.numel()), torch.ones(r.numel())]
        lengths.append(p.numel() + r.numel())
    return torch.cat(pieces), lengths, torch.cat(masks)


def scatter_responses(per_response: Sequence[Tensor], prompt_lens: Sequence[int]) -> Tensor:
    """Per-row response tensors [r_i] -> one float32 [T] aligned with the packed rows (0 on prompts)."""
    pieces = []
    for values, p in zip(per_response, prompt_lens):
        pieces += [torch.zeros(p), values.float().flatten()]
    return torch.cat(pieces)


def gather_responses(per_token: Tensor, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> list[Tensor]:
    """float [T] over packed rows -> each row's response entries [r_i] (CPU, contiguous)."""
    out, offset = [], 0
    values = per_token.detach().float().cpu()
    for p, r in zip(prompt_lens, response_lens):
        out.append(values[offset + p:offset + p + r].clone())
        offset += p + r
    return out


def cu_seqlens_of(lengths: Sequence[int]) -> Tensor:
    """int64 [B+1] cumulative lengths starting at 0."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0)
    return cu


# ---- objects named by strings -----------------------------------------------------------------------


def import_object(spec: str, what: str) -> Any:
    """The object named `module:attr` (an importable module) or `path/to/file.py:attr`.

    `what` names the setting in errors (e.g. "params['reward_fn']").
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what}={spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{what}={spec!r}: file {target} not found")
        loader_spec = importlib.util.spec_from_file_location(f"_realray_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{what}={spec!r}: cannot load {target} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ValueError(f"{what}={spec!r}: cannot import module {target!r} ({error})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what}={spec!r}: module {target!r} has no attribute {attr!r}")
    return getattr(module, attr)


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str | None) -> Any | None:
    """A tokenizer with `decode(ids, skip_special_tokens=True)`, or None when spec is None.

    spec: 'module:Class' (instantiated without arguments, e.g. 'app.data.toy_task:CharTokenizer') or
    an HF model directory (transformers' AutoTokenizer). Loaded once per worker process and spec
    (a 128k-token vocabulary takes a second to load; calls only decode with it).
    """
    if spec is None:
        return None
    if Path(spec).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec)
    factory = import_object(spec, "params['tokenizer']")
    return factory() if callable(factory) else factory


def reward_score(value: Any, spec: str) -> float:
    """A reward function's result (number, bool or dict with a numeric 'score') as a float."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function {spec}: returned a dict without 'score' (keys {sorted(value)})")
        value = value["score"]
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise ValueError(f"reward function {spec}: returned {type(value).__name__}; expected float, bool or dict")


__all__ = [
    "cu_seqlens_of", "dp_rows", "gather_responses", "import_object", "is_data_owner", "load_tokenizer",
    "RowTensors", "make_shard", "merge_shards", "pack_rows", "reward_score", "scatter_responses",
]
