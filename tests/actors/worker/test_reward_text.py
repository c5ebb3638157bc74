"""A reward model with another tokenizer than the actor's, and token ids outside a model's vocabulary,
on a serial ModelWorker (one process, no process group).

* The reward call reads the rows' text through `app.data.RewardText`: the actor's ids decoded with
  its tokenizer (a tiny Qwen-style BPE), rendered with the reward model's chat template (or as
  plain text), re-tokenized with the reward model's own tokenizer (a BPE trained on another
  corpus): its scores equal `transformers` scoring the same text directly.
* Ids a model's embedding cannot look up stop the call on the host with one line naming the step,
  the model, the id and the vocabulary (never an IndexError / device-side assert).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from actors.engine import AdamWConfig, ModelEngine, ParallelGroups, SequenceBatch, TokenIdError
from actors.rl import LossSums
from actors.worker import CallSpec, ModelWorker
from app.data import REWARD_TEXT
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement
from tests.tiny_chat_model import build_tokenizer
from tests.tokenizer_families import build_reward_model

pytestmark = pytest.mark.unit

ONE = Placement(Mesh(0, 1, 1), Layout())
PROMPTS = ["What is 14 + 9?", "Count the apples and pears.", "Is the answer good?"]
RESPONSES = ["It is 23.", "There are 7 apples, then 2 pears: 9 in total", ""]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_text")
    build_tokenizer(root / "actor")
    build_reward_model(root / "rm")
    return {"actor": root / "actor", "rm": root / "rm"}


def _worker(rm: Path) -> ModelWorker:
    torch.set_num_threads(1)
    worker = ModelWorker(0, 1, "cpu")
    worker.load_model("reward", ModelSpec.from_hf_config(rm), True, ONE, str(rm), 0, False, {})
    return worker


def _rows(actor_dir: Path) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(actor_dir)
    eos = tok.eos_token_id
    return {"row_start": 0, "n": len(PROMPTS), "prompt": PROMPTS,
            "prompt_ids": [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS],
            # responses as generated: ended by eos (the first), cut at the length limit (the second)
            "response_ids": [torch.tensor(tok(r, add_special_tokens=False)["input_ids"] + [eos] * (i != 1))
                             if r else torch.tensor([eos]) for i, r in enumerate(RESPONSES)]}


@pytest.mark.parametrize("chat_template", [True, False])
def test_reward_model_with_another_tokenizer_scores_the_decoded_text(dirs: dict[str, Path],
                                                                     chat_template: bool) -> None:
    worker = _worker(dirs["rm"])
    actor_eos = transformers.AutoTokenizer.from_pretrained(dirs["actor"]).eos_token_id
    text = {"bridge": REWARD_TEXT, "actor_tokenizer": str(dirs["actor"]), "reward_tokenizer": str(dirs["rm"]),
            "chat_template": chat_template, "max_length": 512, "eos_token_id": actor_eos}
    meta, data = worker.run_call(CallSpec("rew_inf", "reward", "inference", ONE, 0, len(PROMPTS),
                                          {"op": "model_reward", "reward_text": text}), _rows(dirs["actor"]))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(dirs["rm"]).float().eval()
    rm_tok = transformers.AutoTokenizer.from_pretrained(dirs["rm"])
    expected = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        if chat_template:
            rendered = rm_tok.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": response}], tokenize=False)
            ids = rm_tok(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]
        else:
            ids = rm_tok(prompt + response, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(float(hf(ids).logits[0, 0]))
    assert data["rewards"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert meta["rewards"] == data["rewards"] and meta["summed"] == {"reward/truncated": 0.0}


def test_reward_text_cuts_to_max_length_and_counts_it(dirs: dict[str, Path]) -> None:
    worker = _worker(dirs["rm"])
    text = {"bridge": REWARD_TEXT, "actor_tokenizer": str(dirs["actor"]), "reward_tokenizer": str(dirs["rm"]),
            "chat_template": False, "max_length": 6, "eos_token_id": None}
    meta, data = worker.run_call(CallSpec("rew_inf", "reward", "inference", ONE, 0, len(PROMPTS),
                                          {"op": "model_reward", "reward_text": text}), _rows(dirs["actor"]))
    rm_tok = transformers.AutoTokenizer.from_pretrained(dirs["rm"])
    longer = sum(len(rm_tok(p + r)["input_ids"]) > 6 for p, r in zip(PROMPTS, RESPONSES))
    assert longer >= 2 and meta["summed"]["reward/truncated"] == longer and meta["reward/seq_len_mean"] == 6.0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(dirs["rm"]).float().eval()
    ids = rm_tok(PROMPTS[1] + RESPONSES[1], return_tensors="pt")["input_ids"][:, -6:]  # its last 6 tokens
    with torch.no_grad():
        assert data["rewards"][1] == pytest.approx(float(hf(ids).logits[0, 0]), rel=1e-4, abs=1e-5)


# ---- ids outside the vocabulary -------------------------------------------------------------------


def test_out_of_range_ids_stop_a_worker_call_naming_model_and_id(dirs: dict[str, Path]) -> None:
    worker = _worker(dirs["rm"])  # vocabulary 320: ids of the 512-token actor tokenizer overflow it
    rows = {"row_start": 0, "n": 2, "prompt_ids": [torch.tensor([5, 6]), torch.tensor([7])],
            "response_ids": [torch.tensor([8, 400]), torch.tensor([9, 10])]}
    for op in ("model_reward", "values"):
        call = CallSpec("rew_inf", "reward", "inference", ONE, 0, 2, {"op": op})
        with pytest.raises(TokenIdError, match=r"forward_values of critic/reward model 'rm': token id 400 .*"
                                               r"vocabulary of 320 ids \(0\.\.319\)") as caught:
            worker.run_call(call, rows)
        assert "\n" not in str(caught.value)
    spec = ModelSpec("tiny-actor", "llama", vocab_size=64, hidden_size=16, intermediate_size=32, n_layers=1,
                     n_heads=2, n_kv_heads=2, head_dim=8, max_position_embeddings=32)
    worker.load_model("ref", spec, False, ONE, None, 0, False, {})
    rows["response_ids"] = [torch.tensor([8, -1]), torch.tensor([9, 10])]
    with pytest.raises(TokenIdError, match=r"forward_logprobs of model 'tiny-actor': token id -1 .*64 ids"):
        worker.run_call(CallSpec("ref_inf", "ref", "inference", ONE, 0, 2, {"op": "logprobs"}), rows)


def test_a_train_step_checks_its_ids_before_the_embedding() -> None:
    spec = ModelSpec("tiny-critic", "llama", vocab_size=32, hidden_size=16, intermediate_size=32, n_layers=1,
                     n_heads=2, n_kv_heads=2, head_dim=8, max_position_embeddings=32)
    groups = ParallelGroups(Layout(), 0, 0, 0, None, None, None, None, None, (0,), (0,))
    engine = ModelEngine(spec, True, groups, "cpu", seed=0, optim_config=AdamWConfig(lr=1e-3))

    def loss(values: torch.Tensor, data: dict[str, torch.Tensor]) -> LossSums:
        return LossSums(values.sum(), torch.tensor(1.0), {})

    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(TokenIdError, match="train step of critic/reward model 'tiny-critic': token id 32 "):
        engine.train_step(SequenceBatch(torch.tensor([1, 2, 32, 3]), (2, 2)), loss)
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    engine.train_step(SequenceBatch(torch.tensor([1, 2, 31, 3]), (2, 2)), loss)  # in range: it trains
