"""Tests of app.envs.templates: observation ids with the toy tokenizer and with a real byte-level
BPE tokenizer and Qwen-style chat template (tests/tiny_chat_model.py): the delta is exactly the
tail of the whole conversation's rendering, the prefix-preserving check, truncation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.data.toy_task import BOS_ID, EOS_ID
from app.envs import ObservationEncoder, check_prefix_preserving
from app.envs.templates import render_ids
from tests.tiny_chat_model import build_tokenizer

pytestmark = pytest.mark.unit

# Like Qwen3's: the <think> block of an assistant turn is dropped once a later turn follows.
THINK_STRIPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QUESTION = "Tom has 3 bags of 12 apples. How many apples?"
ACTION = "I will compute <calc>3 * 12</calc>"
OBSERVATION = "<result>36</result>"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def hf(chat_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


def test_toy_path() -> None:
    encoder = ObservationEncoder("toy", chat_template=False)
    assert encoder.encode_prompt("?") == [BOS_ID, ord("?")]
    assert encoder.encode_observation("3", 64) == ([ord("3")], False)
    assert encoder.encode_observation("12345", 3) == ([ord("1"), ord("2"), ord("3")], True)
    assert encoder.decode([ord("4"), ord("2"), EOS_ID, ord("9")]) == "42"
    assert encoder.min_observation_tokens == 1
    with pytest.raises(ValueError, match="chat messages, but data.chat_template is false"):
        encoder.encode_prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="tokenizer 'toy' has no chat template"):
        ObservationEncoder("toy", chat_template=True)
    spec = ObservationEncoder("app.data.toy_task:CharTokenizer", chat_template=False)
    assert spec.encode_prompt("7") == [BOS_ID, ord("7")]


@pytest.mark.parametrize("role", ["user", "tool"])
@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_token_in_token_out_equals_the_whole_rendering(chat_dir: Path, hf: Any, role: str,
                                                       ended_with_eos: bool) -> None:
    encoder = ObservationEncoder(str(chat_dir), chat_template=True, role=role)
    prompt = encoder.encode_prompt(QUESTION)
    action = hf.encode(ACTION, add_special_tokens=False) + ([hf.eos_token_id] if ended_with_eos else [])
    observation, truncated = encoder.encode_observation(OBSERVATION, 64, action)
    assert not truncated
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ACTION},
                    {"role": role, "content": OBSERVATION}]
    full = render_ids(hf, conversation, add_generation_prompt=True)
    assert prompt + action + observation == full
    assert observation == full[-len(observation):]
    text = hf.decode(observation)
    expected_start = "\n" if ended_with_eos else "<|im_end|>\n"  # an action cut short gets its turn closed
    assert text == f"{expected_start}<|im_start|>{role}\n{OBSERVATION}<|im_end|>\n<|im_start|>assistant\n"


def test_messages_prompt_and_plain_hf(chat_dir: Path, hf: Any) -> None:
    encoder = ObservationEncoder(str(chat_dir), chat_template=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert encoder.encode_prompt(messages) == render_ids(hf, messages, add_generation_prompt=True)
    plain = ObservationEncoder(str(chat_dir), chat_template=False)
    assert plain.encode_observation(OBSERVATION, 64) == (hf.encode(OBSERVATION, add_special_tokens=False), False)
    assert plain.encode_prompt(QUESTION) == hf.encode(QUESTION)
    assert plain.decode(hf.encode(ACTION) + [hf.eos_token_id]) == ACTION


def test_prefix_check_passes_and_fails_clearly(chat_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    check_prefix_preserving(tokenizer, "user")
    check_prefix_preserving(tokenizer, "tool")
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    with pytest.raises(ValueError) as info:
        check_prefix_preserving(tokenizer, "tool", name="qwen3-like")
    message = str(info.value)
    assert "tokenizer 'qwen3-like': its chat template is not prefix-preserving" in message
    assert "rollout.observation_role='tool'" in message and "they diverge at character" in message
    assert "<think>Let me see.</think>" in message  # the text without the new turn, where they diverge
    assert "data.chat_template=false" in message
    with pytest.raises(ValueError, match="not prefix-preserving"):
        ObservationEncoder(tokenizer, chat_template=True)
    ObservationEncoder(tokenizer, chat_template=True, check_prefix=False)  # the check can be turned off
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template is missing"):
        check_prefix_preserving(tokenizer, "user")


def test_prefix_check_takes_specs_and_wrappers(chat_dir: Path) -> None:
    from app.data import load_tokenizer

    check_prefix_preserving(load_tokenizer(str(chat_dir)), "tool")  # app.data's HFTokenizer wrapper
    check_prefix_preserving(str(chat_dir), "user")
    with pytest.raises(ValueError, match="tokenizer 'toy': its chat template is missing"):
        check_prefix_preserving("toy", "user")


def test_a_template_that_cannot_render_the_role(chat_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}"
                               "{{ raise_exception('no tool role') }}{%- endif %}{{ m['content'] }}{%- endfor %}")
    with pytest.raises(ValueError, match="cannot render a conversation user, assistant, tool .*no tool role"):
        check_prefix_preserving(tokenizer, "tool")


def test_templated_truncation_keeps_the_template_tokens(chat_dir: Path, hf: Any) -> None:
    encoder = ObservationEncoder(str(chat_dir), chat_template=True, role="tool")
    action = hf.encode(ACTION, add_special_tokens=False) + [hf.eos_token_id]
    text = " ".join(f"line {i} of a long tool output" for i in range(50))
    short_ids, _ = encoder.encode_observation("", 64, action)
    for budget in (encoder.min_observation_tokens + 1, 20, 40):
        ids, truncated = encoder.encode_observation(text, budget, action)
        assert truncated and budget - 1 <= len(ids) <= budget  # as many content tokens as fit
        decoded = hf.decode(ids)
        head, end = "\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
        assert decoded.startswith(head) and decoded.endswith(end)
        content = decoded[len(head):-len(end)]
        assert content and text.startswith(content)  # the content's first tokens, as many as fit
    assert len(short_ids) == encoder.min_observation_tokens - 1  # the eos of the action is not repeated
    with pytest.raises(ValueError, match="max_observation_tokens=3: the chat template alone takes"):
        encoder.encode_observation(text, 3, action)
