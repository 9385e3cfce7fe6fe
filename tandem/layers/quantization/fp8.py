"""FP8 (e4m3) quantization math and the FP8 GEMMs of the linear layers.

Formats follow vLLM's FP8 W8A8 path (``vllm/model_executor/layers/quantization/fp8.py``
and ``utils/w8a8_utils.py``):

* weights: ``float8_e4m3fn [N, K]`` with a per-output-channel scale ``weight_scale [N]``
  fp32 (a per-tensor checkpoint scale is expanded to its rows, which is exact), or a
  block-wise scale ``[ceil(N/bn), ceil(K/bk)]`` (DeepSeek-V3 / transformers'
  fine-grained FP8, 128x128 blocks): ``w ~= q * scale``;
* activations: dynamic per-token scales (``amax(|x_row|) / 448``) or one static
  per-tensor scale from the checkpoint; block-wise weights pair with dynamic
  per-token-group (1 x ``bk``) activation scales, as DeepSeek-V3.

``fp8_linear`` runs ``torch._scaled_mm`` (cuBLASLt FP8 with row-wise scales) on CUDA
devices of compute capability >= 8.9, and the same call on the CPU where torch's CPU
``_scaled_mm`` takes row-wise scales (torch 2.13; older builds get the same math in fp32):
slow, for tests and reference. Block-wise
weights go through ``torch.nn.functional.scaled_mm`` with the BlockWise1x128 /
BlockWise128x128 recipes on Hopper (sm90) and through :func:`block_fp8_matmul_reference`
(dequantize, fp32 matmul: the same math) on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tandem.layers.quantization.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE

# torch._scaled_mm needs both GEMM dims of the weight to be multiples of 16 on CUDA.
_CUDA_ALIGN = 16


def fp8_supported(device: torch.device) -> bool:
    """Whether FP8 GEMMs run on ``device``: CUDA compute capability >= 8.9 (Ada, Hopper,
    Blackwell) or the CPU (reference speed)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_supported(device: torch.device, what: str = "FP8 quantization") -> None:
    """Raises ValueError naming the requirement when ``device`` cannot run FP8 GEMMs."""
    if fp8_supported(device):
        return
    if device.type == "cuda":
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{what} needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer) for "
                         f"FP8 tensor cores; {name} has {cap}")
    raise ValueError(f"{what} runs on CUDA GPUs of compute capability >= 8.9 or on the CPU, not on {device.type}")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) FP8 quantization.

    Args:
        x: ``[M, K]`` float.

    Returns:
        ``(q [M, K] float8_e4m3fn, scale [M, 1] fp32)`` with ``x ~= q * scale`` and
        ``scale = max(amax(|x_row|) / 448, MIN_SCALE)``.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor, not the float: torch's CUDA division by a Python scalar multiplies
    # by its reciprocal (not correctly rounded, measured on the H200: 1 in 3 fp32 results
    # differ), so scales would depend on the device and differ from the kernels' div_rn.
    scale = (amax / torch.full((), FP8_MAX, device=amax.device)).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@dataclass(slots=True)  # not frozen: one is built per layer and forward, and frozen init costs 6x
