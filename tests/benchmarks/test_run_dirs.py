"""benchmarks/run_dirs.py: every run of a benchmark gets a fresh run-NNN under --out, `latest`
follows the newest, and the scripts that write files can run twice with the same arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.peer_bench import main as peer_bench
from benchmarks.reprice_fidelity import results_dir
from benchmarks.run_dirs import fresh_run_dir, latest_run_dir, run_dirs

pytestmark = pytest.mark.unit


def test_each_run_gets_the_next_number_and_latest_follows(tmp_path: Path) -> None:
    out = tmp_path / "peer"
    assert latest_run_dir(out) is None and run_dirs(out) == []
    first = fresh_run_dir(out)
    (first / "result.txt").write_text("first\n")
    second = fresh_run_dir(out)
    assert [first.name, second.name] == ["run-001", "run-002"]
    assert (first / "result.txt").read_text() == "first\n" and list(second.iterdir()) == []
    assert (out / "latest").resolve() == second.resolve() and latest_run_dir(out) == second
    # Numbers continue after the highest (gaps stay), other entries are not runs.
    (out / "run-007").mkdir()
    (out / "run-notes").mkdir()
    (out / "run-009").write_text("a file, not a run")
    (out / "inputs").mkdir()
    assert fresh_run_dir(out).name == "run-008"
    assert [p.name for p in run_dirs(out)] == ["run-001", "run-002", "run-007", "run-008"]


def test_a_taken_number_moves_on_and_a_real_latest_folder_is_left_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    (out / "latest").mkdir(parents=True)  # someone's own folder: not replaced by a link
    (out / "latest" / "mine.txt").write_text("x")
    # Another run took run-001 between the scan and the mkdir: this one takes run-002.
    import benchmarks.run_dirs as module

    monkeypatch.setattr(module, "run_dirs", lambda _: [])
    (out / "run-001").mkdir()
    assert fresh_run_dir(out).name == "run-002"
    assert (out / "latest").is_dir() and not (out / "latest").is_symlink()
    assert (out / "latest" / "mine.txt").read_text() == "x"


def test_peer_bench_twice_with_the_same_out_writes_two_runs(tmp_path: Path) -> None:
    # The cheapest path through peer_bench's main: inputs built, no training (the ray-tier test in
    # test_peer_bench.py trains twice into the same --out).
    for _ in range(2):
        assert peer_bench(["--tiny", "--out", str(tmp_path), "--skip-ours", "--skip-trl"]) == 0
    runs = run_dirs(tmp_path)
    assert [p.name for p in runs] == ["run-001", "run-002"]
    for run in runs:
        assert json.loads((run / "peer_bench.json").read_text())["work"]["prompts"] == 4
        assert (run / "peer_bench.txt").read_text().startswith("peer_bench: GRPO")
    assert (tmp_path / "latest" / "peer_bench.json").is_file()
    assert (tmp_path / "inputs-tiny" / "prompts.jsonl").is_file()  # shared by the runs, outside them


def test_reprice_reads_a_run_or_the_newest_run_of_an_out_folder(tmp_path: Path) -> None:
    old, new = fresh_run_dir(tmp_path), fresh_run_dir(tmp_path)
    for run in (old, new):
        (run / "fidelity.json").write_text("[]")
    assert results_dir(old) == old and results_dir(tmp_path) == new
    with pytest.raises(SystemExit, match="no fidelity.json"):
        results_dir(tmp_path / "nothing")
