"""actors.worker.select: the kept rows of several rounds' shards as one batch."""

from __future__ import annotations

import pytest
import torch

from actors.worker import CallSpec, ModelWorker
from planning.layout import Layout, Mesh
from planning.plan import Placement

pytestmark = pytest.mark.unit

ONE = Placement(Mesh(0, 1, 1), Layout())


def round_shards(round_: int) -> list[dict]:
    """A generation shard and a reward shard of 4 rows (2 prompts x 2 samples), split over 2 owners."""
    gen = [{"row_start": s, "n": 2, "prompt_ids": [torch.tensor([1, 10 * round_ + r]) for r in (s, s + 1)],
            "response_ids": [torch.tensor([5, r]) for r in (s, s + 1)], "prompt_index": [s // 2, s // 2],
            "prompt": [f"p{round_}.{s // 2}"] * 2} for s in (0, 2)]
    reward = {"row_start": 0, "n": 4, "rewards": [float(10 * round_ + r) for r in range(4)]}
    return [*gen, reward]


def test_select_rows_gathers_every_column_and_renumbers_prompts() -> None:
    worker = ModelWorker(0, 1, "cpu")
    inputs = round_shards(0) + round_shards(1)
    params = {"op": "select_rows", "input_rounds": [0, 0, 0, 1, 1, 1], "round_rows": 4, "group_size": 2,
              "keep": [[1, 2], [1, 3], [0, 0], [0, 1]]}
    meta, shard = worker.run_call(CallSpec("dyn_select", "reward", "inference", ONE, 0, 4, params), *inputs)
    assert (meta["row_start"], meta["n"], shard["row_start"], shard["n"]) == (0, 4, 0, 4)
    assert shard["rewards"] == [12.0, 13.0, 0.0, 1.0]
    assert [t.tolist() for t in shard["prompt_ids"]] == [[1, 12], [1, 13], [1, 0], [1, 1]]
    assert shard["prompt"] == ["p1.1", "p1.1", "p0.0", "p0.0"]
    assert shard["prompt_index"] == [0, 0, 1, 1]  # by kept group, not the rounds' own numbering
    with pytest.raises(ValueError, match="keeps 4 rows, n_rows=3"):
        worker.run_call(CallSpec("dyn_select", "reward", "inference", ONE, 0, 3, params), *inputs)