class QuantizedActivation:
    """An activation quantized to FP8 with dynamic per-token scales by the kernel that
    produced it (:func:`~tandem.layers.fused_ops.rms_norm_dynamic_per_token_quant`,
    :func:`~tandem.layers.fused_ops.silu_and_mul_dynamic_per_token_quant`), handed to
    :func:`fp8_linear` in place of the high-precision tensor it would quantize itself.

    Attributes:
        q: ``[M, K]`` float8_e4m3fn.
        scale: ``[M, 1]`` fp32, ``x ~= q * scale`` as :func:`quantize_per_token`.
        dtype: the dtype of the activation before quantization (the linear's output dtype).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


@dataclass(slots=True)
class UnscaledProduct:
    """An FP8 GEMM's product before its per-token x per-channel scales: the GEMM ran with
    unit scales (cuBLASLt's per-tensor kernel, faster than its row-wise one at decode
    sizes) and the scaling epilogue moves into the RMSNorm kernel that consumes the product
    (:mod:`tandem.layers.fused_ops`), so that it costs no pass of its own.

    Attributes:
        acc: ``[M, N]`` fp32, the sum of the FP8 products.
        row_scale: ``[M, 1]`` fp32, the activation's per-token scales.
        col_scale: ``[N]`` fp32, the weight's per-channel scales.
        dtype: the dtype the scaled product is rounded to (the layer's output dtype).
    """

    acc: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    dtype: torch.dtype

    def apply_scales(self) -> torch.Tensor:
        """``(acc * row_scale * col_scale).to(dtype)`` ``[M, N]``: what :func:`fp8_linear`
        returns for the same operands up to one ulp of bf16 (the order of the fp32 scalings;
        on CUDA ``fp8_linear`` also rounds through bf16 on the way to fp16 / fp32)."""
        return (self.acc * self.row_scale * self.col_scale).to(self.dtype)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 of ``x / scale`` (static per-tensor ``scale``, 0-d or ``[1]`` fp32), saturated."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 of a weight ``[..., N, K]`` (the last dim is reduced).

    Returns ``(q [..., N, K] float8_e4m3fn, scale [..., N] fp32)``.
    """
    q, scale = quantize_per_token(w)
    return q, scale.squeeze(-1)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization in groups of ``group`` columns per row (DeepSeek-V3's 1x128
    activation tiles).

    Args:
        x: ``[M, K]`` float, ``K`` a multiple of ``group``.

    Returns:
        ``(q [M, K] float8_e4m3fn, scale [M, K // group] fp32)``.

    Raises:
        ValueError: ``K`` is not a multiple of ``group``.
    """
    m, k = x.shape
    if k % group:
        raise ValueError(f"per-token-group FP8 needs K ({k}) to be a multiple of the group ({group})")
    q, scale = quantize_per_token(x.reshape(m, k // group, group))
    return q.reshape(m, k), scale.squeeze(-1)


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales ``[ceil(N/bn), ceil(K/bk)]`` repeated to one per element ``[N, K]``."""
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K]`` FP8 times its block scales ``[ceil(N/bn), ceil(K/bk)]``, in ``dtype``."""
    return (q.float() * expand_block_scale(scale.float(), tuple(q.shape), block)).to(dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """FP8 weights ``q [..., N, K]`` times their scales, in ``dtype``: per-channel ``scale
    [..., N]``, or block-wise ``scale [..., ceil(N/bn), ceil(K/bk)]`` with ``block``."""
    if block is None:
        return (q.float() * scale.float()[..., None]).to(dtype)
    if q.dim() == 2:
        return dequantize_block(q, scale, block, dtype)
    return torch.stack([dequantize_block(qe, se, block, dtype) for qe, se in zip(q, scale)])


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 of ``x [M, K]``: one Triton kernel on CUDA, torch ops elsewhere."""
    if x.is_cuda and x.stride(-1) == 1 and x.shape[-1] <= 65536:
        from tandem.layers.quantization.fp8_triton import quantize_per_token_triton  # lazy: Triton is optional

        return quantize_per_token_triton(x)
    return quantize_per_token(x)


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch build's CPU ``_scaled_mm`` takes row-wise scales (2.13 does; 2.11's
    oneDNN kernel takes per-tensor scales only)."""
    a = torch.ones(2, 16).to(FP8_DTYPE)
    b = torch.ones(16, 16).to(FP8_DTYPE).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _rowwise_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    if not xq.is_cuda and not _cpu_rowwise_scaled_mm():
        # The same math in fp32: products of FP8 values are exact, the sum accumulates in fp32.
        return ((xq.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()).to(out_dtype)
    # cuBLASLt row-wise scaling writes bf16 only; the CPU kernel writes any float dtype.
    mm_dtype = torch.bfloat16 if xq.is_cuda else out_dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=mm_dtype,
                         use_fast_accum=fast_accum)
    return y.to(out_dtype)


def fp8_linear_takes_quantized_input(weight: torch.Tensor, block: tuple[int, int] | None,
                                     input_scale: torch.Tensor | None) -> bool:
    """Whether :func:`fp8_linear` of these weights quantizes its input per token (FP8
    per-channel ``weight`` with dynamic activation scales, ``N`` and ``K`` multiples of 16),
    so that a :class:`QuantizedActivation` can be passed instead."""
    n, k = weight.shape
    return (weight.dtype == FP8_DTYPE and block is None and input_scale is None
            and n % _CUDA_ALIGN == 0 and k % _CUDA_ALIGN == 0)


def fp8_linear(x: torch.Tensor | QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               fast_accum: bool = False) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` with FP8 activations and weights (W8A8).

    Args:
        x: ``[..., K]`` fp32/fp16/bf16 activations, or a :class:`QuantizedActivation` of
            ``[M, K]`` (dynamic per-token scales: ``input_scale`` must be None).
        weight: ``[N, K]`` float8_e4m3fn (row-major, as ``nn.Linear``).
        weight_scale: ``[N]`` fp32 per-output-channel scales.
        input_scale: static per-tensor activation scale (0-d/``[1]`` fp32), or None for
            dynamic per-token scales.
        bias: ``[N]`` in ``x.dtype`` or None.
        fast_accum: ``torch._scaled_mm``'s ``use_fast_accum``: on Hopper the FP8 MMA's own
            accumulator is used throughout, without the periodic promotion to fp32 (as
            vLLM's sm90 CUTLASS FP8 kernels, ``...FP8FastAccum``); a no-op on the CPU.

    Returns:
        ``[..., N]`` in ``x.dtype``. ``torch._scaled_mm`` accumulates in fp32. On CUDA a
        weight whose ``N`` or ``K`` is not a multiple of 16 (cuBLASLt's FP8 alignment) is
        dequantized for an ordinary matmul instead.

    Raises:
        ValueError: a :class:`QuantizedActivation` with a static ``input_scale``, or for a
            weight :func:`fp8_linear_takes_quantized_input` rejects.
    """
    if isinstance(x, QuantizedActivation):
        if not fp8_linear_takes_quantized_input(weight, None, input_scale):
            raise ValueError(f"fp8_linear: a pre-quantized activation needs dynamic input scales and N, K multiples "
                             f"of {_CUDA_ALIGN} (weight {tuple(weight.shape)}, static scale: {input_scale is not None})")
        if x.q.shape[0] == 0:
            y = torch.empty(0, weight.shape[0], dtype=x.dtype, device=x.q.device)
        else:
            y = _rowwise_mm(x.q, x.scale, weight, weight_scale, x.dtype, fast_accum)
        return y if bias is None else y + bias
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, k = weight.shape
    if x.is_cuda and (n % _CUDA_ALIGN or k % _CUDA_ALIGN):
        y = torch.nn.functional.linear(x2, (weight.to(x.dtype) * weight_scale[:, None].to(x.dtype)))
    elif x2.shape[0] == 0:
        y = x2.new_empty(0, n)
    else:
        if input_scale is None:
            xq, x_scale = _quantize_activations(x2)
        else:
            xq = quantize_static(x2, input_scale)
            x_scale = input_scale.float().reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        y = _rowwise_mm(xq, x_scale, weight, weight_scale, x.dtype, fast_accum)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_linear_unscaled(x: torch.Tensor | QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                        fast_accum: bool = False) -> UnscaledProduct:
    """:func:`fp8_linear` without bias and with dynamic per-token scales, its scales left
    to the consumer (:class:`UnscaledProduct`).

    Args:
        x: ``[M, K]`` float activations (quantized here per token) or a
            :class:`QuantizedActivation`; ``M >= 1``.
        weight: ``[N, K]`` float8_e4m3fn, ``N`` and ``K`` multiples of 16.
        weight_scale: ``[N]`` fp32 per-output-channel scales.
        fast_accum: as :func:`fp8_linear`.

    Returns:
        An :class:`UnscaledProduct`: ``acc [M, N]`` fp32, ``row_scale [M, 1]`` fp32 (the
        activation's per-token scales), ``col_scale [N]`` fp32 (``weight_scale``), and
        ``dtype`` the activation's dtype.

    Raises:
        ValueError: a weight :func:`fp8_linear_takes_quantized_input` rejects, or no rows.
    """
    if not fp8_linear_takes_quantized_input(weight, None, None):
        raise ValueError(f"fp8_linear_unscaled: weight {tuple(weight.shape)} {weight.dtype} is not an FP8 per-channel "
                         f"weight with N, K multiples of {_CUDA_ALIGN}")
    if not isinstance(x, QuantizedActivation):
        x = QuantizedActivation(*_quantize_activations(x), x.dtype)
    if x.q.shape[0] == 0:
        raise ValueError("fp8_linear_unscaled: no rows (use fp8_linear)")
    one = _unit_scale(x.q.device)
    acc = torch._scaled_mm(x.q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                           use_fast_accum=fast_accum)
    return UnscaledProduct(acc, x.scale, weight_scale, x.dtype)


def block_fp8_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                               weight_scale: torch.Tensor, block: tuple[int, int],
                               out_dtype: torch.dtype) -> torch.Tensor:
    """The block-wise W8A8 product by dequantization: ``(xq * x_scale) @ (weight * ws).T``
    in fp32. ``xq [M, K]`` FP8 with ``x_scale [M, K/bk]``; ``weight [N, K]`` FP8 with
    ``weight_scale [ceil(N/bn), ceil(K/bk)]``. Returns ``[M, N]`` in ``out_dtype``."""
    xd = xq.float() * x_scale.repeat_interleave(block[1], 1)[:, : xq.shape[1]]
    return (xd @ dequantize_block(weight, weight_scale, block).t()).to(out_dtype)


