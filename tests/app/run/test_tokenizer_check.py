"""Models that do not share the actor's tokenizer, checked before Ray (app.run.tokenizer_check).

Through `python -m app train` in-process: a reference or critic with another tokenizer, a critic
directory of another vocabulary without tokenizer files, a reward model of 64 tokens without a
tokenizer beside the toy actor (or a preset of another vocabulary), an actor directory whose
tokenizer is not data.tokenizer: each exits with status 2 and one line naming the models, before
any way to Ray. A reward model with its own tokenizer passes: its calls read text, priced at the
measured token ratio, while a config of one tokenizer keeps its planning problem as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import main
from app.cli.plan import plan_experiment
from app.cli.train import DEFAULT_CONFIG
from app.config import build_problem, load_config
from app.run import preflight
from tests.tiny_chat_model import build_tiny_chat_model
from tests.tokenizer_families import build_other_tokenizer, build_reward_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok_check")
    build_reward_model(root / "rm")  # the second family's tokenizer (320 ids) and a reward head
    build_reward_model(root / "rm_plain", chat_template=False)
    build_reward_model(root / "rm64", vocab_size=64, tokenizer=False)  # weights only
    build_other_tokenizer(root / "other_tok")
    build_tiny_chat_model(root / "qwen")  # an actor directory with its own (Qwen-style) tokenizer
    build_reward_model(root / "rm16", max_positions=16)  # fewer positions than the toy task's 24 tokens
    build_reward_model(root / "rm16_ids", vocab_size=256, tokenizer=False, max_positions=16)
    return {name: root / name for name in ("rm", "rm_plain", "rm64", "other_tok", "qwen", "rm16", "rm16_ids")}


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to Ray fails the test: these configs must stop before."""
    import ray

    import app.run.driver

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached Ray: the tokenizer check should have stopped this config before")

    monkeypatch.setattr(ray, "init", reached)
    monkeypatch.setattr(app.run.driver, "connect_cluster", reached)


