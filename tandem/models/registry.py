"""Model type (HF ``config.model_type``) -> Tandem model class."""

from __future__ import annotations

import importlib

from tandem.distributed import parallel_state as ps

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
    """Raises ValueError for a model type Tandem does not implement, or one that cannot be
    split into pipeline stages when this rank is one (its class lacks ``supports_pp``)."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in _MODELS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(supported_model_types())}")
    cls = _class(mt)
    if ps.get_pp_size() > 1 and not getattr(cls, "supports_pp", False):
        staged = [t for t in supported_model_types() if getattr(_class(t), "supports_pp", False)]
        raise ValueError(f"pipeline_parallel_size > 1 does not support model_type {mt!r} yet; it does: "
                         f"{', '.join(staged)}")
    return cls


def _class(model_type: str) -> type:
    module, name = _MODELS[model_type]
    return getattr(importlib.import_module(module), name)
