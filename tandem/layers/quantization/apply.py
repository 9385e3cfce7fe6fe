"""Apply an :class:`~tandem.layers.quantization.config.Fp8Config` to a built model.

Two passes around weight loading (vLLM's ``create_weights`` /
``process_weights_after_loading``):

* :func:`prepare_fp8_model` (before loading, FP8 checkpoints only): every tensor-parallel
  linear layer and every routed-expert layer gets float8 weights and scale parameters in
  the checkpoint's layout, so the checkpoint's FP8 bytes are copied as they are;
* :func:`finish_fp8_model` (after loading): bf16/fp16/fp32 weights (online quantization,
  dummy weights) are quantized per output channel; static input scales of fused layers
  are reduced to their maximum; scales a checkpoint did not provide raise an error; layers
  that quantize their input per token are marked ``takes_quantized_input`` (unless
  ``TANDEM_FP8_FUSED_QUANT=off``), so that the model quantizes their input in the norm /
  activation kernel that produces it; per-channel GEMMs use fast FP8 accumulation unless
  ``TANDEM_FP8_FAST_ACCUM=off``; row-parallel layers that feed an RMSNorm (one TP rank,
  no bias, dynamic per-token scales) return their decode-sized products unscaled
  (``TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS``, :class:`~tandem.layers.quantization.fp8.UnscaledProduct`).

Left in the model dtype: embeddings, norms, the LM head, routers (``nn.Linear`` /
plain parameters), layers matched by the config's ``ignore``, and MLA's ``kv_b_proj``
(its weight is re-read per head by the absorbed decode: an FP8 checkpoint's is
dequantized).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tandem import envs
from tandem.layers.linear import ColumnShardedLinear, RowParallelLinear
from tandem.layers.moe import FusedMoE
from tandem.layers.quantization.config import Fp8Config
from tandem.layers.quantization.fp8 import (FP8_DTYPE, dequantize_block, fp8_linear_takes_quantized_input,
                                            quantize_weight_per_channel)

_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_HIGH_PRECISION = ("kv_b_proj",)


def _checkpoint_names(module_name: str) -> list[str]:
    prefix, _, last = module_name.rpartition(".")
    parts = _FUSED_PARTS.get(last, (last,))
    return [f"{prefix}.{p}" if prefix else p for p in parts]


def _linear_layers(model: nn.Module, cfg: Fp8Config):
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnShardedLinear, RowParallelLinear)) and not cfg.is_ignored(_checkpoint_names(name)):
            yield name, mod


def prepare_fp8_model(model: nn.Module, cfg: Fp8Config) -> None:
    """Give the quantized layers FP8 weight and scale parameters (FP8 checkpoints only).

    Raises:
        ValueError: a layer's sharding does not fit the checkpoint's scale blocks.
    """
    if not cfg.checkpoint_is_fp8:
        return
    for _, mod in _linear_layers(model, cfg):
        mod.create_fp8_weights(cfg.weight_block, cfg.static_input_scale)
    for mod in model.modules():
        if isinstance(mod, FusedMoE):
            mod.create_fp8_weights(cfg.weight_block)


def rename_checkpoint_scales(weights: Iterable[tuple[str, torch.Tensor]],
                             cfg: Fp8Config) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with block scales named ``*.weight_scale_inv`` (DeepSeek-V3 /
    transformers' fine-grained FP8; multiplied, despite the name) renamed to the layers'
    ``*.weight_scale``."""
    for name, tensor in weights:
        if cfg.weight_scale_name != "weight_scale" and name.endswith("." + cfg.weight_scale_name):
            name = name.removesuffix(cfg.weight_scale_name) + "weight_scale"
        yield name, tensor


# Checkpoint names of per-layer KV cache scales -> which of (k_scale, v_scale) they set:
# vLLM / compressed-tensors (``self_attn.k_scale``), older compressed-tensors
# (``k_proj.output_scale``) and AutoFP8 (one ``kv_scale`` for both).
_KV_SCALE_NAMES = {"self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
                   "self_attn.k_proj.output_scale": ("k_scale",), "self_attn.v_proj.output_scale": ("v_scale",),
                   "self_attn.kv_scale": ("k_scale", "v_scale")}


