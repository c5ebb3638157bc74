"""benchmarks/shard_hop_bench.py at a small shape on the shared Ray instance: both hops are timed
and the table comes last; the shard the reward call reads is the generation call's, rows
intact; bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shard_hop_bench import generation_shard, main
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)


@pytest.mark.ray
def test_small_shape_times_both_hops(ray_session: None, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    assert main(["--prompts", "2", "--group", "2", "--prompt-len", "8", "--gen-len", "16", "--hops", "2",
                 "--warmup", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].split()[:2] == ["hop", "median"]
    assert lines[-2].startswith("generation end -> reward start") and float(lines[-2].split()[-3]) > 0
    assert lines[-1].startswith("reward start -> training start") and float(lines[-1].split()[-3]) > 0


@pytest.mark.unit
def test_the_generation_shard_has_the_calls_shape() -> None:
    shard = generation_shard(prompts=3, group=2, prompt_len=5, gen_len=7)
    assert shard["n"] == 6 and shard["prompt_index"] == [0, 0, 1, 1, 2, 2]
    assert shard["prompt_ids"][0] is shard["prompt_ids"][1] and shard["prompt_ids"][1] is not shard["prompt_ids"][2]
    assert all(t.shape == (7,) and t.dtype == torch.float32 for t in shard["logprobs"])


@pytest.mark.unit
def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--hops", "0"], "--hops=0"), (["--warmup", "-1"], "--warmup=-1")):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
