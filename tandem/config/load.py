"""How weights are read (vLLM's ``LoadConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.config.utils import check_choices

LoadFormat = Literal["auto", "dummy", "gguf", "safetensors"]


@dataclass
class LoadConfig:
    """Where the weights come from."""

    load_format: LoadFormat = "auto"
    """auto: a safetensors folder or a GGUF file, by the model path; dummy: random weights of
    the config's shape (only config.json and a tokenizer needed); gguf or safetensors: that
    format only."""

    def __post_init__(self) -> None:
        check_choices(self)