def load_kv_cache_scales(model: nn.Module,
                         weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Take the per-layer KV cache scales out of a checkpoint's tensors: each sets the
    ``k_scale`` / ``v_scale`` float of its attention module (used with
    ``--kv-cache-dtype fp8``); every other tensor is passed on.

    Raises:
        ValueError: a scale names no attention module with KV scales.
    """
    modules = dict(model.named_modules())
    for name, tensor in weights:
        key = next((k for k in _KV_SCALE_NAMES if name.endswith("." + k)), None)
        if key is None:
            yield name, tensor
            continue
        owner = name.removeprefix("model.").removesuffix(key) + "self_attn"
        attn = modules.get(owner)
        if attn is None or not hasattr(attn, "k_scale"):
            raise ValueError(f"checkpoint tensor {name!r}: no attention layer {owner!r} with KV cache scales")
        for attr in _KV_SCALE_NAMES[key]:
            setattr(attn, attr, float(tensor.float().reshape(-1).max()))


def _set(mod: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is None:
        setattr(mod, name, None)
    else:
        setattr(mod, name, nn.Parameter(value, requires_grad=False))


def _check_scales(name: str, mod: nn.Module) -> None:
    for pname in ("weight_scale", "input_scale"):
        p = getattr(mod, pname, None)
        if p is not None and torch.isnan(p).any():
            raise ValueError(f"checkpoint lacks {pname} for {name} (FP8 weights need their scales)")


def _finish_linear(name: str, mod: nn.Module, dtype: torch.dtype) -> None:
    if mod.weight.dtype != FP8_DTYPE:  # online: quantize what was loaded
        q, scale = quantize_weight_per_channel(mod.weight.data)
        _set(mod, "weight", q)
        _set(mod, "weight_scale", scale)
        return
    _check_scales(name, mod)
    if isinstance(getattr(mod, "input_scale", None), torch.Tensor):
        _set(mod, "input_scale", mod.input_scale.data.max().reshape(1))
    if name.rpartition(".")[2] in _HIGH_PRECISION:
        w = (dequantize_block(mod.weight.data, mod.weight_scale.data, mod.weight_block, dtype) if mod.weight_block
             else (mod.weight.data.float() * mod.weight_scale.data[:, None]).to(dtype))
        _set(mod, "weight", w)
        mod.weight_block = None


def finish_fp8_model(model: nn.Module, cfg: Fp8Config, dtype: torch.dtype) -> None:
    """Quantize loaded high-precision weights and finalize the scales (module docstring).

    Raises:
        ValueError: an FP8 checkpoint lacks a scale tensor.
    """
    fuse = envs.TANDEM_FP8_FUSED_QUANT == "on"
    fast_accum = envs.TANDEM_FP8_FAST_ACCUM == "on"
    for name, mod in _linear_layers(model, cfg):
        if name.rpartition(".")[2] in _HIGH_PRECISION and mod.weight.dtype != FP8_DTYPE:
            continue
        _finish_linear(name, mod, dtype)
        mod.takes_quantized_input = fuse and fp8_linear_takes_quantized_input(
            mod.weight, mod.weight_block, getattr(mod, "input_scale", None))
        mod.fp8_fast_accum = fast_accum
        if isinstance(mod, RowParallelLinear) and mod.can_defer_output_scales:
            mod.defer_output_scales(envs.TANDEM_FP8_DEFERRED_SCALES_MAX_ROWS)
    for name, mod in model.named_modules():
        if isinstance(mod, FusedMoE):
            mod.finish_fp8_weights(name)


__all__ = ["finish_fp8_model", "load_kv_cache_scales", "prepare_fp8_model", "rename_checkpoint_scales"]
