"""Every family's chat template, from its GGUF through our Jinja path (llama-cpp-python's
formatter, as llama-cpp-python's own chat handler uses it): the prompt each family's models were
trained on, and a template's own refusal as one clear error."""

from __future__ import annotations

import pytest

from dllama.errors import ModelError
from dllama.gguf_model import GGUFModel
from dllama.tokenizer import Tokenizer

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2? "}]
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
          "Hello!<|im_end|>\n<|im_start|>user\nWhat is 2+2? <|im_end|>\n<|im_start|>assistant\n")


def _tokenizer(path) -> Tokenizer:
    model = GGUFModel(path)
    return Tokenizer(model.path, model.chat_template, model.config.bos_id, model.config.eos_id)


@pytest.mark.parametrize("name, expected", [
    ("default", CHATML),  # llama (SmolLM2, the real file): ChatML
    ("qwen2", CHATML),
    ("qwen3-tiny", CHATML),
    ("qwen3moe-top2", CHATML),
    # Gemma 3: BOS first, the system prompt opens the first user turn, the assistant is "model"
    ("gemma3-softcap", "{bos}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                       "<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"),
])
def test_each_family_s_template_gives_its_prompt(synthetic_model, model_path, name, expected):
    tokenizer = _tokenizer(model_path if name == "default" else synthetic_model(name))
    expected = expected.format(bos=tokenizer.piece(tokenizer.bos_id))
    assert tokenizer.apply_chat_template(CONVERSATION) == expected


def test_family_specific_turns(synthetic_model):
    qwen2 = _tokenizer(synthetic_model("qwen2"))
    assert qwen2.apply_chat_template(CONVERSATION[1:2]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    # Qwen3 drops an earlier answer's reasoning from the history
    qwen3 = _tokenizer(synthetic_model("qwen3-tiny"))
    thought = [*CONVERSATION[:2], {"role": "assistant", "content": "<think>\nThey greet.\n</think>\n\nHello!"},
               CONVERSATION[3]]
    assert qwen3.apply_chat_template(thought) == CHATML
    # Gemma 3's template refuses roles out of order: one clear error, not a traceback
    gemma = _tokenizer(synthetic_model("gemma3-softcap"))
    with pytest.raises(ModelError, match="chat template rejected the messages: Conversation roles must alternate"):
        gemma.apply_chat_template([CONVERSATION[1], CONVERSATION[1]])
