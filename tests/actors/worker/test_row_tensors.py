"""Shards' tensor columns travel packed (actors.worker.data.RowTensors): the same rows after a
round trip through pickle and through Ray's serializer, each row owning its storage, a plain
list where packing does not apply, and far fewer bytes of headers than row-by-row pickling."""

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
        assert a.untyped_storage().nbytes() == a.numel() * a.element_size()  # a clone, not a view


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
