"""Shards' tensor columns travel packed (actors.worker.data.RowTensors): the same rows after a
round trip through pickle and through Ray's serializer, the packed buffer out of band and the rows
writable views of one copy of it, a plain list where packing does not apply, and far fewer bytes
of headers than row-by-row pickling."""

from __future__ import annotations

import pickle

import pytest
import torch

from actors.worker.data import RowTensors, make_shard, merge_shards


def ragged(n: int, dtype: torch.dtype = torch.int64, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (n,), generator=gen).tolist()  # some rows empty
    return [torch.arange(k, dtype=dtype) * (i + 1) for i, k in enumerate(lengths)]


@pytest.mark.unit
def test_round_trip_keeps_every_row_shape_and_dtype() -> None:
    rows = ragged(40) + [torch.tensor(7), torch.zeros(2, 3, dtype=torch.int64)]  # 0-d and 2-d rows too
    back = pickle.loads(pickle.dumps(RowTensors(rows)))
    assert isinstance(back, RowTensors) and len(back) == len(rows)
    for a, b in zip(back, rows):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # Repacked (a consumer passing rows on in its own shard), the column is no larger.
    assert len(pickle.dumps(RowTensors(back))) == len(pickle.dumps(RowTensors(rows)))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool])
def test_rows_from_a_read_only_buffer_are_writable_views_of_one_copy(dtype: torch.dtype) -> None:
    """Ray's serializer hands a numpy buffer back as a read-only view of its object store
    (pickle protocol 5, out of band): the rows are views of one writable copy, each its own."""
    rows = [(torch.arange(k) % 2).to(dtype) for k in (3, 0, 5, 2)]
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(RowTensors(rows), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1  # the packed column went out of band
    store = [memoryview(b).toreadonly() for b in buffers]
    back = pickle.loads(data, buffers=store)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(back, rows))
    assert len({a.untyped_storage().data_ptr() for a in back if a.numel()}) == 1  # one copy shared
    back[0].fill_(1)
    assert torch.equal(back[2], rows[2]) and bytes(store[0]) == bytes(buffers[0].raw())  # neighbours, store untouched


@pytest.mark.unit
def test_mixed_or_non_tensor_columns_pickle_as_plain_lists() -> None:
    mixed = RowTensors([torch.ones(2), torch.ones(2, dtype=torch.int64)])
    back = pickle.loads(pickle.dumps(mixed))
    assert [t.dtype for t in back] == [torch.float32, torch.int64]
    assert pickle.loads(pickle.dumps(RowTensors([]))) == []
    words = RowTensors(["a", "b"])
    assert pickle.loads(pickle.dumps(words)) == ["a", "b"]


@pytest.mark.unit
def test_make_shard_packs_tensor_columns_and_merge_reads_them() -> None:
    ids, logprobs = ragged(6), ragged(6, torch.float32, seed=1)
    shard = make_shard(10, {"response_ids": ids, "logprobs": logprobs, "no_eos": [True] * 6, "prompt": list("abcdef")})
    assert isinstance(shard["response_ids"], RowTensors) and isinstance(shard["logprobs"], RowTensors)
    assert type(shard["no_eos"]) is list and type(shard["prompt"]) is list
    back = pickle.loads(pickle.dumps(shard))
    cols = merge_shards([back], range(12, 15), ["response_ids", "logprobs"], optional=["prompt"])
    assert all(torch.equal(a, b) for a, b in zip(cols["response_ids"], ids[2:5]))
    assert cols["prompt"] == ["c", "d", "e"]


@pytest.mark.unit
def test_packed_pickle_is_smaller_than_row_by_row() -> None:
    rows = [torch.randint(0, 100, (64,)) for _ in range(256)]
    assert len(pickle.dumps(RowTensors(rows))) < 0.75 * len(pickle.dumps(list(rows)))


@pytest.mark.unit
def test_ray_serializer_round_trip() -> None:
    ray_serialization = pytest.importorskip("ray.cloudpickle")
    rows = ragged(12, torch.float32, seed=2)
    back = ray_serialization.loads(ray_serialization.dumps(make_shard(0, {"logprobs": rows})))
    assert isinstance(back["logprobs"], RowTensors)
    assert all(torch.equal(a, b) for a, b in zip(back["logprobs"], rows))
