"""The built-in toy task: a prompt/reward pair a tiny random transformer learns in a few dozen
PPO iterations on CPU, plus its character-level tokenizer (vocab 256, the `tiny` model preset).

Task "count on": the prompt is a random string of 3-8 digits, e.g. "4172". The ideal response is
the next `TOY_RESPONSE_LEN` digits counting up from the last prompt digit, modulo 10: "3456".
Each of the first 4 response characters earns 1 if it is the successor of the character before
it (the last prompt digit for the first one), 0.2 if it is some other digit, 0 otherwise; the
reward is the mean over the 4 positions (characters past the 4th are ignored, a response shorter
than 4 loses the missing positions). The reward is dense and
every step of the target is a fixed next-token map (digit d -> d+1) that the embedding/unembedding
path of any transformer represents directly, so learning shows within ~40 iterations: the reward
climbs from ~0.01 (random tokens over 256) through 0.2 (digits) towards 1.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TOY_VOCAB_SIZE = 256
TOY_RESPONSE_LEN = 4
DIGIT_CREDIT = 0.2


class CharTokenizer:
    """Character-level tokenizer over Latin-1: token id = ord(char) for chars 3..255.

    Ids 0, 1, 2 are pad, bos and eos (the `tiny` preset in planning/models.py: bos 1, eos 2), so
    the characters U+0000..U+0002 cannot be encoded; everything fits a vocabulary of 256.
    """

    vocab_size = TOY_VOCAB_SIZE
    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, optionally preceded by bos."""
        ids = [BOS_ID] if add_bos else []
        for position, char in enumerate(text):
            code = ord(char)
            if not EOS_ID < code < TOY_VOCAB_SIZE:
                raise ValueError(f"text[{position}]={char!r} (U+{code:04X}): the toy tokenizer encodes only "
                                 "Latin-1 characters U+0003..U+00FF")
            ids.append(code)
        return ids

    def encode_prompt(self, text: str, chat_template: bool = False) -> list[int]:
        """Prompt ids as the model sees them: bos + characters (the toy task has no chat format)."""
        if chat_template:
            raise ValueError("chat_template=True: the toy tokenizer has no chat template; set it to false")
        return self.encode(text, add_bos=True)

    def encode_completion(self, text: str) -> list[int]:
        """Completion ids (DPO/SFT targets): characters + eos."""
        return self.encode(text) + [EOS_ID]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; stops at the first eos. Specials are dropped, or shown as <pad>/<bos>/<eos>."""
        names = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
        chars = []
        for token in ids:
            token = int(token)
            if not 0 <= token < TOY_VOCAB_SIZE:
                raise ValueError(f"token id {token}: outside the toy vocabulary [0, {TOY_VOCAB_SIZE})")
            if token in names:
                if not skip_special_tokens:
                    chars.append(names[token])
                if token == EOS_ID:
                    break
                continue
            chars.append(chr(token))
        return "".join(chars)


def toy_target(prompt: str) -> str:
    """The ideal response: TOY_RESPONSE_LEN digits counting up from the prompt's last digit."""
    if not prompt or not prompt[-1].isdigit():
        raise ValueError(f"prompt={prompt!r}: the toy task needs a prompt ending in a digit")
    last = int(prompt[-1])
    return "".join(str((last + 1 + k) % 10) for k in range(TOY_RESPONSE_LEN))


def toy_reward(prompt: str, response: str, answer: str | None = None) -> float:
    """Partial-credit reward in [0, 1] for the count-on task (see the module docstring).

    Position k of the response earns 1 when it is the successor (mod 10) of the character before
    it (the last prompt digit for k = 0), DIGIT_CREDIT when it is another digit. Credit is local,
    so a wrong digit costs one position, not every later one. `answer` (the ideal response in
    the dataset) is not needed: the ideal response is the only one that scores 1.
    """
    if not prompt or not prompt[-1].isdigit():
        raise ValueError(f"prompt={prompt!r}: the toy task needs a prompt ending in a digit")
    previous, credit = prompt[-1], 0.0
    for char in response[:TOY_RESPONSE_LEN]:
        if char in "0123456789":
            is_successor = previous in "0123456789" and int(char) == (int(previous) + 1) % 10
            credit += 1.0 if is_successor else DIGIT_CREDIT
        previous = char
    return credit / TOY_RESPONSE_LEN


def generate_toy_prompts(n: int, seed: int, min_digits: int = 3, max_digits: int = 8) -> list[dict[str, str]]:
    """n records {"prompt": digits, "answer": target}, the same for the same seed."""
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"min_digits={min_digits}, max_digits={max_digits}: need 1 <= min_digits <= max_digits")
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        records.append({"prompt": prompt, "answer": toy_target(prompt)})
    return records


def write_toy_jsonl(path: str | Path, n: int, seed: int) -> Path:
    """Write `generate_toy_prompts(n, seed)` as JSONL (one record a line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in generate_toy_prompts(n, seed):
            f.write(json.dumps(record) + "\n")
    return path


# The shipped dataset: examples/data/toy_prompts.jsonl == write_toy_jsonl(..., n=512, seed=0).
SHIPPED_TOY_N, SHIPPED_TOY_SEED = 512, 0
SHIPPED_TOY_PATH = Path(__file__).resolve().parents[2] / "examples" / "data" / "toy_prompts.jsonl"

__all__ = [
    "BOS_ID", "CharTokenizer", "EOS_ID", "PAD_ID", "SHIPPED_TOY_N", "SHIPPED_TOY_PATH", "SHIPPED_TOY_SEED",
    "TOY_RESPONSE_LEN", "TOY_VOCAB_SIZE", "generate_toy_prompts", "toy_reward", "toy_target", "write_toy_jsonl",
]
