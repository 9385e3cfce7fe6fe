"""Tiny FP8 checkpoints written in the layouts published on the Hub (no real FP8 weights
can be downloaded here), from a random transformers model.

Formats (``FORMATS``), with the tensor names, dtypes and ``quantization_config`` of:

* ``ct-channel-dynamic``: RedHatAI ``*-FP8-dynamic`` (compressed-tensors float-quantized,
  ``weight_scale`` bf16 ``[N, 1]``, dynamic per-token activations);
* ``ct-tensor-static``: RedHatAI / neuralmagic ``*-FP8`` (per-tensor ``weight_scale`` and
  ``input_scale`` fp32 ``[1]``, static activations calibrated on random tokens);
* ``ct-block``: compressed-tensors ``FP8_BLOCK`` (``weight_scale`` ``[N/128, K/128]``);
* ``fp8-block``: ``quant_method: fp8`` with ``weight_block_size [128, 128]`` and
  ``weight_scale_inv`` fp32 (DeepSeek-V3, Qwen3 ``*-FP8``);
* ``fp8-tensor-static``: ``quant_method: fp8``, ``activation_scheme: static`` (AutoFP8:
  scalar ``weight_scale`` / ``input_scale``).

Every decoder linear layer and expert is quantized (routers ``mlp.gate`` and ``lm_head``
are not, as published). :func:`write_fp8_checkpoint` returns the dequantized state dict:
the weights the FP8 model must hold exactly.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from tandem.layers.quantization.fp8 import (FP8_DTYPE, FP8_MAX, expand_block_scale, quantize_per_token,
                                            quantize_per_token_group, quantize_static)

FORMATS = ("ct-channel-dynamic", "ct-tensor-static", "ct-block", "fp8-block", "fp8-tensor-static")
BLOCK = (128, 128)
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def _ct_config(weights: dict, inputs: dict) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "global_compression_ratio": None, "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                                  "dynamic": False, "actorder": None, "observer": "minmax",
                                                  "observer_kwargs": {}, **weights},
                                      "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                            "group_size": None, "block_structure": None,
                                                            "actorder": None, "observer": None, "observer_kwargs": {},
                                                            **inputs}}},
    }


QUANTIZATION_CONFIGS = {
    "ct-channel-dynamic": _ct_config({"strategy": "channel", "block_structure": None},
                                     {"strategy": "token", "dynamic": True}),
    "ct-tensor-static": _ct_config({"strategy": "tensor", "block_structure": None},
                                   {"strategy": "tensor", "dynamic": False, "observer": "minmax"}),
    "ct-block": _ct_config({"strategy": "block", "block_structure": list(BLOCK)},
                           {"strategy": "group", "group_size": BLOCK[1], "dynamic": True}),
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": list(BLOCK)},
    "fp8-tensor-static": {"quant_method": "fp8", "activation_scheme": "static"},
}


def _quantize(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors by suffix, dequantized fp32 weight) of one ``[N, K]`` weight."""
    w = w.float()
    if fmt in ("ct-block", "fp8-block"):
        n, k = w.shape
        bn, bk = BLOCK
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        scale = scale.to(torch.bfloat16) if fmt == "ct-block" else scale
        full = expand_block_scale(scale.float(), (n, k), BLOCK)
        name = "weight_scale" if fmt == "ct-block" else "weight_scale_inv"
    elif fmt == "ct-channel-dynamic":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
        full, name = scale.float(), "weight_scale"
    else:
        scale = (w.abs().amax() / FP8_MAX).reshape(1 if fmt.startswith("ct-") else ())
        full, name = scale.float(), "weight_scale"
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return {"weight": q, name: scale}, q.float() * full


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as the per-expert tensors of Hub checkpoints."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _input_amax(ref, vocab_size: int) -> dict[str, float]:
    """Largest input magnitude of every linear layer (and expert) on random tokens."""
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(mod.register_forward_pre_hook(hook))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref(torch.randint(0, vocab_size, (2, 24), generator=g))
    for h in hooks:
        h.remove()
    return amax


def write_fp8_checkpoint(ref, folder: str, fmt: str, keep: str | None = None) -> dict[str, torch.Tensor]:
    """Write ``ref`` (a transformers model) as an FP8 checkpoint of format ``fmt``; linear
    layers matching the regex ``keep`` stay in full precision and are listed in the
    config's ignore list (``ignore`` / ``modules_to_not_convert``).

    Returns the dequantized state dict (per-expert names; fp32), with the static
    ``input_scale`` tensors.
    """
    state = _per_expert({k: v.detach() for k, v in ref.state_dict().items()})
    static = fmt.endswith("static")
    amax = _input_amax(ref, ref.config.vocab_size) if static else {}
    tensors, deq = {}, {}
    for name, t in state.items():
        if not _LINEAR.search(name) or (keep and re.match(keep, name)):
            tensors[name] = t.float()
            deq[name] = t.float()
            continue
        parts, deq[name] = _quantize(t, fmt)
        base = name.removesuffix("weight")
        for suffix, v in parts.items():
            tensors[base + suffix] = v
        if static:
            module = base.removesuffix(".")
            # Experts are not nn.Linear modules in transformers 5 (Tandem ignores their input_scale).
            a = amax.get(module, max(amax.values()))
            shape = (1,) if fmt.startswith("ct-") else ()
            tensors[base + "input_scale"] = deq[base + "input_scale"] = torch.full(shape, a / FP8_MAX)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    cfg = ref.config.to_dict()
    qc = json.loads(json.dumps(QUANTIZATION_CONFIGS[fmt]))
    if keep:
        qc.setdefault("ignore" if fmt.startswith("ct-") else "modules_to_not_convert", []).append("re:" + keep + ".*")
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


def fake_quantize_activations(ref, fmt: str, deq: dict[str, torch.Tensor]) -> list:
    """Forward pre-hooks on ``ref``'s quantized ``nn.Linear`` layers that round their
    inputs as the FP8 GEMM does (per token, per 1x128 group, or the static
    ``input_scale``), so that ``ref`` with dequantized weights is the exact W8A8 reference
    of the format. Experts (W8A16 in Tandem) and unquantized layers are left alone.
    Returns the hook handles."""
    handles = []
    for name, mod in ref.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not _LINEAR.search(name + ".weight"):
            continue
        if fmt.endswith("static"):
            scale = deq[name + ".input_scale"].reshape(())
            fq = lambda x, s=scale: quantize_static(x, s).float() * s  # noqa: E731
        elif fmt.endswith("block"):
            def fq(x):
                q, s = quantize_per_token_group(x.reshape(-1, x.shape[-1]), BLOCK[1])
                return (q.float() * s.repeat_interleave(BLOCK[1], 1)).reshape(x.shape)
        else:
            def fq(x):
                q, s = quantize_per_token(x.reshape(-1, x.shape[-1]))
                return (q.float() * s).reshape(x.shape)
        handles.append(mod.register_forward_pre_hook(lambda m, args, fq=fq: (fq(args[0]),)))
    return handles
