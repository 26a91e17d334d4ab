"""What a loader reads from disk (GGUF or HF directory), before the weights become a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tokenizers

from worker.model.config import ModelConfig
from worker.model.weights import WeightMap

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    weights: WeightMap  # HF tensor names, HF layout
    tokenizer: tokenizers.Tokenizer
    chat_template: str  # CHATML_TEMPLATE when the model ships none
    bos_token: str | None
    eos_token_ids: list[int]
    # Drop the file's pages from this process's resident set (read again on access); a no-op where nothing is mapped.
    release_file_pages: Callable[[], None] = lambda: None
