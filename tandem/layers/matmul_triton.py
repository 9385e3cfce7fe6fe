"""Batch-invariant GEMM in Triton: ``x @ weight.T + bias`` whose every output row has the
same bits whatever other rows are computed with it (deterministic mode on CUDA,
:mod:`tandem.layers.batch_invariant`).

cuBLAS picks its kernel, tiling and split-K factor from the matrix shapes, M included, so
the sum behind one output element is ordered differently when the batch has another row
count. Following "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025),
this kernel fixes everything that orders the sum:

* one launch configuration (:func:`tile_config`) chosen from ``(N, K, dtype)`` alone,
  never from M;
* no split-K: each output element is reduced over the whole of K by one program, in
  BLOCK_K steps from ``k = 0`` upward, with the fp32 accumulator of the same tile shape;
* M is not specialised on (``do_not_specialize``), so every batch size runs the one
  compiled variant of its ``(N, K, dtype)``; rows past M are masked to zeros by a
  runtime comparison in that code (a row's products never mix with another row's), and
  the K tail is masked the same way for every M.

The grid is persistent: ``min(tiles, SMs)`` programs each loop over output tiles
(``tile, tile + programs, ...``) in grouped order (GROUP_M row tiles sweep the column
tiles together, so a weight tile is reused from L2 by the row tiles that need it). Which
program computes a tile, and when, does not change its arithmetic.

Cost of the fixed configuration (H100, bf16, Llama-3.1-8B shapes, L2 flushed; see
``benchmarks/batch_invariant_gemm.py``): about cuBLAS's time for the wide layers (gate_up,
lm_head) at every M; 1.2-1.4x for qkv / o / down from a few hundred rows up, and 1.4-2x at
decode sizes, where cuBLAS splits K over the SMs and this kernel, which may not, runs
``N / 128`` programs.

The bias is added to the fp32 accumulator before the one rounding to x's dtype.
Storage dtypes fp16 / bf16 (fp32 dot accumulation) and fp32 (IEEE fp32 dots, no TF32).
On the CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported; bf16 dots upcast to fp32 there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot
from tandem.triton_utils import num_sms

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETER_PROGRAMS = 3  # persistent programs off CUDA: few, so tests walk the tile loop


class TileConfig(NamedTuple):
    """Launch configuration of one ``(N, K, dtype)``: the tile shape, the swizzle group
    (row tiles per group) and the launch settings."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def tile_config(n: int, k: int, dtype: torch.dtype) -> TileConfig:
    """The one configuration every batch size of an ``[M, k] @ [k, n]`` product in
    ``dtype`` runs with (it takes no M: that is what makes the rows batch-invariant).

    Measured on an H100 (``benchmarks/batch_invariant_gemm.py``, Llama-3.1-8B shapes, M 1
    to 2048): 16-bit dtypes take BLOCK_M 128, BLOCK_K 64, 8 warps, and BLOCK_N 256 with 3
    stages once ``n >= 16384`` (gate_up, lm_head: even one row tile then gives 64 programs
    or more), else BLOCK_N 128 with 4 stages (qkv, o, down: 256-wide tiles would leave
    most SMs idle at decode sizes). fp32 (IEEE dots on the CUDA cores) takes 16x32 tiles
    with BLOCK_K 128 for ``n <= 256`` (MoE router logits), else 64x64 with BLOCK_K 32.
    BLOCK_N and BLOCK_K shrink to the next power of two of a smaller ``n`` / ``k`` (at
    least 16, ``tl.dot``'s minimum).

    Raises:
        ValueError: ``dtype`` is not fp16 / bf16 / fp32.
    """
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"tile_config: dtype {dtype} not supported ({_SUPPORTED_DTYPES})")
    if dtype != torch.float32:
        wide = n >= 16384
        block_m, block_n, block_k, warps, stages = 128, 256 if wide else 128, 64, 8, 3 if wide else 4
    elif n <= 256:
        block_m, block_n, block_k, warps, stages = 16, 32, 128, 2, 3
    else:
        block_m, block_n, block_k, warps, stages = 64, 64, 32, 4, 3
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return TileConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=stages)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr,  # [B, M, K], unit stride along K
    b_ptr,  # [B, N, K] weights
    c_ptr,  # [B, M, N] output, unit stride along N
    bias_ptr,  # [N] (read iff HAS_BIAS)
    M,  # the batch: runtime, so one compiled variant serves every M
    N,
    K,
    stride_ab,
    stride_am,
    stride_bb,
    stride_bn,
    stride_bk,
    stride_cb,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Grid axis 1: the product of a batched call (one weight per head); axis 0 persistent.
    batch = tl.program_id(1).to(tl.int64)
    a_ptr += batch * stride_ab
    b_ptr += batch * stride_bb
    c_ptr += batch * stride_cb
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_tiles
    offs_k = tl.arange(0, BLOCK_K)
    # flatten: the K loops of a program's successive tiles are pipelined as one loop, so the
    # next tile's loads overlap this tile's epilogue.
    for tile in tl.range(tl.program_id(0), num_m_tiles * num_n_tiles, tl.num_programs(0), flatten=True):
        # Swizzle: GROUP_M consecutive row tiles walk the column tiles together.
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows past M are masked (zero-filled without a memory read: a decode step reads its
        # few rows, not BLOCK_M); columns past N read column 0 and are never stored. Either
        # way a valid row's arithmetic is the same wherever the batch ends.
        m_valid = offs_m < M
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_valid[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_valid = offs_k < K - k0
                a = tl.load(a_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_valid[:, None], other=0.0)
            acc += _dot(a, b, PRECISION, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & (offs_n < N)[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: TileConfig) -> None:
    """``out [B, M, N] = x [B, M, K] @ weight[b].T (+ bias)`` with ``cfg``; x and out have
    a unit stride along their last dim, ``weight [B, N, K]`` any strides."""
    nb, m, k = x.shape
    n = weight.shape[1]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = num_sms(x.device) if x.is_cuda else _INTERPRETER_PROGRAMS
    _matmul_kernel[(min(tiles, programs), nb)](
        x, weight, out, bias if bias is not None else out, m, n, k, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def matmul_batch_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every output row independent of the other rows
    of ``x`` (bit for bit, whatever their number and values; see the module docstring).

    Args:
        x: ``[..., K]`` fp16 / bf16 / fp32 (copied unless its rows are contiguous, at a
            pitch of K).
        weight: ``[N, K]``, x's dtype and device (any strides).
        bias: optional ``[N]``, x's dtype and device; added in fp32 before the rounding.

    Returns:
        ``[..., N]`` in x's dtype: the fp32 sums over K, plus the bias, rounded once.

    Raises:
        ValueError: a shape, dtype or device mismatch between ``x``, ``weight`` and
            ``bias``, an unsupported dtype, or CPU tensors without the Triton interpreter.
    """
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"matmul_batch_invariant: x dtype {x.dtype} not supported ({_SUPPORTED_DTYPES})")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"matmul_batch_invariant: weight must be [N, K] with x [..., K], got weight "
                         f"{tuple(weight.shape)} and x {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"matmul_batch_invariant: weight is {weight.dtype} on {weight.device}, x is {x.dtype} "
                         f"on {x.device}")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"matmul_batch_invariant: bias must be [{n}] {x.dtype} on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if not x.is_cuda and not _INTERPRET:
        raise ValueError("matmul_batch_invariant: x on the CPU needs the Triton interpreter (TRITON_INTERPRET=1 "
                         "set before tandem.layers.matmul_triton is imported)")
    lead = x.shape[:-1]
    m = lead.numel()
    x2 = x.reshape(m, k)
    if x2.stride() != (k, 1):
        # Not .contiguous(): it passes a one-row view of a wider tensor as it is, whose data
        # pointer may be aligned otherwise, so one row would run another compiled variant
        # (Triton specialises on pointer alignment) than the batches.
        x2 = x2.clone(memory_format=torch.contiguous_format)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        _launch(x2[None], weight[None], None if bias is None else bias.contiguous(), out[None],
                tile_config(n, k, x.dtype))
    return out.reshape(*lead, n)


def bmm_batch_invariant(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y[:, b] = x[:, b] @ weight[b]`` for every ``b`` in one launch, each row's bits
    independent of the number of rows ``M`` (as :func:`matmul_batch_invariant`, one tile
    configuration per ``(N, K, dtype)``); for MLA's per-head ``W_uk`` / ``W_uv``.

    Args:
        x: ``[M, B, K]`` fp16 / bf16 / fp32, unit stride along K (e.g. a per-head view of a
            projection's output; read in place).
        weight: ``[B, K, N]``, x's dtype and device, any strides.

    Returns:
        ``[M, B, N]`` in x's dtype (fp32 sums, one rounding).

    Raises:
        ValueError: shape, dtype or device mismatch, an unsupported dtype, or CPU tensors
            without the Triton interpreter.
    """
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"bmm_batch_invariant: x dtype {x.dtype} not supported ({_SUPPORTED_DTYPES})")
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[0] != x.shape[1] or weight.shape[1] != x.shape[2]:
        raise ValueError(f"bmm_batch_invariant: x must be [M, B, K] and weight [B, K, N], got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"bmm_batch_invariant: weight is {weight.dtype} on {weight.device}, x is {x.dtype} "
                         f"on {x.device}")
    if not x.is_cuda and not _INTERPRET:
        raise ValueError("bmm_batch_invariant: x on the CPU needs the Triton interpreter (TRITON_INTERPRET=1 "
                         "set before tandem.layers.matmul_triton is imported)")
    m, nb, k = x.shape
    n = weight.shape[2]
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(m, nb, n, dtype=x.dtype, device=x.device)
    if m and n and nb:
        _launch(x.transpose(0, 1), weight.transpose(1, 2), None, out.transpose(0, 1), tile_config(n, k, x.dtype))
    return out
