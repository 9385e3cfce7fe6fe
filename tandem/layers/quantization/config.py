"""Which FP8 scheme a model runs: from ``--quantization`` and the checkpoint's
``quantization_config`` (config.json).

Formats read (tensor names as published):

* ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (or
  ``naive-quantized``), as RedHatAI / neuralmagic ``*-FP8-dynamic`` and ``*-FP8``
  checkpoints: ``weight`` float8_e4m3fn, ``weight_scale`` per channel ``[N, 1]`` or per
  tensor ``[1]``, or block ``[N/128, K/128]`` (``FP8_BLOCK``); ``input_scale`` ``[1]`` when
  the activations are static; a static FP8 ``kv_cache_scheme`` comes with per-layer
  ``self_attn.k_scale`` / ``v_scale`` (loaded by
  :func:`tandem.layers.quantization.apply.load_kv_cache_scales`, used with
  ``--kv-cache-dtype fp8``). Parsed with the ``compressed-tensors`` library.
* ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``, DeepSeek-V3 and Qwen3
  ``*-FP8``): ``weight_block_size: [128, 128]`` with ``weight_scale_inv [N/128, K/128]``
  and dynamic activations; without ``weight_block_size`` (AutoFP8 / vLLM ``fp8``
  serialisation) per-tensor ``weight_scale`` and, for ``activation_scheme: static``,
  ``input_scale``.
* ``--quantization fp8`` on a bf16/fp16/fp32 (or dummy) checkpoint: online quantization at
  load time, per-output-channel weight scales, dynamic per-token activation scales.
* ``--quantization gguf`` (the default for a GGUF file on the CPU): the GGUF's 4-bit
  blocks run as they are (:mod:`tandem.layers.quantization.gguf`); ``--quantization none``
  dequantizes every weight to ``--dtype`` at load, as on CUDA.

Anything else is a ValueError that names the unsupported field and value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

QuantizationMethods = Literal["fp8", "compressed-tensors", "gguf", "none"]
QUANTIZATION_METHODS = get_args(QuantizationMethods)
_FP8_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class GGUFQuantConfig:
    """A GGUF file's Q4_0 / Q4_1 / Q4_K linear weights run quantized (CPU int4 GEMM);
    ``path`` the file."""

    path: str
    method: str = "gguf"


def get_gguf_config(model: str | None, quantization: str | None, device_type: str, load_format: str = "auto",
                    dtype: str = "auto", deterministic: bool = False, one_rank: bool = True) -> GGUFQuantConfig | None:
    """The GGUF scheme of a run, or None (any other scheme, or ``quantization="none"``).

    ``quantization`` None takes ``"gguf"`` for a GGUF file on the CPU (real weights) at
    ``dtype="auto"``, not in deterministic mode; an explicit ``dtype`` keeps the dequantized
    path in that dtype (as before GGUF ran quantized: exact fp32 comparisons stay exact),
    and so does ``deterministic`` (its batch-invariant GEMMs; the int4 layers switch
    kernels with the row count), and a model split over ranks (not ``one_rank``:
    ``ParallelConfig.model_on_one_rank``; the int4 layers are not sharded).

    Raises:
        ValueError: ``quantization="gguf"`` for a model that is not a GGUF file, dummy
            weights, a device other than the CPU, with ``deterministic``, or split over ranks.
    """
    is_gguf = model is not None and model.endswith(".gguf") and load_format != "dummy"
    if quantization is None:
        default = is_gguf and device_type == "cpu" and dtype == "auto" and not deterministic and one_rank
        return GGUFQuantConfig(model) if default else None
    if quantization != "gguf":
        return None
    if deterministic:
        raise ValueError("quantization='gguf' is not batch-invariant (int4 kernel at decode sizes, bf16 GEMM "
                         "above): use quantization='none' with deterministic=True")
    if not is_gguf:
        raise ValueError(f"quantization='gguf' runs a GGUF file's weights; model {model!r} with "
                         f"load_format={load_format!r} is not one")
    if device_type != "cpu":
        raise ValueError(f"quantization='gguf' runs on the CPU (device {device_type!r}); use quantization='none' "
                         f"to dequantize the GGUF's weights")
    if not one_rank:
        raise ValueError("quantization='gguf' runs on one rank; use quantization='none' with tensor/pipeline/"
                         "expert parallelism")
    return GGUFQuantConfig(model)


@dataclass(frozen=True)
class Fp8Config:
    """An FP8 W8A8 scheme for the linear and expert layers of a model.

    Attributes:
        checkpoint_is_fp8: the checkpoint holds float8 weights (else bf16/fp16/fp32
            weights are quantized after loading).
        weight_block: ``(bn, bk)`` block-wise weight scales, None for per-channel (a
            per-tensor checkpoint scale is expanded to per-channel, exactly).
        weight_scale_name: checkpoint suffix of the weight scales (``weight_scale`` or
            ``weight_scale_inv``; both multiply: ``w = q * scale``).
        static_input_scale: activations use the checkpoint's per-tensor ``input_scale``
            (else dynamic per-token, or per 1 x ``bk`` group with block weights).
        ignore: layer names or ``re:`` patterns kept in high precision (checkpoint names).
        method: the checkpoint's (or the user's) quantization method.
    """

    checkpoint_is_fp8: bool = False
    weight_block: tuple[int, int] | None = None
    weight_scale_name: str = "weight_scale"
    static_input_scale: bool = False
    ignore: tuple[str, ...] = ()
    method: str = "fp8"

    def is_ignored(self, layer_names: list[str]) -> bool:
        """Whether a layer is left unquantized: its checkpoint names (``model.`` prefixed
        or not; several for a fused layer) match ``ignore``.

        Raises:
            ValueError: the names of one fused layer disagree (some ignored, some not).
        """
        hits = [any(_matches(n, pat) or _matches("model." + n, pat) for pat in self.ignore) for n in layer_names]
        if any(hits) and not all(hits):
            raise ValueError(f"quantization_config.ignore covers only part of the fused layer {layer_names}")
        return bool(hits) and all(hits)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def get_quantization_config(hf_config, quantization: str | None, load_format: str = "auto",
                            deterministic: bool = False) -> Fp8Config | None:
    """The FP8 scheme of a model, or None for an unquantized run.

    Args:
        hf_config: the model's HF config (its ``quantization_config``, if any).
        quantization: ``--quantization`` (None, ``"fp8"`` or ``"compressed-tensors"``;
            ``"gguf"`` and ``"none"`` are not FP8: None, see :func:`get_gguf_config`).
        load_format: with ``"dummy"`` the checkpoint format is moot: random weights are
            quantized online.
        deterministic: batch-invariant execution is asked for; the FP8 GEMMs
            (``torch._scaled_mm``: cuBLASLt picks its kernel by the row count) are not, so an
            FP8 scheme is refused.

    Raises:
        ValueError: unknown ``quantization``, a checkpoint method other than the one asked
            for, an unsupported scheme (the message names the field), or an FP8 scheme with
            ``deterministic``.
    """
    scheme = _fp8_scheme(hf_config, quantization, load_format)
    if scheme is not None and deterministic:
        raise ValueError(f"deterministic=True is not supported with FP8 weights (quantization={scheme.method!r}): "
                         f"the FP8 GEMMs are not batch-invariant; run the model in bf16/fp16/fp32")
    return scheme


def _fp8_scheme(hf_config, quantization: str | None, load_format: str) -> Fp8Config | None:
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {quantization!r}")
    if quantization == "gguf":
        return None
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if quantization == "none":
        if qc and load_format != "dummy":
            raise ValueError(f"quantization='none': the checkpoint is quantized (quant_method="
                             f"{qc.get('quant_method')!r}); leave quantization unset to run it")
        return None
    if not qc or load_format == "dummy":
        if quantization == "compressed-tensors":
            raise ValueError("quantization='compressed-tensors' needs a checkpoint with a compressed-tensors "
                             "quantization_config; use quantization='fp8' to quantize a bf16/fp16 model at load time")
        return Fp8Config() if quantization else None
    method = qc.get("quant_method")
    if quantization is not None and method not in _FP8_METHODS:
        raise ValueError(f"quantization={quantization!r} was asked for, but the checkpoint is quantized with "
                         f"quant_method={method!r}")
    if method == "fp8":
        return _from_fp8(qc)
    if method == "compressed-tensors":
        return _from_compressed_tensors(qc)
    raise ValueError(f"unsupported quantization_config.quant_method {method!r}: Tandem loads "
                     f"{_FP8_METHODS} checkpoints")


def _from_fp8(qc: dict) -> Fp8Config:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported quantization_config.fmt {fmt!r} (FP8 checkpoints must be e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"unsupported quantization_config.activation_scheme {scheme!r} (dynamic, static)")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError("block-wise FP8 (weight_block_size) needs activation_scheme 'dynamic'")
        if len(block) != 2:
            raise ValueError(f"unsupported quantization_config.weight_block_size {block!r} (two ints)")
        return Fp8Config(True, (int(block[0]), int(block[1])), "weight_scale_inv", False, ignore, "fp8")
    return Fp8Config(True, None, "weight_scale", scheme == "static", ignore, "fp8")


def _value(field) -> str:
    return str(getattr(field, "value", field))  # compressed-tensors enums may be stored as plain strings


def _from_compressed_tensors(qc: dict) -> Fp8Config:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType

    cfg = QuantizationConfig.model_validate(qc)
    if cfg.format not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"unsupported compressed-tensors format {cfg.format!r}: Tandem loads FP8 "
                         f"'float-quantized' checkpoints")
    schemes = list(cfg.config_groups.values())
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors config_groups: one FP8 scheme is supported, got {len(schemes)}")
    scheme = schemes[0]
    if list(scheme.targets) != ["Linear"]:
        raise ValueError(f"unsupported compressed-tensors targets {scheme.targets!r} (['Linear'])")
    w, a = scheme.weights, scheme.input_activations
    if w is None or w.type != QuantizationType.FLOAT or w.num_bits != 8:
        raise ValueError(f"unsupported compressed-tensors weights {w!r}: Tandem runs FP8 (float, 8 bits) weights")
    if a is None:
        raise ValueError("unsupported compressed-tensors scheme: weight-only FP8 (W8A16, no input_activations); "
                         "Tandem runs W8A8 FP8")
    if a.type != QuantizationType.FLOAT or a.num_bits != 8:
        raise ValueError(f"unsupported compressed-tensors input_activations {a!r} (float, 8 bits)")
    if not w.symmetric or not a.symmetric:
        raise ValueError("unsupported compressed-tensors scheme: asymmetric FP8")
    if w.strategy == QuantizationStrategy.BLOCK:
        block = tuple(int(b) for b in (w.block_structure or ()))
        if len(block) != 2 or not a.dynamic:
            raise ValueError(f"compressed-tensors block FP8 needs a 2-d block_structure and dynamic activations, "
                             f"got {w.block_structure!r}, dynamic={a.dynamic}")
        weight_block = block
    elif w.strategy in (QuantizationStrategy.CHANNEL, QuantizationStrategy.TENSOR):
        weight_block = None
    else:
        raise ValueError(f"unsupported compressed-tensors weight strategy {_value(w.strategy)!r} "
                         f"(channel, tensor, block)")
    if a.dynamic is True and a.strategy not in (QuantizationStrategy.TOKEN, QuantizationStrategy.TENSOR,
                                                QuantizationStrategy.GROUP):
        raise ValueError(f"unsupported compressed-tensors activation strategy {_value(a.strategy)!r}")
    if a.dynamic is not True and a.strategy != QuantizationStrategy.TENSOR:
        raise ValueError(f"unsupported compressed-tensors static activation strategy {_value(a.strategy)!r} (tensor)")
    kv = cfg.kv_cache_scheme
    if kv is not None and (kv.type != QuantizationType.FLOAT or kv.num_bits != 8 or kv.dynamic is True
                           or kv.strategy != QuantizationStrategy.TENSOR):
        raise ValueError(f"unsupported compressed-tensors kv_cache_scheme {kv!r}: Tandem reads static per-tensor "
                         f"FP8 KV cache scales (used with --kv-cache-dtype fp8)")
    return Fp8Config(True, weight_block, "weight_scale", a.dynamic is not True, tuple(cfg.ignore or ()),
                     "compressed-tensors")


__all__ = ["Fp8Config", "GGUFQuantConfig", "QUANTIZATION_METHODS", "get_gguf_config", "get_quantization_config"]
