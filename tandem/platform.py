"""What the device computes natively and holds, and the defaults that follow from it: the
model dtype ``dtype="auto"`` resolves to, and the batch limits left unset.

The model dtype (read by ``EngineConfig.torch_dtype``):

- CUDA: bfloat16.
- CPU with native bfloat16 matrix arithmetic (AMX-BF16 or AVX512-BF16, where oneDNN runs
  bf16 GEMMs several times faster than MKL's fp32 ones): bfloat16 for checkpoints that are
  16-bit or quantized (a ``torch_dtype``/``dtype`` of bfloat16 or float16 in the HF config,
  or a GGUF file), as vLLM's CPU backend runs bf16 by default. An fp32 checkpoint, or one
  that declares no dtype (the tiny random models of the tests), stays fp32: exact, and
  what the checkpoint asked for.
- Any other CPU: float32 (bf16 arithmetic would be emulated, slower than fp32).

The batch limits (read by ``EngineConfig.resolve_limits``): on CUDA vLLM's defaults for its
V1 engine: a GPU of >= 70 GiB other than the A100 (H100, H200, B200: memory for a thousand
sequences' KV and the compute to batch them) takes 1024 sequences and 16384 tokens per step,
served as offline (vLLM serves 8192: shorter prefill steps delay the running streams' next
tokens less, but the server then trails the engine; benchmarks/RESULTS.md, session 17); a
smaller GPU 256 sequences and 8192 / 2048 tokens offline / served. The CPU keeps Tandem's 256
sequences and 2048 tokens in both uses (vLLM's CPU backend takes 4096 offline and 128
sequences served; here a 2048-token prefill step already takes seconds on a few cores).
"""

from __future__ import annotations

import functools

import torch

from tandem.config.scheduler import UsageContext

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """The CPU has AMX tiles or AVX512-BF16 (bf16 GEMMs run natively in oneDNN)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def declared_dtype(hf_config) -> torch.dtype | None:
    """The dtype a HF config declares (``dtype``, or the older ``torch_dtype``), or None."""
    fields = vars(hf_config)  # not getattr: transformers warns on reading ``torch_dtype``
    for name in ("dtype", "torch_dtype"):
        value = fields.get(name)
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def auto_dtype(device: torch.device, model: str | None) -> torch.dtype:
    """The model dtype of ``dtype="auto"`` on ``device`` for the checkpoint at ``model``
    (see the module docstring). ``model`` None or unreadable counts as an fp32 checkpoint."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or model is None or not cpu_has_native_bf16():
        return torch.float32
    from tandem.model_loader.loader import is_gguf, load_hf_config

    if is_gguf(model):
        return torch.bfloat16
    try:
        declared = declared_dtype(load_hf_config(model))
    except (ValueError, OSError):
        return torch.float32
    return torch.bfloat16 if declared in _HALF else torch.float32


_LARGE_GPU_BYTES = 70 * 2**30


def default_batch_limits(device: torch.device, usage_context: UsageContext) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` for limits left unset on ``device``, used
    by ``usage_context`` (``"llm_class"`` or ``"openai_api_server"``); see the module
    docstring. Reads the GPU's properties (initialises CUDA in this process)."""
    offline = usage_context == "llm_class"
    if device.type != "cuda":
        return 256, 2048
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= _LARGE_GPU_BYTES and "A100" not in props.name:
        return 1024, 16384
    return 256, 8192 if offline else 2048


__all__ = ["auto_dtype", "cpu_has_native_bf16", "declared_dtype", "default_batch_limits"]
