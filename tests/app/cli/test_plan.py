"""`python -m app plan` end to end in a subprocess: table, --json schema, --gantt PNG, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planning.layout import Mesh

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
TINY = EXAMPLES / "ppo-tiny.yaml"
FAST = "plan.seconds=1"
# Without optimizer offload (which would let it fit: part of the actor's optimizer state in host memory).
TOO_BIG_PER_GPU = ["models.actor.preset=llama-34b", "models.critic.preset=qwen2.5-0.5b",
                   "plan.optimizer_offload={actor: 0, critic: 0}"]
PPO_CALLS = ["actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_inf", "actor_train", "critic_train"]
# Examples of real models read their shapes from the downloaded model's config.json
# (examples/grpo-qwen2.5-0.5b-gsm8k.yaml): planned below with the preset of the same shapes.
GSM8K = EXAMPLES / "grpo-qwen2.5-0.5b-gsm8k.yaml"
AS_PRESET = ["models.actor.path=null", "models.actor.preset=qwen2.5-0.5b"]


def names_downloads(example: Path) -> bool:
    """Whether a model of the example is an HF directory (to download) rather than a preset."""
    models = yaml.safe_load(example.read_text())["models"]
    return any(isinstance(source, dict) and source.get("path") for source in models.values())


def plan_cli(*args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "app", "plan", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def manual_overrides(layouts: dict[str, str], mesh: str = "n0") -> list[str]:
    overrides = ["plan.mode=manual"]
    for name in PPO_CALLS:
        overrides.append(f"plan.manual.{name}={{mesh: '{mesh}', layout: {layouts.get(name, 'dp2tp2pp1')}}}")
    return overrides


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml") if not names_downloads(p)))
def test_every_example_plans(example: str) -> None:
    done = plan_cli(EXAMPLES / example, FAST)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for heading in ("call", "role", "kind", "mesh", "dp", "tp", "pp", "runs as", "est. time", "est. mem GiB",
                    "GPU peak GiB"):
        assert heading in out
    assert "estimated iteration time:" in out and "symmetric baseline:" in out and "speedup:" in out
    assert "search time:" in out and "evaluated plans:" in out
    assert "infeasible" not in out


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_first_real_run_plans_on_one_and_two_gpus(gpus: int) -> None:
    done = plan_cli(GSM8K, FAST, *AS_PRESET, f"cluster.gpus_per_node={gpus}", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [call["name"] for call in report["calls"]] == ["actor_gen", "rew_inf", "ref_inf", "actor_train"]
    assert all(call["feasible"] for call in report["calls"])
    assert report["peak_mem_gib"] < report["gpu_mem_gib"]


def test_json_is_one_object_with_the_schema() -> None:
    done = plan_cli(TINY, FAST, "plan.mode=search", "--json")  # ppo-tiny pins a manual plan
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # fails unless stdout is exactly one JSON document
    for key in ("calls", "est_iteration_s", "baseline_iteration_s", "search_s", "evaluated_plans", "plan"):
        assert key in report
    assert [c["name"] for c in report["calls"]] == PPO_CALLS == list(report["plan"])
    for call in report["calls"]:
        mesh = Mesh.parse(call["mesh"], gpus_per_node=4)
        assert call["dp"] * call["tp"] * call["pp"] == mesh.size
        assert mesh.start + mesh.size <= 4
        assert call["est_time_s"] > 0 and (call["est_mem_gib"] > 0) != call["model_free"]  # a rule reward: host only
    assert 0 < report["est_iteration_s"] <= report["baseline_iteration_s"] * 1.0001
    assert report["search_s"] >= 0 and report["evaluated_plans"] >= 1


def test_manual_plan_is_reported_as_given() -> None:
    layouts = {"actor_train": "dp4", "critic_train": "dp1tp2pp2"}
    how = ["plan.manual.actor_train.micro_batch_tokens=96", "plan.manual.actor_gen.gen_rounds=2"]
    done = plan_cli(TINY, *manual_overrides(layouts), *how, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    calls = {c["name"]: c for c in report["calls"]}
    assert (calls["actor_train"]["dp"], calls["actor_train"]["tp"], calls["actor_train"]["pp"]) == (4, 1, 1)
    assert (calls["critic_train"]["dp"], calls["critic_train"]["tp"], calls["critic_train"]["pp"]) == (1, 2, 2)
    assert all(c["mesh"] == "n0" for c in calls.values())
    # How each call runs: as given, else as the cost model picked; in the calls and the pinnable plan.
    assert calls["actor_train"]["micro_batch_tokens"] == 96 and calls["actor_gen"]["gen_rounds"] == 2
    assert report["plan"]["actor_train"]["micro_batch_tokens"] == 96 and report["plan"]["actor_gen"]["gen_rounds"] == 2
    # 64 prompts / (dp4 x 2 minibatches) = 8 sequences of 24 tokens per replica: 192 / 96 = 2.
    assert calls["actor_train"]["micro_batches"] == 2
    assert all((c["gen_rounds"] or c["micro_batch_tokens"] or c["model_free"]) and c["est_peak_gib"] > 0
               for c in calls.values())
    assert calls["rew_inf"]["model_free"] and calls["rew_inf"]["micro_batch_tokens"] is None  # the toy rule


def test_searched_plan_pins_back_as_manual_with_the_same_estimate() -> None:
    searched = json.loads(plan_cli(EXAMPLES / "ppo-8gpu.yaml", FAST, "--json").stdout)
    pinned = plan_cli(EXAMPLES / "ppo-8gpu.yaml", "plan.mode=manual", f"plan.manual={json.dumps(searched['plan'])}",
                      "--json")
    assert pinned.returncode == 0, pinned.stderr
    again = json.loads(pinned.stdout)
    assert again["plan"] == searched["plan"]
    assert all("micro_batch_tokens" in entry or "gen_rounds" in entry for entry in searched["plan"].values())
    assert again["est_iteration_s"] == pytest.approx(searched["est_iteration_s"], rel=1e-9)


def test_gantt_writes_a_png_and_flags_mix_with_overrides(tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    # Flags before and after overrides, and the --nodes shortcut.
    done = plan_cli(TINY, "--gantt", png, FAST, "--nodes", "1", "plan.seed=3")
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000  # a drawn chart, not an empty canvas
    assert f"gantt chart: {png}" in done.stdout


@pytest.mark.parametrize("args, field", [
    (["missing.yaml"], "config"),
    ([TINY, "batch.promts=8"], "batch.promts"),
    ([TINY, "models.actor.preset=llama-8b"], "models.actor.preset"),
    ([TINY, "batch.gen_len=-5"], "batch.gen_len"),
    ([TINY, "batch.prompts=lots"], "batch.prompts"),
    ([TINY, "algorithm=sft"], "algorithm"),
    ([TINY, "cluster.gpu=tpu"], "cluster.gpu"),
    ([TINY, "plan.mode=manual", "plan.manual=null"], "plan.manual"),
    ([TINY, *manual_overrides({"actor_gen": "dp4tp3"}), ], "plan.manual.actor_gen.layout"),
    ([TINY, *manual_overrides({}), "plan.manual.actor_gen.mesh=n2"], "plan.manual.actor_gen.mesh"),
    ([TINY, "models.actor.preset=llama-70b", "models.critic.preset=llama-7b", "cluster.gpu=h100-80g"], "cluster"),
    ([TINY, "batch"], "override"),
    # 34B actor + 0.5B critic on 1x8: weights + optimizer states fit the cluster in total (573 of
    # 589 GiB), but that leaves ~2 GiB per GPU for activations and KV cache: no plan fits.
    ([EXAMPLES / "ppo-8gpu.yaml", FAST, *TOO_BIG_PER_GPU], "cluster"),
    ([EXAMPLES / "ppo-8gpu.yaml", "plan.mode=heuristic", *TOO_BIG_PER_GPU], "cluster"),
    ([EXAMPLES / "ppo-8gpu.yaml", "plan.mode=exhaustive"], "plan.mode"),
    ([EXAMPLES / "ppo-8gpu.yaml", *manual_overrides({}, mesh="n0:g0") + [
        f"plan.manual.{name}.layout=dp1" for name in PPO_CALLS]], "plan.manual"),  # 7B on one GPU
])
def test_bad_input_exits_2_with_one_line_naming_the_field(args: list[str | Path], field: str) -> None:
    done = plan_cli(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {field}=")
    assert "allowed:" in lines[0]
    assert done.stdout == ""


def test_unwritable_gantt_path_and_bad_yaml_exit_2(tmp_path: Path) -> None:
    done = plan_cli(TINY, FAST, "--gantt", tmp_path / "no-such-dir" / "t.png")
    assert done.returncode == 2 and done.stderr.startswith("error: --gantt=") and len(done.stderr.splitlines()) == 1
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: {actor: {preset: tiny}\n")
    done = plan_cli(broken)
    assert done.returncode == 2 and done.stderr.startswith("error: config=") and len(done.stderr.splitlines()) == 1


def test_exhaustive_mode_on_a_small_space() -> None:
    done = plan_cli(TINY, "algorithm=dpo", "plan.mode=exhaustive", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "exhaustive" and [c["name"] for c in report["calls"]] == ["ref_inf", "actor_train"]
    assert report["evaluated_plans"] > 1
    assert report["est_iteration_s"] <= report["baseline_iteration_s"] * 1.0001


def test_usage_errors_are_one_line() -> None:
    for args in (["--bogus"], [TINY, "--bogus"]):
        done = plan_cli(*args)
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: ")


def test_gantt_draws_measured_bars_beside_estimated(tmp_path: Path) -> None:
    from app.reporting.report import GanttBar, draw_gantt

    bars = [GanttBar(0, 0.0, 1.0, "actor_gen #0", "call"), GanttBar(1, 0.0, 1.0, "actor_gen #0", "call"),
            GanttBar(0, 1.0, 1.2, "realloc>actor_train #0", "realloc"),
            GanttBar(2, 0.0, 1.3, "actor_gen #0", "measured"), GanttBar(3, 0.1, 0.4, "rew_inf #0", "measured")]
    path = tmp_path / "measured.png"
    draw_gantt(bars, path, title="measured vs estimated", n_rows=4)
    assert path.read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty.png"
    draw_gantt([], empty)  # nothing ran yet: still a valid (empty) chart
    assert empty.read_bytes()[:4] == b"\x89PNG"


def test_report_without_a_baseline_prints_na_and_json_null() -> None:
    from app.config.experiment import load_config
    from app.config.problem import build_problem
    from app.reporting.report import format_plan_table, plan_json, plan_report
    from planning.search import symmetric_baseline
    from planning.simulate import simulate

    problem = build_problem(load_config(TINY))
    plan, seconds = symmetric_baseline(problem)
    report = plan_report(problem, plan, simulate(problem, plan), mode="manual", est_iteration_s=seconds,
                         baseline_iteration_s=float("inf"), search_s=0.0, evaluated_plans=1)
    text = format_plan_table(report)
    assert "speedup: n/a" in text and "symmetric baseline: infeasible" in text
    data = plan_json(report)
    assert data["baseline_iteration_s"] is None and data["speedup"] is None
    assert data["est_iteration_s"] == pytest.approx(seconds)
    json.dumps(data, allow_nan=False)  # strict JSON: no inf or nan left


def test_bounded_staleness_shows_both_estimates() -> None:
    done = plan_cli(EXAMPLES / "ppo-async-tiny.yaml")  # max_staleness 1, generation alone on GPUs 0-1
    assert done.returncode == 0, done.stderr
    assert "max_staleness 1:" in done.stdout and "on-policy (max_staleness 0):" in done.stdout
    report = json.loads(plan_cli(EXAMPLES / "ppo-async-tiny.yaml", "--json").stdout)
    assert report["max_staleness"] == 1
    # The same placements, generation off the critical path: faster than on-policy.
    assert report["on_policy_iteration_s"] > report["est_iteration_s"] > 0
    assert report["staleness_speedup"] == pytest.approx(report["on_policy_iteration_s"] / report["est_iteration_s"])
