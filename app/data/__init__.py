"""What a run trains on: the built-in toy task, prompt and preference datasets, reward functions.

May import planning and app.config (no torch at import time); actors.worker only inside functions
(the workers' decoding, which the text bridge and a rule reward's price use). In dependency order:
  toy_task  the built-in toy task: prompts, a character tokenizer and its rule-based reward
  user_code importing the code a config names ('module:attr' or 'file.py:attr')
  datasets  JSONL/Parquet prompt files and DPO preference pairs, tokenisation, the batch iterator
  gsm8k     GSM8K-format math problems (question, answer ending `#### N`) turned into prompt files
  rewards   rule-based reward functions named by a `module:function` string
  tokenizers  tokenizer fingerprints (which models may exchange ids) and the text bridge of a
            reward model with another tokenizer than the actor's
"""

from __future__ import annotations

from app.data.datasets import (
    BatchIterator,
    IteratorState,
    PreferenceExample,
    PreferenceRecord,
    PromptExample,
    build_prompt_dataset,
    load_preference_records,
    load_tokenizer,
    read_text_column,
    tokenize_preferences,
)
from app.data.gsm8k import GSM8K_INSTRUCTION, final_answer, prepare_gsm8k
from app.data.rewards import RewardLoadError, load_reward_fn, math_exact_match
from app.data.tokenizers import (
    REWARD_TEXT,
    RewardText,
    TokenizerInfo,
    load_tokenizer_object,
    rule_reward_s_per_token,
    tokenizer_info,
)
from app.data.toy_task import TOY_RESPONSE_LEN, generate_toy_prompts, toy_target
from app.data.user_code import import_user_module, looks_like_file

__all__ = [
    # toy_task.py
    "TOY_RESPONSE_LEN", "generate_toy_prompts", "toy_target",
    # user_code.py
    "import_user_module", "looks_like_file",
    # datasets.py
    "BatchIterator", "IteratorState", "PreferenceExample", "PreferenceRecord", "PromptExample", "build_prompt_dataset",
    "load_preference_records", "load_tokenizer", "read_text_column", "tokenize_preferences",
    # gsm8k.py
    "GSM8K_INSTRUCTION", "final_answer", "prepare_gsm8k",
    # rewards.py
    "RewardLoadError", "load_reward_fn", "math_exact_match",
    # tokenizers.py
    "REWARD_TEXT", "RewardText", "TokenizerInfo", "load_tokenizer_object", "rule_reward_s_per_token", "tokenizer_info",
]
