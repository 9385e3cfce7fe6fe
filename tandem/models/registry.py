"""Model type (HF ``config.model_type``) -> Tandem model class."""

from __future__ import annotations

import importlib

_MODELS = {
    "llama": ("tandem.models.llama", "LlamaForCausalLM"),
    "qwen2": ("tandem.models.llama", "LlamaForCausalLM"),
    "qwen3": ("tandem.models.llama", "LlamaForCausalLM"),
    "qwen3_moe": ("tandem.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("tandem.models.mixtral", "MixtralForCausalLM"),
    "deepseek_v2": ("tandem.models.deepseek_v2", "DeepseekV2ForCausalLM"),
}


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type:
    """Raises ValueError for a model type Tandem does not implement. (Every class builds per
    pipeline stage: :mod:`tandem.distributed.pipeline`.)"""
    mt = getattr(hf_config, "model_type", None)
    if mt not in _MODELS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(supported_model_types())}")
    module, name = _MODELS[mt]
    return getattr(importlib.import_module(module), name)
