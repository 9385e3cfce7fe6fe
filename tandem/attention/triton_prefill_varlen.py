"""Variable-length causal flash attention in Triton over packed (non-paged) keys and values.

Used for MLA prefill (:mod:`tandem.layers.mla`): the step's context latents are
decompressed into per-head keys and values packed back to back, and every prefill
request's queries attend causally to its own keys only. FlashAttention-2 (Dao,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023):
one program owns ``BLOCK_M`` query rows of one (sequence, head), streams that sequence's
keys/values in ``BLOCK_N`` tiles with an online softmax (running max and sum in base 2,
fp32 accumulator), so the ``[q_len, k_len]`` scores never leave registers and no program
touches another sequence's keys. The interface follows flash-attn's
``flash_attn_varlen_func`` (``cu_seqlens_q`` / ``cu_seqlens_k``, causal masks aligned to
the bottom-right: the queries are the *last* ``q_len`` tokens of their sequence, as in a
chunk of chunked prefill or the uncached tail after a prefix-cache hit).

MLA's decoupled RoPE key is shared by all heads: the score is ``q . k + q_rope . k_rope``
with ``k_rope`` given as ``[K, 1, rope]`` (read with head stride 0), so nothing is
expanded per head. Splitting the score into these two dots also keeps DeepSeek-V2's
``192 = 128 + 64`` query/key width free of padding; any width is padded up to a power of
two (>= 16, ``tl.dot``'s minimum) with masked loads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot

#: ``(block_m, block_n, num_warps, num_stages)`` per input dtype. 16-bit: the fastest launch
#: timed on an H200 for the long prefill steps the GPU defaults make (benchmarks/RESULTS.md,
#: session 7, "MLA prefill on the H200"), wgmma with a 3-deep cp.async pipeline, no spills;
#: fp32 (exact "ieee" dots on FMA units, used by parity tests) needs small tiles to stay
#: near the register file.
LAUNCH_DEFAULTS = {torch.float16: (128, 64, 8, 3), torch.bfloat16: (128, 64, 8, 3), torch.float32: (32, 16, 4, 2)}


@triton.jit
def _attend_tile(acc, m_i, l_i, q, qr, k_ptrs, kr_ptrs, v_ptrs, k_idx, kv_end, q_pos, d_valid, r_valid, dv_valid,
                 qk_scale, HAS_ROPE: tl.constexpr, CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One key tile of the online softmax (base 2). CAUSAL_MASK: the tile crosses the
    diagonal or the sequence end, so scores past either are masked."""
    k_valid = k_idx < kv_end
    rows = k_valid[:, None]
    k = tl.load(k_ptrs, mask=rows & d_valid[None, :], other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST)
    if HAS_ROPE:
        kr = tl.load(kr_ptrs, mask=rows & r_valid[None, :], other=0.0)
        s += _dot(qr, tl.trans(kr), PRECISION, UPCAST)
    s = s * qk_scale
    if CAUSAL_MASK:
        s = tl.where((k_idx[None, :] <= q_pos[:, None]) & k_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that sees no key yet (only possible on bad input, k_len < q_len) stays finite.
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=rows & dv_valid[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _varlen_prefill_kernel(
    q_ptr,
    k_ptr,
    qr_ptr,  # q_rope (unused when not HAS_ROPE)
    kr_ptr,  # k_rope
    v_ptr,
    out_ptr,
    cu_q_ptr,
    cu_k_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_qrt, stride_qrh,
    stride_krt, stride_krh,  # stride_krh 0: one rope key shared by all heads (MLA)
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    D: tl.constexpr,  # q / k width
    D_PAD: tl.constexpr,
    DR: tl.constexpr,  # q_rope / k_rope width
    DR_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < q_len
    q_pos = k_len - q_len + offs_m  # bottom-right causal: each row's position in its sequence
    q_rows = (q_start + offs_m).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_r = tl.arange(0, DR_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_valid = offs_d < D
    r_valid = offs_r < DR
    dv_valid = offs_dv < DV
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if HAS_ROPE:
        qr = tl.load(qr_ptr + q_rows[:, None] * stride_qrt + head * stride_qrh + offs_r[None, :],
                     mask=row_valid[:, None] & r_valid[None, :], other=0.0)
    else:
        qr = q

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)

    # Keys every row of the tile sees (position <= the first row's) need no mask; the
    # diagonal tiles run up to the last key the tile's last row sees.
    first_pos = k_len - q_len + q_block * BLOCK_M
    n_full = tl.maximum(first_pos + 1, 0) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(k_len, first_pos + BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Scalar 64-bit bases, 32-bit offsets within one sequence (fewer registers per tile).
    k_seq = k_ptr + k_start.to(tl.int64) * stride_kt + head * stride_kh
    kr_seq = kr_ptr + k_start.to(tl.int64) * stride_krt + head * stride_krh
    v_seq = v_ptr + k_start.to(tl.int64) * stride_vt + head * stride_vh

    for start_n in range(0, n_full, BLOCK_N):
        k_idx = start_n + offs_n
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qr, k_seq + k_idx[:, None] * stride_kt + offs_d[None, :],
                                     kr_seq + k_idx[:, None] * stride_krt + offs_r[None, :],
                                     v_seq + k_idx[:, None] * stride_vt + offs_dv[None, :], k_idx, kv_end, q_pos,
                                     d_valid, r_valid, dv_valid, qk_scale, HAS_ROPE, False, PRECISION, UPCAST)
    for start_n in range(n_full, kv_end, BLOCK_N):
        k_idx = start_n + offs_n
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, qr, k_seq + k_idx[:, None] * stride_kt + offs_d[None, :],
                                     kr_seq + k_idx[:, None] * stride_krt + offs_r[None, :],
                                     v_seq + k_idx[:, None] * stride_vt + offs_dv[None, :], k_idx, kv_end, q_pos,
                                     d_valid, r_valid, dv_valid, qk_scale, HAS_ROPE, True, PRECISION, UPCAST)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dv_valid[None, :])


def _pad(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


def _check(name: str, t: torch.Tensor, rows: int | None, heads: int | None, dtype: torch.dtype,
           device: torch.device) -> None:
    if t.dim() != 3 or (rows is not None and t.shape[0] != rows) or (heads is not None and t.shape[1] != heads):
        raise ValueError(f"{name}: expected [{rows or 'rows'}, {heads or 'heads'}, dim], got {list(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{name}: expected {dtype} on {device}, got {t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    *,
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``B`` packed sequences, each over its own keys only.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` of ``q`` /
    ``out`` and key rows ``cu_seqlens_k[b] : cu_seqlens_k[b+1]`` of ``k`` / ``v``; its
    ``q_len`` queries are the last ``q_len`` of its ``k_len`` tokens (``q_len <= k_len``),
    so query ``i`` sees keys ``0 .. k_len - q_len + i``. Neither offset array need start at
    0; rows outside every sequence are left untouched in ``out``.

    Args:
        q: ``[Q, H, D]`` queries (fp32, fp16 or bf16; any row / head strides, last dim
            contiguous; so are all tensors here).
        k: ``[K, H, D]`` keys.
        v: ``[K, H, DV]`` values (``DV`` may differ from ``D``).
        cu_seqlens_q: ``[B + 1]`` int32 query row offsets (non-decreasing).
        cu_seqlens_k: ``[B + 1]`` int32 key row offsets.
        max_seqlen_q: an upper bound on every ``q_len`` (host int; sizes the grid, so it
            must not be read back from the device).
        softmax_scale: multiplies ``q . k (+ q_rope . k_rope)`` before the softmax.
        q_rope, k_rope: optional second score term, ``[Q, H, DR]`` and ``[K, H, DR]`` or
            ``[K, 1, DR]`` (one key shared by all heads: MLA's decoupled RoPE key).
        out: ``[Q, H, DV]`` output to write (a view is fine); allocated if None.
        block_m, block_n: query rows per program, keys per inner iteration (powers of two
            >= 16); num_warps, num_stages: Triton launch parameters. None: the defaults of
            :data:`LAUNCH_DEFAULTS` for q's dtype.

    Returns ``out``, ``[Q, H, DV]`` in q's dtype; softmax and accumulation in fp32. No host
    sync: the grid is ``(ceil(max_seqlen_q / block_m), B, H)``. Offsets within one
    sequence are 32-bit: ``k_len`` times k's / v's row stride must stay below 2**31 (524,288
    keys at 16 heads x 256).

    Raises:
        ValueError: mismatched shapes, dtypes or devices, a non-contiguous last dimension,
            only one of ``q_rope`` / ``k_rope``, or a block size that is not a power of two
            >= 16.
    """
    dev, dtype = q.device, q.dtype
    if dtype not in LAUNCH_DEFAULTS:
        raise ValueError(f"q: unsupported dtype {dtype}")
    _check("q", q, None, None, dtype, dev)
    num_q, heads, d = q.shape
    _check("k", k, None, heads, dtype, dev)
    if k.shape[2] != d:
        raise ValueError(f"k: width {k.shape[2]} != q's {d}")
    _check("v", v, k.shape[0], heads, dtype, dev)
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope: give both or neither")
    has_rope = q_rope is not None
    if has_rope:
        _check("q_rope", q_rope, num_q, heads, dtype, dev)
        _check("k_rope", k_rope, k.shape[0], None, dtype, dev)
        if k_rope.shape[1] not in (1, heads) or k_rope.shape[2] != q_rope.shape[2]:
            raise ValueError(f"k_rope: expected [{k.shape[0]}, 1 or {heads}, {q_rope.shape[2]}], "
                             f"got {list(k_rope.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != dev:
            raise ValueError(f"{name}: expected a 1-D int32 tensor on {dev}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k: expected the same [B + 1] shape")
    defaults = LAUNCH_DEFAULTS[dtype]
    block_m, block_n = block_m or defaults[0], block_n or defaults[1]
    num_warps, num_stages = num_warps or defaults[2], num_stages or defaults[3]
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    dv = v.shape[2]
    if out is None:
        out = torch.empty(num_q, heads, dv, dtype=dtype, device=dev)
    else:
        _check("out", out, num_q, heads, dtype, dev)
        if out.shape[2] != dv:
            raise ValueError(f"out: width {out.shape[2]} != v's {dv}")
    batch = cu_seqlens_q.numel() - 1
    if batch == 0 or max_seqlen_q <= 0 or heads == 0:
        return out
    qr, kr = (q_rope, k_rope) if has_rope else (q, k)
    dr = qr.shape[2] if has_rope else 16
    kr_head_stride = 0 if kr.shape[1] == 1 else kr.stride(1)
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, heads)
    _varlen_prefill_kernel[grid](
        q, k, qr, kr, v, out, cu_seqlens_q, cu_seqlens_k,
        softmax_scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qr.stride(0), qr.stride(1), kr.stride(0), kr_head_stride,
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D=d, D_PAD=_pad(d), DR=dr, DR_PAD=_pad(dr), DV=dv, DV_PAD=_pad(dv), HAS_ROPE=has_rope,
        BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
