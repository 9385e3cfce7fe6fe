"""Fused elementwise ops of the decoder: RMSNorm (with the residual add), SiLU-and-mul, RoPE.

Each op has a torch reference (``*_ref``, the exact code the model ran before, HF's
semantics) and a Triton kernel doing the same arithmetic in one launch:

* :func:`rms_norm` ``(x, weight, eps)``: ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``.
* :func:`fused_add_rms_norm` ``(x, residual, weight, eps) -> (normed, x + residual)``: the
  residual add is rounded to the input dtype (as ``x + residual`` is) and *that* sum is
  normalised, so the pair equals ``r = x + residual; (rms_norm(r), r)``.
* The three norms also take ``x`` as an :class:`~tandem.layers.quantization.fp8.UnscaledProduct`
  (an FP8 GEMM's fp32 sums with their scales still to apply): the kernel reads the sums,
  applies the per-token x per-channel scales and rounds to the product's dtype as
  ``x.apply_scales()`` does before the unfused op (bit for bit in fp16/bf16; for an fp32
  product compiled kernels may contract the scaling and the residual add into one FMA),
  so the GEMM needs no scaling pass.
* :func:`silu_and_mul` ``(gate_up [..., 2I]) -> silu(gate) * up [..., I]`` (gate first).
* :func:`rms_norm_dynamic_per_token_quant` and :func:`silu_and_mul_dynamic_per_token_quant`:
  the same two ops writing their result as FP8 e4m3 with one fp32 scale per token (vLLM's
  ``rms_norm_dynamic_per_token_quant`` / fused SiLU-and-mul + quant kernels): the input of
  an FP8 linear layer quantized where it is produced, instead of by a separate kernel
  that reads it back. The quantized value is the unfused op's result *rounded to its
  dtype*, quantized by :func:`~tandem.layers.quantization.fp8.quantize_per_token`, so that
  the fused kernel equals the two unfused kernels bit for bit.
* :func:`apply_rotary` ``(q [T, Hq, D], k [T, Hk, D], cos, sin [P, D/2], positions [T])``:
  RoPE in fp32, out of place (contiguous outputs) or in place; NeoX style (the two halves
  of the head rotated, Llama/Qwen) or ``interleaved`` (adjacent pairs ``(x[2i], x[2i+1])``,
  the GPT-J / DeepSeek-V2 layout).

Dispatch (:func:`use_triton`): every op takes its caller's fused-ops ``mode``. ``auto`` (the
default) runs the kernel when the tensor is on CUDA and the torch code otherwise (the CPU
path is the reference); ``torch`` keeps the torch code on CUDA too; ``triton`` runs the
kernels on any device, which on the CPU needs the Triton interpreter (``TRITON_INTERPRET=1``
set before the first kernel call: kernels are ``triton.jit``-ed lazily on first use,
because the interpreter is chosen at decoration time); ``cpu`` runs the two norms as the
C++ kernels of :mod:`tandem.layers.cpu_ops` on CPU tensors whose weight (and residual) have
the input's dtype, and the torch code for everything else.

The mode belongs to a model, not to the process. The worker decides it once, from
``TANDEM_FUSED_OPS`` and its device (:func:`resolve_mode`: ``auto`` becomes ``triton`` on
CUDA, ``cpu`` on the CPU where the C++ kernels build, ``torch`` otherwise), and the loader
builds the model inside :func:`building` (:func:`tandem.model_loader.loader.build_model`);
every layer that calls a fused op (RMSNorm, RoPE, the SwiGLU MLP, MLA's latent write) reads
:func:`build_mode` once in its constructor,
keeps it as its ``fused_ops_mode`` attribute and passes it to each call. Nothing reads a
mode at forward time, so two engines of one process may run in different modes.

The kernels make no host sync and size their grid from tensor shapes only, so they can be
captured in a CUDA graph; constexpr specialisations depend on the feature sizes, head
counts and dtypes, never on the number of tokens. Zero tokens return empty outputs without
a launch. Inputs must have a contiguous last dim (other dims may be strided, e.g. q/k/v
views of a fused projection); math is fp32 and storage fp32/fp16/bf16.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tandem import envs
from tandem.layers import cpu_ops
from tandem.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, UnscaledProduct, quantize_per_token

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = tl = None
    HAS_TRITON = False

_MODES = envs.FUSED_OPS_MODES
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ROW = 65536  # one program holds a whole row in registers (norms, fused quantization)


# A context variable, not a module flag: it is set only while a model is constructed, and
# each thread (an engine's step thread) and asyncio task sees its own value.
_build_mode: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_fused_ops_build", default="auto")


_NO_TRITON = "fused-ops mode 'triton' (TANDEM_FUSED_OPS) but Triton is not installed"


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"fused-ops mode {mode!r}: expected one of {_MODES}")


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode (``triton``, ``cpu`` or ``torch``) that ``mode`` means for a model on
    ``device``: ``auto`` is the Triton kernels on CUDA (with Triton installed), the C++
    kernels on the CPU where they build (:func:`tandem.layers.cpu_ops.available`, which builds them
    on its first call), and the torch code otherwise.

    Raises:
        ValueError: ``mode`` is not one of ``auto``, ``triton``, ``torch``, ``cpu``; ``cpu``
            for a device that is not the CPU, or where the kernels do not build (the user's
            setting, reported by the command line in one line).
        RuntimeError: ``triton`` without Triton installed.
    """
    _check_mode(mode)
    if mode == "auto":
        if HAS_TRITON and device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_ops.available() else "torch"
    if mode == "triton" and not HAS_TRITON:
        raise RuntimeError(_NO_TRITON)
    if mode == "cpu":
        if device.type != "cpu":
            raise ValueError(f"fused-ops mode 'cpu' (TANDEM_FUSED_OPS) is for CPU models, not {device.type}")
        if not cpu_ops.available():
            raise ValueError("TANDEM_FUSED_OPS=cpu, but the C++ CPU kernels could not be built (the warning above "
                             "says why): leave it unset (auto) or set it to torch")
    return mode