def _block_mm_cuda(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    # Layouts as torch's test_scaled_mm_block_wise_numerics: rows padded to a multiple of 4,
    # the 1x128 activation scales outer-dim major ([M, K/128], stride (1, M)), the 128x128
    # weight scales with K/128 padded to a multiple of 4 and given as [K/128, N/128].
    m = xq.shape[0]
    if m % 4:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, -m % 4)).view(xq.dtype)
        x_scale = torch.nn.functional.pad(x_scale, (0, 0, 0, -m % 4), value=1.0)
    kb = weight_scale.shape[1]
    ws = torch.nn.functional.pad(weight_scale, (0, -kb % 4), value=1.0) if kb % 4 else weight_scale
    y = scaled_mm(xq, weight.t(), x_scale.t().contiguous().t(), ScalingType.BlockWise1x128, ws.t(),
                  ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    return y[:m].to(out_dtype)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` with block-wise FP8 weights and dynamic 1 x ``bk``
    activation scales (DeepSeek-V3's recipe).

    Args:
        x: ``[..., K]`` float, ``K`` a multiple of ``block[1]``.
        weight: ``[N, K]`` float8_e4m3fn.
        weight_scale: ``[ceil(N/bn), ceil(K/bk)]`` fp32.
        block: ``(bn, bk)``.

    Returns:
        ``[..., N]`` in ``x.dtype``: cuBLASLt block-scaled FP8 GEMM on Hopper (sm90, the
        only target of torch's BlockWise recipes) with 128x128 blocks and ``N`` a multiple
        of 128; :func:`block_fp8_matmul_reference` (dequantized weights, slow) otherwise.

    Raises:
        ValueError: ``K`` is not a multiple of ``block[1]``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = weight.shape[0]
    xq, x_scale = quantize_per_token_group(x2, block[1])
    if (x.is_cuda and tuple(block) == (128, 128) and n % 128 == 0 and x2.shape[0] > 0
            and torch.cuda.get_device_capability(x.device) == (9, 0)):
        y = _block_mm_cuda(xq, x_scale, weight, weight_scale, x.dtype)
    else:
        y = block_fp8_matmul_reference(xq, x_scale, weight, weight_scale, block, x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "QuantizedActivation", "UnscaledProduct", "block_fp8_linear",
           "block_fp8_matmul_reference", "check_fp8_supported", "dequantize_block", "dequantize_weight",
           "expand_block_scale", "fp8_linear", "fp8_linear_takes_quantized_input", "fp8_linear_unscaled",
           "fp8_supported", "quantize_per_token", "quantize_per_token_group", "quantize_static", "quantize_weight_per_channel"]