CASES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "critic_other_tokenizer": (["models.critic.preset=null", "models.critic.path={rm}"],
                               ("models.critic", "is not the actor's", "models.actor (preset tiny")),
    "ref_other_tokenizer": (["models.ref.preset=tiny", "models.ref.tokenizer={other_tok}"],
                            ("models.ref", "is not the actor's", "models.actor (preset tiny")),
    "critic_smaller_vocab_no_tokenizer": (["models.critic.preset=null", "models.critic.path={rm64}"],
                                          ("models.critic", "vocabulary 64", "vocabulary 256")),
    "reward_64_no_tokenizer": (["reward.function=null", "models.reward.path={rm64}"],
                               ("models.reward", "64 ids", "256", "models.reward.tokenizer")),
    "reward_preset_other_vocab": (["reward.function=null", "models.reward.preset=llama3.2-1b",
                                   "cluster.gpu=h200-141g"], ("models.reward", "128256", "256")),
    "actor_dir_not_data_tokenizer": (["models.actor.preset=null", "models.actor.path={qwen}", "plan.mode=heuristic"],
                                     ("data.tokenizer", "models.actor")),
    "reward_template_missing": (["reward.function=null", "models.reward.path={rm_plain}",
                                 "models.reward.chat_template=true"], ("models.reward.chat_template",)),
    "critic_chat_template": (["models.critic.chat_template=false"], ("models.critic.chat_template",)),
    "reward_tokenizer_missing": (["reward.function=null", "models.reward.path={rm64}",
                                  "models.reward.tokenizer={rm64}/none"], ("models.reward.tokenizer",)),
    # Reading the actor's ids as they are, its 16 positions cannot hold the 16 + 8 tokens of a sequence.
    "reward_ids_too_few_positions": (["reward.function=null", "models.reward.path={rm16_ids}"],
                                     ("batch.gen_len", "<= 16 (max positions of models.reward)")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_models_without_the_actors_tokenizer_exit_2_before_ray(case: str, dirs: dict[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, no_ray: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    overrides, expected = CASES[case]
    status = main(["train", str(DEFAULT_CONFIG), *[o.format(**{k: str(v) for k, v in dirs.items()}) for o in overrides]])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error:"), err[-2000:]
    for part in expected:
        assert part in lines[0], f"{case}: {part!r} not in {lines[0]!r}"


def test_a_reward_model_with_its_own_tokenizer_reads_text_priced_at_its_tokens(dirs: dict[str, Path]) -> None:
    cfg = load_config(DEFAULT_CONFIG, ["reward.function=null", f"models.reward.path={dirs['rm']}"])
    inputs = preflight(cfg)
    params = inputs.settings.rollout.reward_params()
    text = params["reward_text"]
    assert params["op"] == "model_reward" and text["chat_template"] is True and text["max_length"] == 512
    assert text["actor_tokenizer"] == "app.data.toy_task:CharTokenizer" and text["reward_tokenizer"] == str(dirs["rm"])
    plain = build_problem(cfg)
    for before, after in zip(plain.graph.mfcs, inputs.problem.graph.mfcs):
        if before.role != "reward":
            assert before == after
            continue
        # The template's own tokens plus the measured ratio: toy prompts are digit strings, each a
        # character token for the actor, fewer BPE tokens for the reward model.
        assert after.batch.n_seqs == before.batch.n_seqs and after.batch.gen_len < before.batch.gen_len
        assert after.batch.prompt_len > before.batch.prompt_len
    # Cut to models.reward.max_length: priced at no more than that.
    cfg = load_config(DEFAULT_CONFIG, ["reward.function=null", f"models.reward.path={dirs['rm']}",
                                       "models.reward.max_length=10", "models.reward.chat_template=false"])
    inputs = preflight(cfg)
    assert inputs.settings.rollout.reward_text["max_length"] == 10
    assert inputs.problem.graph.mfc("rew_inf").batch.seq_len == 10


def test_one_tokenizer_keeps_the_problem_and_the_params() -> None:
    cfg = load_config(DEFAULT_CONFIG, ["reward.function=null"])  # the critic's shape as the reward model
    inputs = preflight(cfg)
    assert inputs.problem == build_problem(cfg) and "reward_text" not in inputs.settings.rollout.reward_params()


def test_a_reward_model_reading_text_may_have_fewer_positions_than_the_actors_sequences(
        dirs: dict[str, Path], tmp_path: Path) -> None:
    """Its text is cut to its own length, so its positions are checked only against that: train
    takes it, and `plan` prices its calls as train does (the ratio measured on the same prompts)."""
    overrides = ["reward.function=null", f"models.reward.path={dirs['rm16']}", "plan.seconds=1"]
    cfg = load_config(DEFAULT_CONFIG, overrides)
    assert cfg.batch.prompt_len + cfg.batch.gen_len > 16
    trained = preflight(cfg)
    assert trained.settings.rollout.reward_text["max_length"] == 16
    assert trained.problem.graph.mfc("rew_inf").batch.seq_len == 16
    assert plan_experiment(cfg).problem == trained.problem
    # Before the dataset is here, plan prices the text at one token per actor token, cut to 16.
    absent = load_config(DEFAULT_CONFIG, [*overrides, f"data.path={tmp_path / 'not-here.jsonl'}"])
    planned = plan_experiment(absent).problem
    assert planned == build_problem(absent, 1.0) and planned.graph.mfc("rew_inf").batch.seq_len == 16
    assert planned != trained.problem  # the measured ratio and the template's tokens moved the shape
    # Nor is a reward tokenizer still to download a fault: the same default.
    later = load_config(DEFAULT_CONFIG, [*overrides, f"models.reward.tokenizer={tmp_path / 'rm-tokenizer'}"])
    assert plan_experiment(later).problem == build_problem(later, 1.0)


def test_plan_prices_a_reward_model_with_its_own_tokenizer_as_train_does(dirs: dict[str, Path]) -> None:
    cfg = load_config(DEFAULT_CONFIG, ["reward.function=null", f"models.reward.path={dirs['rm']}", "plan.seconds=1"])
    assert plan_experiment(cfg).problem == preflight(cfg).problem != build_problem(cfg)
