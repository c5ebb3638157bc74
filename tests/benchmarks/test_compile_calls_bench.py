"""benchmarks/compile_calls_bench.py and benchmarks/tables.py on CPU: the prompts each call gets,
the refused arguments, and a tiny run's table (graph counts come from dynamo's counters)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.compile_calls_bench import call_prompts, main, parse_args
from benchmarks.tables import markdown_table


@pytest.mark.unit
def test_a_call_gets_groups_of_shared_prompts_whose_longest_is_asked() -> None:
    prompts = call_prompts(3, 2, 10, 50, seed=0, device=torch.device("cpu"))
    assert len(prompts) == 6 and prompts[0] is prompts[1]  # a group's rows share one tensor
    lengths = [p.numel() for p in prompts[::2]]
    assert lengths[0] == 10 and all(5 <= n <= 10 for n in lengths)
    assert all(int(p.min()) >= 3 and int(p.max()) < 50 for p in prompts)
    again = call_prompts(3, 2, 10, 50, seed=0, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(prompts, again))


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["--longest", "8,x"], ["--longest", "1"], ["--group", "0"], ["--new-tokens", "1"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--" in capsys.readouterr().err


@pytest.mark.unit
def test_markdown_table_lines_up_rows_and_refuses_a_short_one() -> None:
    assert markdown_table(("a", "b"), [("1", "2"), ("3", "4")]) == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    with pytest.raises(ValueError, match="a row of 1 cells under 2 headers"):
        markdown_table(("a", "b"), [("1",)])


@pytest.mark.unit
def test_a_tiny_cpu_run_prints_a_row_per_call(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--cpu", "--tiny", "--prompts", "2", "--group", "2", "--longest", "6,8", "--new-tokens", "3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| call")]
    assert [row.split(" | ")[1:3] for row in rows] == [["6", "9"], ["8", "11"]]  # longest, cache slots
    graphs = [int(row.rstrip(" |").rsplit(" | ", 1)[1]) for row in rows]
    assert graphs[0] >= 1 and graphs[1] >= graphs[0]
