"""The model's own generation defaults: ``generation_config.json`` of a Hugging Face folder.

As vLLM (``--generation-config auto``, its default): the EOS ids listed there stop a
request like the tokenizer's EOS token (transformers' ``generate`` does the same), and its
sampling values are the defaults of requests that leave those fields unset.
``--generation-config vllm`` keeps the EOS ids but ignores the sampling values; a folder
path reads ``generation_config.json`` from that folder instead of the model's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model folder says about generation.

    Attributes:
        eos_token_ids: ids that end a completion (``eos_token_id``, an int or a list).
        sampling: SamplingParams field -> value, for requests that leave the field unset.
        source: the file read (None: none was found).
    """

    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None


def _config_folder(model: str) -> str | None:
    if os.path.isdir(model):
        return model
    if os.path.isfile(model) and model.endswith(".json"):  # a bare config.json (dummy weights)
        return os.path.dirname(os.path.abspath(model))
    return None  # a GGUF file: its metadata holds no generation config


def _token_ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"generation_config.json: eos_token_id must be a token id or a list of them, got {value!r}.")
    return frozenset(values)


def load_generation_defaults(model: str, generation_config: str = "auto") -> GenerationDefaults:
    """Read ``generation_config.json`` for ``model``.

    Args:
        model: the engine's ``model`` (folder, config.json or GGUF file).
        generation_config: "auto" (the model's folder), "vllm" (EOS ids only: no sampling
            defaults), or a folder holding a ``generation_config.json``.

    Raises:
        ValueError: the file is not valid JSON, its ``eos_token_id`` is not token ids or
            a sampling value is out of range (the message names the field);
            ``generation_config`` names a folder without the file.
    """
    if generation_config in ("auto", "vllm"):
        folder = _config_folder(model)
    else:
        folder = generation_config
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            raise ValueError(f"generation_config: no generation_config.json in {folder!r} "
                             f"(use 'auto', 'vllm' or a folder that holds one).")
    path = os.path.join(folder, "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return GenerationDefaults()
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not valid JSON ({e}).") from None
    sampling = {} if generation_config == "vllm" else {
        name: raw[key] for key, name in SAMPLING_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return GenerationDefaults(_token_ids(raw.get("eos_token_id")), sampling, path)
