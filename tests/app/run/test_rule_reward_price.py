"""A rule reward's call is priced by how the actor's tokenizer decodes: through the byte table
(a byte-level BPE, actors.worker.byte_level) at BYTE_TABLE_S_PER_TOKEN, any other tokenizer (the
toy one here) at the default MODEL_FREE_S_PER_TOKEN; a reward model's calls are not touched.
`python -m app plan` (plan_experiment) prices it the same where the tokenizer is on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.plan import plan_experiment
from app.config import load_config
from app.run.runtime import preflight
from benchmarks.peer_bench import TINY_WORK, our_config
from benchmarks.peer_setup import build_inputs
from planning.cost import call_cost
from planning.cost_terms import BYTE_TABLE_S_PER_TOKEN, MODEL_FREE_S_PER_TOKEN
from planning.layout import Layout, Mesh
from planning.plan import Placement

pytestmark = pytest.mark.unit

ONE_GPU = Placement(Mesh(0, 1, 1), Layout(1, 1, 1))
GRPO_TINY = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"


def test_a_byte_level_tokenizer_prices_the_rule_reward_at_the_byte_tables_rate(tmp_path: Path) -> None:
    built = build_inputs(tmp_path / "inputs", tiny=True, n_prompts=TINY_WORK.prompts, prompt_len=TINY_WORK.prompt_len)
    config = our_config(built.model_dir, built.prompts, TINY_WORK, True, tmp_path / "runs" / "run", 2, [])
    inputs = preflight(load_config(config))
    reward = inputs.problem.graph.mfc("rew_inf")
    assert reward.model_free and reward.host_s_per_token == BYTE_TABLE_S_PER_TOKEN
    rows = reward.batch.n_seqs * reward.batch.gen_len
    assert call_cost(inputs.problem, reward, ONE_GPU).time_s == pytest.approx(rows * BYTE_TABLE_S_PER_TOKEN)


def test_the_toy_tokenizer_keeps_the_default_rate_and_a_reward_model_none() -> None:
    inputs = preflight(load_config(GRPO_TINY))
    reward = inputs.problem.graph.mfc("rew_inf")
    assert reward.model_free and reward.host_s_per_token is None
    rows = reward.batch.n_seqs * reward.batch.gen_len
    assert call_cost(inputs.problem, reward, ONE_GPU).time_s == pytest.approx(rows * MODEL_FREE_S_PER_TOKEN)
    modelled = preflight(load_config(GRPO_TINY, ["reward.function=null"])).problem.graph.mfc("rew_inf")
    assert not modelled.model_free and modelled.host_s_per_token is None


def test_plan_prices_the_rule_reward_as_train_does_where_the_tokenizer_is_here(tmp_path: Path) -> None:
    built = build_inputs(tmp_path / "inputs", tiny=True, n_prompts=TINY_WORK.prompts, prompt_len=TINY_WORK.prompt_len)
    config = our_config(built.model_dir, built.prompts, TINY_WORK, True, tmp_path / "runs" / "run", 2, [])
    trained = preflight(load_config(config)).problem.graph.mfc("rew_inf")
    planned = plan_experiment(load_config(config, ["plan.seconds=1"])).problem.graph.mfc("rew_inf")
    assert planned.host_s_per_token == trained.host_s_per_token == BYTE_TABLE_S_PER_TOKEN
    # Planning the config before its files are here (the tokenizer directory absent): the default.
    absent = load_config(config, ["plan.seconds=1", f"data.tokenizer={tmp_path / 'not-downloaded'}"])
    assert plan_experiment(absent).problem.graph.mfc("rew_inf").host_s_per_token is None