@contextlib.contextmanager
def building(mode: str) -> Iterator[None]:
    """Construct layers in fused-ops ``mode`` (``auto``, ``triton`` or ``torch``): each
    layer built inside the block keeps it (:func:`build_mode`). The previous mode is back on
    exit; blocks nest.

    Raises:
        ValueError: an unknown mode.
    """
    _check_mode(mode)
    token = _build_mode.set(mode)
    try:
        yield
    finally:
        _build_mode.reset(token)


def build_mode() -> str:
    """The fused-ops mode of the model under construction (the innermost :func:`building`
    block of this thread; ``auto`` outside any). For layer constructors: a forward passes
    the layer's own ``fused_ops_mode`` to the ops."""
    return _build_mode.get()


def use_triton(x: torch.Tensor, mode: str = "auto") -> bool:
    """Whether an op called in ``mode`` runs its Triton kernel for a tensor on ``x``'s device.

    Raises:
        ValueError: an unknown mode.
        RuntimeError: ``triton`` without Triton installed.
    """
    if mode == "auto":
        return HAS_TRITON and x.is_cuda
    if mode in ("torch", "cpu"):
        return False
    _check_mode(mode)
    if not HAS_TRITON:
        raise RuntimeError(_NO_TRITON)
    return True


# ---------------------------------------------------------------- torch references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, normalized in fp32 and rounded to x's dtype
    before the weight multiplies (transformers' order). ``F.rms_norm`` is one fused pass on
    the CPU (bit-equal to the unfused fp32 formula), and on a 16-bit CPU tensor it
    normalizes in fp32 and rounds once, as the cast around it would (2 dispatched ops fewer)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.device.type == "cpu":
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_dynamic_per_token_quant_ref(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if residual is None:
        out, new_residual = rms_norm_ref(x, weight, eps), None
    else:
        out, new_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return *quantize_per_token(out), new_residual


def silu_and_mul_dynamic_per_token_quant_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(silu_and_mul_ref(gate_up))


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The halves are written into one output (no cat); same fp32 products and sums.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out.to(x.dtype)


def rotate_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [..., D]`` by ``cos/sin [..., D/2]`` (broadcast); fp32 math."""
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    rotate = rotate_interleaved_ref if interleaved else _rotate_ref
    return rotate(q, c, s), rotate(k, c, s)


# ---------------------------------------------------------------- Triton kernels
# Plain functions, ``triton.jit``-ed on first use (see the module docstring).


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    x_row_scale_ptr,
    x_col_scale_ptr,
    B,  # rows are (a, b) pairs of a [A, B, N] view: row = a * B + b
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SCALED_X: tl.constexpr,  # x is an UnscaledProduct's fp32 sums: scale them, round to X_DTYPE
    X_DTYPE: tl.constexpr,
    FP8_OUT: tl.constexpr,  # out_ptr is e4m3: quantize per row, write the scale to scale_ptr
    OUT_DTYPE: tl.constexpr,  # dtype of the unfused output (out_ptr's own dtype unless FP8_OUT)
    FMAX: tl.constexpr,
    MIN_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a = row // B
    b = row % B
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0)
    if SCALED_X:
        # UnscaledProduct.apply_scales: (acc * row_scale) * col_scale, rounded to X_DTYPE.
        cs = tl.load(x_col_scale_ptr + cols, mask=mask, other=0.0)
        x = ((x * tl.load(x_row_scale_ptr + row)) * cs).to(X_DTYPE)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_ra + b * stride_rb + cols, mask=mask, other=0.0)
        # ``x + residual`` in the storage dtype: fp32 add, one rounding (as torch does).
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + cols, s, mask=mask)
        xf = s.to(tl.float32)
        norm_dtype = res_out_ptr.dtype.element_ty
    else:
        xf = x.to(tl.float32)
        norm_dtype = X_DTYPE
    var = tl.sum(xf * xf, axis=0) / N
    rstd = tl.math.rsqrt(var + eps)
    # HF: cast the normalised row back to the input dtype, then multiply by the weight.
    y = (xf * rstd).to(norm_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (y * w).to(OUT_DTYPE)
    if FP8_OUT:
        # quantize_per_token of the unfused output (masked lanes are 0). Both divisions
        # round to nearest (div_rn) as torch's do: Triton's ``/`` is an approximate division.
        yq = out.to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(yq), axis=0), FMAX), MIN_S)
        q = tl.clamp(tl.math.div_rn(yq, scale), -FMAX, FMAX)
        tl.store(out_ptr + row * N + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * N + cols, out, mask=mask)


def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    I,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # ``F.silu(gate) * up`` in the storage dtype: silu in fp32 rounded, then the product.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    I,
    OUT_DTYPE: tl.constexpr,  # dtype of the unfused output
    FMAX: tl.constexpr,
    MIN_S: tl.constexpr,
    BLOCK: tl.constexpr,  # the whole row: its amax is needed before any value is stored
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # _silu_and_mul_kernel's arithmetic, then quantize_per_token as in _rms_norm_kernel.
    s = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    y = (s * u).to(OUT_DTYPE).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FMAX), MIN_S)
    q = tl.clamp(tl.math.div_rn(y, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * I + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    HALF,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    # Element offsets of the two members of each rotated pair.
    if INTERLEAVED:
        o1 = 2 * d
        o2 = 2 * d + 1
    else:
        o1 = d
        o2 = d + HALF
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    hs = tl.arange(0, BLOCK_H)
    for h0 in tl.static_range(0, HQ, BLOCK_H):
        h = h0 + hs
        m = (h < HQ)[:, None] & dmask[None, :]
        src = q_ptr + t * stride_qt + h[:, None] * stride_qh
        x1 = tl.load(src + o1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + o2[None, :], mask=m, other=0.0).to(tl.float32)
        dst = q_out_ptr + t * stride_qot + h[:, None] * stride_qoh
        tl.store(dst + o1[None, :], (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + o2[None, :], (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=m)
    for h0 in tl.static_range(0, HK, BLOCK_H):
        h = h0 + hs
        m = (h < HK)[:, None] & dmask[None, :]
        src = k_ptr + t * stride_kt + h[:, None] * stride_kh
        x1 = tl.load(src + o1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + o2[None, :], mask=m, other=0.0).to(tl.float32)
        dst = k_out_ptr + t * stride_kot + h[:, None] * stride_koh
        tl.store(dst + o1[None, :], (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + o2[None, :], (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=m)


@functools.cache
def _kernel(name: str):
    return triton.jit(globals()[name])


def _check_launch(kernel, *tensors: torch.Tensor) -> None:
    if any(not t.is_cuda for t in tensors) and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("fused ops forced onto Triton for CPU tensors, but the kernels were not built by the Triton "
                           "interpreter: set TRITON_INTERPRET=1 before the first fused-op call")


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (fp32/fp16/bf16)")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}; "
                         "call .contiguous() first")


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))


# ---------------------------------------------------------------- public ops


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``x [..., N]`` as (tensor, A, B, stride_a, stride_b) of an ``[A, B, N]`` row grid."""
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _scaled_input(x: UnscaledProduct) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 sums, row scales, column scales) of ``x``, checked for the norm kernel."""
    m, n = x.acc.shape if x.acc.dim() == 2 else (-1, -1)
    if (m < 0 or x.acc.dtype != torch.float32 or x.acc.stride(-1) != 1 or x.row_scale.numel() != m
            or x.col_scale.shape != (n,) or x.dtype not in _SUPPORTED_DTYPES):
        raise ValueError(f"rms_norm: an UnscaledProduct needs fp32 contiguous sums [M, N], M row and N column "
                         f"scales and an fp32/fp16/bf16 dtype, got sums {tuple(x.acc.shape)} {x.acc.dtype}, row "
                         f"scales {tuple(x.row_scale.shape)}, column scales {tuple(x.col_scale.shape)}, dtype {x.dtype}")
    return x.acc, x.row_scale.reshape(m).contiguous(), x.col_scale.float().contiguous()


def _norm_launch(x: torch.Tensor | UnscaledProduct, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, fp8_out: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, new residual or None, per-token scales ``[..., 1]`` fp32 or None); the
    output is e4m3 with ``fp8_out``, else in the dtype of ``weight * x``."""
    x_dtype = x.dtype
    if isinstance(x, UnscaledProduct):
        x, row_scale, col_scale = _scaled_input(x)
    else:
        _check("rms_norm input", x)
        row_scale = col_scale = None
    n = x.shape[-1]
    _check("rms_norm weight", weight)
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} vs hidden size {n}")
    if n > _MAX_ROW:
        raise ValueError(f"rms_norm: hidden size {n} > {_MAX_ROW} is not supported by the fused kernel")
    res_dtype = x_dtype
    if residual is not None:
        _check("rms_norm residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"fused_add_rms_norm: residual shape {tuple(residual.shape)} vs input {tuple(x.shape)}")
        res_dtype = torch.promote_types(x_dtype, residual.dtype)
    out_dtype = torch.promote_types(res_dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=FP8_DTYPE if fp8_out else out_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if fp8_out else None
    res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device) if residual is not None else None
    rows = x.numel() // n if n else 0
    if rows == 0 or n == 0:
        if res_out is not None:
            res_out.copy_(x.to(x_dtype) + residual)  # empty or zero-width: nothing to launch
        if scale is not None:
            scale.fill_(MIN_SCALE)  # a zero-width row quantizes as an all-zero one
        return out, res_out, scale
    xv, _, b, sxa, sxb = _rows(x)
    if residual is not None:
        rv, _, _, sra, srb = _rows(residual)
    else:
        rv, sra, srb = xv, 0, 0
    kernel = _kernel("_rms_norm_kernel")
    _check_launch(kernel, x, weight)
    block = triton.next_power_of_2(n)
    kernel[(rows,)](
        xv, rv, weight, out, res_out if res_out is not None else out, scale if scale is not None else out,
        row_scale if row_scale is not None else out, col_scale if col_scale is not None else out,
        b, sxa, sxb, sra, srb, n, float(eps),
        HAS_RESIDUAL=residual is not None, SCALED_X=row_scale is not None, X_DTYPE=_tl_dtype(x_dtype),
        FP8_OUT=fp8_out, OUT_DTYPE=_tl_dtype(out_dtype), FMAX=FP8_MAX,
        MIN_S=MIN_SCALE, BLOCK_N=block, num_warps=_num_warps(block),
    )
    return out, res_out, scale


def _cpu_kernel(mode: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether a norm in ``mode`` runs the C++ kernel: CPU tensors, all of x's dtype (the
    references promote mixed dtypes; the kernels take one)."""
    return mode == "cpu" and not x.is_cuda and x.dtype in _SUPPORTED_DTYPES and weight.dtype == x.dtype \
        and (residual is None or residual.dtype == x.dtype)


def _norm_input(x: torch.Tensor | UnscaledProduct, mode: str) -> tuple[torch.Tensor | UnscaledProduct, bool]:
    """(``x``, whether the kernel runs), ``x`` with its scales applied where the torch code runs."""
    triton_path = use_triton(x.acc if isinstance(x, UnscaledProduct) else x, mode)
    if isinstance(x, UnscaledProduct) and not triton_path:
        return x.apply_scales(), False
    return x, triton_path


def rms_norm(x: torch.Tensor | UnscaledProduct, weight: torch.Tensor, eps: float, *,
             mode: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., N]`` (new contiguous tensor, dtype of
    ``weight * x``); leading dims may be strided. ``x`` may be an ``[M, N]``
    :class:`~tandem.layers.quantization.fp8.UnscaledProduct` (module docstring). ``mode``:
    the caller's fused-ops mode (:func:`use_triton`), as for every op here.

    Raises:
        ValueError: (Triton path) an unsupported dtype, a non-contiguous last dim, a weight
            that is not ``[N]``, or a malformed UnscaledProduct; an unknown ``mode``.
    """
    x, triton_path = _norm_input(x, mode)
    if not triton_path:
        if _cpu_kernel(mode, x, weight):
            return cpu_ops.rms_norm(x, weight, eps)
        return rms_norm_ref(x, weight, eps)
    return _norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor | UnscaledProduct, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, mode: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; return rms_norm(r, weight, eps), r`` in one pass (new tensors);
    ``x`` as :func:`rms_norm` (an UnscaledProduct has its scales applied before the add).

    Raises:
        ValueError: (Triton path) as :func:`rms_norm`, or a residual of another shape.
    """
    x, triton_path = _norm_input(x, mode)
    if not triton_path:
        if _cpu_kernel(mode, x, weight, residual):
            return cpu_ops.fused_add_rms_norm(x, residual, weight, eps)
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _norm_launch(x, residual, weight, eps)[:2]


def rms_norm_dynamic_per_token_quant(
        x: torch.Tensor | UnscaledProduct, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
        *, mode: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`rms_norm` (or, with ``residual``, :func:`fused_add_rms_norm`) quantized to FP8
    with dynamic per-token scales in the same pass (vLLM's ``rms_norm_dynamic_per_token_quant``).

    Args:
        x: ``[..., N]`` fp32/fp16/bf16, last dim contiguous, or an ``[M, N]``
            :class:`~tandem.layers.quantization.fp8.UnscaledProduct`.
        weight: ``[N]``.
        residual: ``[..., N]`` or None.
        mode: the caller's fused-ops mode (:func:`use_triton`).

    Returns:
        ``(q [..., N] float8_e4m3fn, scale [..., 1] fp32, new residual x + residual or None)``:
        ``q, scale == quantize_per_token(rms_norm(...))`` of the unfused output in its own
        dtype (module docstring), bit for bit on the same device's kernels.

    Raises:
        ValueError: (Triton path) as :func:`rms_norm`.
    """
    x, triton_path = _norm_input(x, mode)
    if not triton_path:
        return rms_norm_dynamic_per_token_quant_ref(x, weight, eps, residual)
    q, new_residual, scale = _norm_launch(x, residual, weight, eps, fp8_out=True)
    return q, scale, new_residual


def silu_and_mul(gate_up: torch.Tensor, *, mode: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` (gate = first half) -> ``[..., I]``, in
    the caller's fused-ops ``mode`` (:func:`use_triton`).

    Raises:
        ValueError: (Triton path) an odd last dim, an unsupported dtype or a non-contiguous
            last dim; an unknown ``mode``.
    """
    if not use_triton(gate_up, mode):
        if mode == "cpu" and not gate_up.is_cuda and gate_up.dtype in _SUPPORTED_DTYPES:
            return cpu_ops.silu_and_mul(gate_up)
        return silu_and_mul_ref(gate_up)
    _check("silu_and_mul input", gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dim {two_i} is odd")
    inter = two_i // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    x = gate_up.reshape(-1, two_i)  # a view for the usual [T, 2I] / contiguous inputs
    kernel = _kernel("_silu_and_mul_kernel")
    _check_launch(kernel, x)
    block = min(1024, triton.next_power_of_2(inter))
    kernel[(x.shape[0], triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block,
                                                     num_warps=max(1, min(4, block // 256)))
    return out


def silu_and_mul_dynamic_per_token_quant(gate_up: torch.Tensor, *, mode: str = "auto"
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul` quantized to FP8 with dynamic per-token scales in the same pass.

    Args:
        gate_up: ``[..., 2I]`` fp32/fp16/bf16 (gate = first half), last dim contiguous,
            ``I`` up to 65,536 (one program holds a whole row).
        mode: the caller's fused-ops mode (:func:`use_triton`).

    Returns:
        ``(q [..., I] float8_e4m3fn, scale [..., 1] fp32)`` ``== quantize_per_token(silu_and_mul(gate_up))``
        of the unfused result in ``gate_up``'s dtype, bit for bit on the same device's kernels.

    Raises:
        ValueError: (Triton path) an odd last dim, ``I`` > 65,536, an unsupported dtype or a
            non-contiguous last dim; an unknown ``mode``.
    """
    if not use_triton(gate_up, mode):
        return silu_and_mul_dynamic_per_token_quant_ref(gate_up)
    _check("silu_and_mul input", gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dim {two_i} is odd")
    inter = two_i // 2
    if inter > _MAX_ROW:
        raise ValueError(f"silu_and_mul_dynamic_per_token_quant: {inter} features > {_MAX_ROW} per row")
    q = torch.empty((*gate_up.shape[:-1], inter), dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty((*gate_up.shape[:-1], 1), dtype=torch.float32, device=gate_up.device)
    if gate_up.numel() == 0:
        scale.fill_(MIN_SCALE)  # a zero-width row quantizes as an all-zero one
        return q, scale
    x = gate_up.reshape(-1, two_i)
    kernel = _kernel("_silu_and_mul_quant_kernel")
    _check_launch(kernel, x)
    block = triton.next_power_of_2(inter)
    kernel[(x.shape[0],)](x, q, scale, x.stride(0), inter, OUT_DTYPE=_tl_dtype(gate_up.dtype), FMAX=FP8_MAX,
                          MIN_S=MIN_SCALE, BLOCK=block, num_warps=_num_warps(block))
    return q, scale


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 inplace: bool = False, interleaved: bool = False, *, mode: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (Su et al. 2021, RoFormer) of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at
    ``positions [T]`` with the tables ``cos``/``sin [P, D/2]`` (any float dtype; math in
    fp32, results in q/k's dtype). NeoX layout (dims ``i`` and ``i + D/2`` form a pair) or,
    with ``interleaved``, dims ``2i`` and ``2i + 1`` (DeepSeek-V2, as transformers).

    Out of place the results are new contiguous tensors; ``inplace=True`` writes into q and
    k (which may be strided views) and returns them. Positions must lie in ``[0, P)``: the
    kernel does not check (that would need a host sync). ``mode``: the caller's fused-ops
    mode (:func:`use_triton`).

    Raises:
        ValueError: (Triton path) mismatched shapes or dtypes, an unsupported dtype, or a
            last dim that is not contiguous; an unknown ``mode``.
    """
    if not use_triton(q, mode):
        rq, rk = apply_rotary_ref(q, k, cos, sin, positions, interleaved)
        if not inplace:
            return rq, rk
        return q.copy_(rq), k.copy_(rk)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check(f"apply_rotary {name}", t)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rotary: expected q [T, Hq, D], k [T, Hk, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or cos.dim() != 2 or sin.shape != cos.shape or cos.shape[1] * 2 != d:
        raise ValueError(f"apply_rotary: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be [P, {d // 2}] for head dim {d}")
    if positions.shape != (t,):
        raise ValueError(f"apply_rotary: positions shape {tuple(positions.shape)} vs {t} tokens")
    if q.dtype != k.dtype:
        raise ValueError(f"apply_rotary: q dtype {q.dtype} != k dtype {k.dtype}")
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0 or d == 0:
        return q_out, k_out
    kernel = _kernel("_rope_kernel")
    _check_launch(kernel, q, k, cos, positions)
    half = d // 2
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(hq, hk)), max(1, 2048 // block_d))
    kernel[(t,)](
        q, k, q_out, k_out, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), half,
        HQ=hq, HK=hk, BLOCK_H=block_h, BLOCK_D=block_d, INTERLEAVED=interleaved, num_warps=4,
    )
    return q_out, k_out
