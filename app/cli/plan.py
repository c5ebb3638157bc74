"""`python -m app plan CONFIG.yaml [key.path=value ...] [--json] [--gantt FILE.png]`.

Searches a plan (mesh + layout per call) for an experiment config without any GPU and prints
the per-call table, the estimated iteration time beside the symmetric baseline, and the search
time. `plan_experiment` is the reusable part (training searches the same way, from
app.run.runtime.preflight's problem).

The reward calls are priced as `train` prices them where the files that pricing reads are on this
machine. A rule reward, where data.tokenizer is 'toy' or a directory here: by how fast its rows
decode with that tokenizer (app.data.rule_reward_s_per_token). A reward model with a tokenizer of
its own, where data.tokenizer and every tokenizer the models name are here: once
app.run.tokenizer_check has compared them, at the actor's ids or as re-tokenized text, at the
ratio measured on the dataset's first prompts (1.0 while data.path is not here yet). Planning a
config before its files are here keeps the planner's defaults: the rule reward's default rate,
and a reward model with a tokenizer of its own priced as text at ratio 1.0, cut to its length. A
tokenizer mismatch found on the way ends `plan` as it would end `train`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.config import (
    ConfigError,
    ExperimentConfig,
    build_problem,
    load_config,
    manual_plan,
    model_tokenizer,
    reward_may_read_text,
    role_sources,
    rule_reward_priced,
    search_error,
)
from app.data import load_tokenizer, rule_reward_s_per_token
from app.reporting import PlanReport, draw_gantt, format_plan_table, plan_json, plan_report, simulated_bars
from planning.cost import PlanningProblem
from planning.dataflow import with_staleness
from planning.plan import ExecutionPlan
from planning.search import SearchResult, search_plan
from planning.simulate import SimResult, simulate

GANTT_ITERATIONS = 2


@dataclass(frozen=True)
class PlanOutcome:
    """The planning problem of a config, the search's answer and its report."""

    problem: PlanningProblem
    result: SearchResult
    report: PlanReport


def add_parser(subparsers: Any) -> None:
    """Register the `plan` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "plan", help="search a plan (mesh + layout per call) for a config, no GPU needed",
        description="Search a plan for CONFIG and print the per-call table and estimated iteration time.",
    )
    parser.add_argument("config", help="experiment YAML, e.g. examples/ppo-7b-34b.yaml")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key.path=value",
                        help="config overrides, e.g. plan.seconds=5")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--gantt", metavar="FILE.png",
                        help=f"draw the simulated timeline of {GANTT_ITERATIONS} iterations")
    parser.add_argument("--nodes", type=int, help="shortcut for cluster.nodes=N")
    parser.add_argument("--gpus-per-node", type=int, help="shortcut for cluster.gpus_per_node=M")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load, plan, print. Bad input raises ConfigError (the CLI entry turns it into exit status 2)."""
    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"cluster.nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    cfg = load_config(args.config, overrides)
    outcome = plan_experiment(cfg)
    if args.gantt:
        write_gantt(outcome, args.gantt)
    if args.json:
        print(json.dumps(plan_json(outcome.report), indent=2, allow_nan=False))
    else:
        print(format_plan_table(outcome.report))
        if args.gantt:
            print(f"gantt chart: {args.gantt}")
    return 0


def plan_experiment(cfg: ExperimentConfig) -> PlanOutcome:
    """Build the problem, search (or take the manual plan), and refuse plans that cannot run.
    With run.max_staleness > 0 the on-policy graph is planned too (same mode and budget), so the
    report shows both estimates."""
    problem = problem_as_train(cfg)
    manual = manual_plan(cfg, problem)
    result = _search(cfg, problem, manual)
    on_policy = None
    if problem.graph.max_staleness:
        on_policy = _search(cfg, replace(problem, graph=with_staleness(problem.graph, 0)), manual).est_iteration_s
    sim = simulate(problem, result.plan)
    report = plan_report(
        problem, result.plan, sim, mode=cfg.plan.mode, est_iteration_s=result.est_iteration_s,
        baseline_iteration_s=result.baseline_iteration_s, search_s=result.search_s,
        evaluated_plans=result.evaluated_plans, on_policy_iteration_s=on_policy,
    )
    _check_feasible(cfg, result, sim, report)
    return PlanOutcome(problem, result, report)


def problem_as_train(cfg: ExperimentConfig) -> PlanningProblem:
    """build_problem(cfg) with the reward calls priced as preflight prices them, where the files
    that pricing reads are on this machine (module docstring)."""
    reads_text = reward_may_read_text(cfg)
    problem = build_problem(cfg, 1.0 if reads_text else None)
    rule = cfg.algorithm != "dpo" and cfg.reward.function is not None and cfg.rollout.env is None
    if not (reads_text or rule) or (tokenizer := _tokenizer_here(cfg)) is None:
        return problem
    if reads_text and _model_tokenizers_here(cfg):  # torch and ray come with app.run: only for this case
        from app.run import reward_model_priced

        problem = reward_model_priced(cfg, problem, tokenizer)
    if rule and (rate := rule_reward_s_per_token(tokenizer)) is not None:
        problem = rule_reward_priced(problem, rate)
    return problem


def _tokenizer_here(cfg: ExperimentConfig) -> Any | None:
    """data.tokenizer loaded where it is 'toy' or a directory on this machine, else None (a hub
    name or a directory not downloaded yet: the plan keeps the planner's defaults)."""
    source = cfg.data.tokenizer
    if source != "toy" and not Path(source).is_dir():
        return None
    try:
        return load_tokenizer(source)
    except ValueError:  # train names the directory's fault; the plan keeps the defaults
        return None


def _model_tokenizers_here(cfg: ExperimentConfig) -> bool:
    """Whether every tokenizer the models state (`model_tokenizer`) is a directory on this machine,
    so that comparing them with data.tokenizer finds faults, not files still to download."""
    named = (model_tokenizer(source) for _, source in role_sources(cfg).values())
    return all(name in (None, "toy") or Path(name).expanduser().is_dir() for name in named)


def _search(cfg: ExperimentConfig, problem: PlanningProblem, manual: ExecutionPlan | None) -> SearchResult:
    try:
        return search_plan(problem, mode=cfg.plan.mode, seconds=cfg.plan.seconds, seed=cfg.plan.seed, manual=manual)
    except ValueError as exc:
        raise search_error(cfg, exc) from None


def _check_feasible(cfg: ExperimentConfig, result: SearchResult, sim: SimResult, report: PlanReport) -> None:
    """Raise ConfigError when the chosen plan does not fit (a safety net behind search_plan's checks)."""
    bad = [row for row in report.calls if not row.feasible]
    if not bad and sim.feasible and math.isfinite(result.est_iteration_s):
        return
    what = f"call {bad[0].name}: {bad[0].reason}" if bad else (sim.reason or "the iteration cannot be scheduled")
    raise search_error(cfg, ValueError(what))


def write_gantt(outcome: PlanOutcome, path: str) -> None:
    """Simulate GANTT_ITERATIONS iterations of the chosen plan and draw them, one row per GPU."""
    sim = simulate(outcome.problem, outcome.result.plan, iterations=GANTT_ITERATIONS)
    r = outcome.report
    title = f"{r.algorithm} on {r.cluster}: {GANTT_ITERATIONS} simulated iterations, {sim.iteration_s:.2f} s each"
    try:
        draw_gantt(simulated_bars(sim), path, title=title, n_rows=outcome.problem.cluster.n_gpus)
    except OSError as exc:
        raise ConfigError("--gantt", path, f"a writable PNG path ({exc.strerror})") from None
