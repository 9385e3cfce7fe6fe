"""Fused MoE expert GEMMs in Triton for the memory-bound (decode) regime.

At decode sizes every expert sees a handful of rows, so the SwiGLU experts are bound by
reading the expert weights (DeepSeek-V2-Lite: 64 x 3 x 2048 x 1408 bf16 = 1.1 GB per
layer). The design follows the well-known "fused MoE" kernel of vLLM / SGLang:

1. **Alignment** (:func:`moe_align_block_size`, no host sync): the ``T*k`` (token, expert)
   pairs are grouped by expert and each expert's group is padded to a multiple of
   ``BLOCK_M``. The result is ``sorted_ids`` (flat pair id ``t*k + j`` of every padded row,
   the sentinel ``T*k`` in padding rows), ``tile_experts`` (expert of every ``BLOCK_M``
   tile) and ``num_padded`` (a one-element device tensor: rows actually used). Its length
   is the static bound ``T*k + E*(BLOCK_M-1)``, so every shape is a function of ``(T, k,
   E, BLOCK_M)``: the whole path can be captured in a CUDA graph. Up to
   :data:`ALIGN_ONE_PROGRAM_MAX_PAIRS` pairs (decode) one single-program kernel does it
   (histogram in registers, scan of the padded group sizes, expert of every tile, sentinel
   fill, then the scatter of the pair ids through atomic per-expert cursors); above, three
   kernels spread the same steps over many programs (histogram with atomics into a zeroed
   counter + sentinel fill; scan + expert of every tile; scatter). The order inside a
   group is arbitrary, which no output depends on; :func:`moe_align_block_size_torch` is
   the same in ~25 torch ops (stable order; the tests' reference).
2. **GEMM** (``_fused_moe_gemm_kernel``), launched twice: each program takes one
   ``BLOCK_M`` tile of one expert and one ``BLOCK_N`` tile of the output columns, gathers
   its rows of ``A`` through ``sorted_ids`` (``row = pair // A_ROW_DIV``: the token for the
   first GEMM, the pair for the second), reads the expert's weight tile once, accumulates
   over ``K`` in fp32 and writes the rows of its pairs (output indexed by pair id). The
   grid covers the bound; programs past ``num_padded`` exit at once. A ``GROUP_M`` swizzle
   keeps the tiles sharing a weight tile close in time (L2 reuse when an expert has
   several tiles).

   * ``x [T, H] @ w13[e].T`` (gate rows then up rows) with
     :func:`tandem.layers.fused_ops.silu_and_mul` in the epilogue -> ``[T*k, I]`` (each
     program reads the gate and the up tile of its columns; the products are rounded to
     the storage dtype first, so the result is bit-equal to the GEMM then the op);
   * ``h [T*k, I] @ w2[e].T -> [T*k, H]``, times the pair's routing weight (fp32, in the
     epilogue).
3. **Reduction** (``_moe_sum_kernel``): ``out[t] = sum_j y[t*k + j]`` over the slots with a
   valid expert id, in fp32, one program per (token, column tile); no atomics and no
   zero-fill of ``y`` (rows of pairs with id ``-1`` are never written nor read). An
   optional ``addend`` (DeepSeek's shared experts' output) is added to the rounded sum in
   the same kernel.

Pairs whose local expert id is ``-1`` (expert owned by another rank, see
:mod:`tandem.distributed.all2all`) get no row in ``sorted_ids`` and contribute nothing; a
token without a valid slot gets zeros.

Nothing syncs with the host and every grid is sized from shapes; the constexpr
specialisations depend on the feature sizes, top-k, tiles and dtypes, never on the number
of tokens (:func:`default_config` picks one of a few tile configurations from it), so a
serving run compiles a handful of variants, not one per batch size.

Entry point: :func:`fused_experts_triton` (same contract as
:func:`tandem.layers.moe.grouped_experts`); ``grouped_experts(..., impl="triton")`` calls
it. Storage dtypes fp16 / bf16 / fp32 (fp32 dots in IEEE precision, for tests); any
``E``, ``H``, ``I`` (masked tails), top-k 1..8 (anything >= 1 works). Under
``TRITON_INTERPRET=1`` the kernels run on the CPU (bf16 dots upcast to fp32 there). The
tile sizes are arguments; the defaults (:data:`TILE_CONFIGS`) were tuned on an H200 at the
DeepSeek-V2-Lite expert shape (other GPUs or shapes: re-run
``benchmarks/moe_grouped_gemm.py --sweep``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers.fused_ops import silu_and_mul
from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

SUM_BLOCK = 1024  # columns per program of the k-way reduction
ALIGN_BLOCK = 1024  # pairs per program (per loop step of the single-program kernel) of the alignment
# Up to this many (token, expert) pairs the alignment is one single-program kernel; above
# it three kernels spread it. The bound is from an H200 run of benchmarks/moe_layer.py
# --parts whose figures were not recorded (benchmarks/RESULTS.md, "Session 8, unrecorded").
ALIGN_ONE_PROGRAM_MAX_PAIRS = 2048
# The first GEMM applies SiLU-and-mul in its epilogue (writes h [T*k, I], no [T*k, 2I]
# round trip, one kernel less); False: GEMM then tandem.layers.fused_ops.silu_and_mul's
# kernel (the path before, kept for benchmarks/moe_layer.py's comparison).
FUSE_SILU_MUL = True

# Launch configurations by mean rows per expert (``T*k / E``): (upper bound of the mean,
# block_m, block_n, block_k, group_m, num_warps, num_stages). BLOCK_M >= 16 (tl.dot's
# minimum). Tuned on an H200 at the DeepSeek-V2-Lite expert shape (E=64, k=6, H=2048,
# I=1408, bf16; `benchmarks/moe_grouped_gemm.py --preset v2-lite --graph --sweep`, 16 to
# 8192 tokens; figures in benchmarks/RESULTS.md): in the decode regime an expert holds about
# one tile of rows, so BLOCK_M 16-32 wastes the least padding and wide N/K tiles keep enough
# weight bytes in flight; from ~100 rows per expert up, 128-row tiles let one weight tile
# serve more rows.
TILE_CONFIGS = (
    (8, 16, 128, 128, 8, 4, 3),
    (48, 32, 128, 128, 8, 4, 3),
    (192, 128, 128, 64, 8, 8, 3),
    (float("inf"), 128, 256, 64, 8, 8, 3),
)
_CONFIG_KEYS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


# Deterministic mode's one configuration, whatever the batch (the large-batch one: the mode
# is for throughput runs of evaluations and rollouts): a token's sums never depend on how
# many rows its expert got.
DETERMINISTIC_TILE_CONFIG = TILE_CONFIGS[2][1:]


def default_config(num_pairs: int, num_experts: int, deterministic: bool = False) -> dict[str, int]:
    """The launch configuration of :data:`TILE_CONFIGS` for ``num_pairs`` (token, expert)
    pairs over ``num_experts`` experts (host ints from shapes: no sync); in deterministic
    mode (``deterministic``, :mod:`tandem.layers.batch_invariant`)
    :data:`DETERMINISTIC_TILE_CONFIG` for any count."""
    if deterministic:
        return dict(zip(_CONFIG_KEYS, DETERMINISTIC_TILE_CONFIG))
    mean = num_pairs / max(1, num_experts)
    row = next(r for r in TILE_CONFIGS if mean <= r[0])
    return dict(zip(_CONFIG_KEYS, row[1:]))


# ---------------------------------------------------------------------------- kernels
# Pair, tile and bound counts follow each step's token count: the kernels are not
# specialised on them (== 1, % 16), so a prefill size first met mid-run compiles nothing.


@triton.jit
def _weight_tile_dot(a, b_ptrs, b_mask, s_rows_ptr, s_mask, k0, stride_sk, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, SCALE_MODE: tl.constexpr, SCALE_BK: tl.constexpr):
    """``a @ b`` of one K step for a weight tile in any storage mode (block scales applied
    here; per-channel ones in the epilogue)."""
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if SCALE_MODE == 0:
        res = _dot(a, b, PRECISION, UPCAST)
    elif SCALE_MODE == 1:
        res = _dot(a, b.to(a.dtype), PRECISION, UPCAST)
    else:
        s = tl.load(s_rows_ptr + (k0 // SCALE_BK) * stride_sk, mask=s_mask, other=0.0)
        res = _dot(a, b.to(a.dtype), PRECISION, UPCAST) * s[None, :]
    return res


@triton.jit(do_not_specialize=["num_pairs", "num_m_tiles"])
def _fused_moe_gemm_kernel(
    a_ptr,  # [rows, K]: x (A_ROW_DIV = top_k) or h (A_ROW_DIV = 1)
    b_ptr,  # [E, N, K] expert weights (w13 or w2); [E, 2N, K] with SILU_MUL (gate rows, up rows)
    c_ptr,  # [num_pairs, N] output, row = flat pair id
    topk_w_ptr,  # [num_pairs] fp32 routing weights (read iff MUL_WEIGHT)
    sorted_ids_ptr,  # [bound] int32 pair id of each padded row (num_pairs = padding)
    tile_experts_ptr,  # [num_tiles_bound] int32 expert of each BLOCK_M tile
    num_padded_ptr,  # [1] int32 padded rows in use
    num_pairs,
    num_m_tiles,  # cdiv(bound, BLOCK_M): the grid's M extent (runtime: no recompile per batch size)
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    s_ptr,  # FP8 weight scales: [E, N] (SCALE_MODE 1) or [E, N/SCALE_BN, K/SCALE_BK] (2) (2N with SILU_MUL)
    stride_se,
    stride_sn,
    stride_sk,
    N: tl.constexpr,  # output columns (a model constant: specialised, as are K and the tiles)
    K: tl.constexpr,  # reduction depth
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALE_MODE: tl.constexpr = 0,  # 0: b in a's dtype; 1: FP8 b, per-channel; 2: FP8 b, block scales
    SCALE_BN: tl.constexpr = 128,
    SCALE_BK: tl.constexpr = 128,  # a multiple of BLOCK_K: each K tile has one scale per column
    SILU_MUL: tl.constexpr = False,  # c = silu(a @ gate.T) * (a @ up.T), gate = b[:, :N], up = b[:, N:]
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    # Swizzle: GROUP_M consecutive M tiles walk the N tiles together.
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return  # past the last real tile (the grid covers the static bound)

    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    s_rows = s_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn
    up_ptrs = b_ptrs + N * stride_bn
    s_up_rows = s_ptr + expert * stride_se + ((offs_n + N) // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_valid[:, None], other=0.0)
            b_mask = n_valid[None, :]
        else:
            k_valid = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b_mask = n_valid[None, :] & k_valid[:, None]
        acc += _weight_tile_dot(a, b_ptrs, b_mask, s_rows, n_valid, k0, stride_sk, PRECISION, UPCAST, SCALE_MODE,
                                SCALE_BK)
        if SILU_MUL:
            acc_up += _weight_tile_dot(a, up_ptrs, b_mask, s_up_rows, n_valid, k0, stride_sk, PRECISION, UPCAST,
                                       SCALE_MODE, SCALE_BK)
            up_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SCALE_MODE == 1:
        s = tl.load(s_ptr + expert * stride_se + offs_n * stride_sn, mask=n_valid, other=0.0)
        acc = acc * s[None, :]
        if SILU_MUL:
            s_up = tl.load(s_ptr + expert * stride_se + (offs_n + N) * stride_sn, mask=n_valid, other=0.0)
            acc_up = acc_up * s_up[None, :]
    if SILU_MUL:
        # The gate/up products rounded to the storage dtype, then silu_and_mul's arithmetic
        # (tandem.layers.fused_ops): bit-equal to the GEMM writing [T*k, 2N] followed by it.
        g = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        u = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = act * u
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr,  # [T*k, H] weighted expert outputs (rows of invalid pairs: garbage, never read)
    ids_ptr,  # [T*k] expert ids (-1 = skip)
    out_ptr,  # [T, H]
    addend_ptr,  # [T, H] added to the rounded sum (read iff HAS_ADDEND)
    H,
    stride_ym,
    stride_om,
    stride_am,
    TOP_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_valid = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        eid = tl.load(ids_ptr + tok * TOP_K + j)
        y = tl.load(y_ptr + (tok * TOP_K + j) * stride_ym + cols, mask=col_valid & (eid >= 0), other=0.0)
        acc += y.to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADDEND:
        # ``routed + addend`` in the storage dtype, as torch adds the two tensors.
        a = tl.load(addend_ptr + tok * stride_am + cols, mask=col_valid, other=0.0)
        out = (out.to(tl.float32) + a.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * stride_om + cols, out, mask=col_valid)


@triton.jit(do_not_specialize=["num_pairs", "bound"])
def _align_count_kernel(
    ids_ptr,  # [num_pairs] expert ids (-1 = skip)
    counts_ptr,  # [num_experts] int32, zeroed: rows per expert (atomically accumulated)
    sorted_ids_ptr,  # [bound] int32: filled with the sentinel num_pairs
    num_pairs,
    bound,
    num_experts,
    NUM_BINS: tl.constexpr,  # power of two > num_experts (bin num_experts: invalid pairs)
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ids_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=offs < bound)
    if tl.program_id(0) * BLOCK < num_pairs:
        in_range = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=in_range, other=-1)
        valid = in_range & (e >= 0)
        hist = tl.histogram(tl.where(valid, e, num_experts).to(tl.int32), NUM_BINS)
        bins = tl.arange(0, NUM_BINS)
        tl.atomic_add(counts_ptr + bins, hist.to(tl.int32), mask=bins < num_experts)


@triton.jit(do_not_specialize=["num_tiles"])
def _align_offsets_kernel(
    counts_ptr,  # [num_experts] int32 rows per expert
    cursor_ptr,  # [num_experts] int32 out: padded start of each expert's group
    tile_experts_ptr,  # [num_tiles] int32 out: expert of each tile (num_experts past the end)
    num_padded_ptr,  # [1] int32 out
    num_experts,
    num_tiles,
    NUM_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Every program recomputes the (tiny) exclusive scan of the padded group sizes.
    bins = tl.arange(0, NUM_BINS)
    bin_valid = bins < num_experts
    counts = tl.load(counts_ptr + bins, mask=bin_valid, other=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + bins, ends - padded, mask=bin_valid)
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    tiles = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # expert of a tile = number of groups ending at or before its first row
    done = (ends[None, :] <= (tiles * BLOCK_M)[:, None]) & bin_valid[None, :]
    tl.store(tile_experts_ptr + tiles, tl.sum(done.to(tl.int32), 1), mask=tiles < num_tiles)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(
    ids_ptr,  # [num_pairs] expert ids (-1 = skip)
    cursor_ptr,  # [num_experts] int32 next free padded row of each expert (atomically bumped)
    sorted_ids_ptr,  # [bound] int32 out
    num_pairs,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (e >= 0)
    row = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), tl.full((BLOCK,), 1, tl.int32), mask=valid)
    tl.store(sorted_ids_ptr + row, offs.to(tl.int32), mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "bound", "num_tiles"])
def _align_one_program_kernel(
    ids_ptr,  # [num_pairs] expert ids (-1 = skip)
    cursor_ptr,  # [num_experts] int32 scratch: next free padded row of each expert
    sorted_ids_ptr,  # [bound] int32 out
    tile_experts_ptr,  # [num_tiles] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    bound,
    num_experts,
    num_tiles,
    NUM_BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # The three kernels above in one program, for decode sizes: the counts stay in
    # registers (no zeroed buffer), and barriers replace the launch boundaries.
    bins = tl.arange(0, NUM_BINS)
    bin_valid = bins < num_experts
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.histogram(tl.where(e >= 0, e, num_experts).to(tl.int32), NUM_BINS)
    counts = tl.where(bin_valid, counts, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded, mask=bin_valid)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        done = (ends[None, :] <= (tiles * BLOCK_M)[:, None]) & bin_valid[None, :]
        tl.store(tile_experts_ptr + tiles, tl.sum(done.to(tl.int32), 1), mask=tiles < num_tiles)
    for start in range(0, bound, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ids_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=offs < bound)
    # The cursors and the sentinel rows must be written before any thread scatters.
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        valid = (offs < num_pairs) & (e >= 0)
        row = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), tl.full((BLOCK,), 1, tl.int32), mask=valid)
        tl.store(sorted_ids_ptr + row, offs.to(tl.int32), mask=valid)


# -------------------------------------------------------------------------- alignment


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_block_size_torch` in Triton, no host sync: up to
    :data:`ALIGN_ONE_PROGRAM_MAX_PAIRS` pairs one single-program launch, above it three
    kernels (count, scan, scatter) and the counter memset, which spread the pairs over
    many programs. Rows of one expert are in no particular order (atomic slots): each
    output row only depends on its own input row, so the results are the same."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    bound = num_pairs + num_experts * (block_m - 1)
    sorted_ids = torch.empty(bound, dtype=torch.int32, device=flat.device)
    tile_experts = torch.empty(triton.cdiv(bound, block_m), dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    align = _align_one_program if num_pairs <= ALIGN_ONE_PROGRAM_MAX_PAIRS else _align_three_kernels
    align(flat, num_experts, block_m, sorted_ids, tile_experts, num_padded)
    return sorted_ids, tile_experts, num_padded


def _tiles_per_program(num_bins: int) -> int:
    return max(16, min(128, 8192 // num_bins))


def _align_one_program(flat: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                       tile_experts: torch.Tensor, num_padded: torch.Tensor) -> None:
    num_bins = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    _align_one_program_kernel[(1,)](flat, cursor, sorted_ids, tile_experts, num_padded, flat.numel(),
                                    sorted_ids.numel(), num_experts, tile_experts.numel(), NUM_BINS=num_bins,
                                    BLOCK_M=block_m, BLOCK=ALIGN_BLOCK, BLOCK_T=_tiles_per_program(num_bins),
                                    num_warps=8)


def _align_three_kernels(flat: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                         tile_experts: torch.Tensor, num_padded: torch.Tensor) -> None:
    device = flat.device
    num_pairs, bound, num_tiles = flat.numel(), sorted_ids.numel(), tile_experts.numel()
    num_bins = triton.next_power_of_2(num_experts + 1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    _align_count_kernel[(triton.cdiv(bound, ALIGN_BLOCK),)](flat, counts, sorted_ids, num_pairs, bound, num_experts,
                                                            NUM_BINS=num_bins, BLOCK=ALIGN_BLOCK)
    block_t = _tiles_per_program(num_bins)
    _align_offsets_kernel[(triton.cdiv(num_tiles, block_t),)](counts, cursor, tile_experts, num_padded, num_experts,
                                                              num_tiles, NUM_BINS=num_bins, BLOCK_M=block_m,
                                                              BLOCK_T=block_t)
    if num_pairs:
        _align_scatter_kernel[(triton.cdiv(num_pairs, ALIGN_BLOCK),)](flat, cursor, sorted_ids, num_pairs,
                                                                      BLOCK=ALIGN_BLOCK)


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int,
                               block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the pairs of ``topk_ids [T, k]`` (local ids, ``-1`` = skip) by expert and pad
    each expert's group to a multiple of ``block_m``; torch ops only, no host sync.

    Returns:
        ``sorted_ids [T*k + E*(block_m-1)]`` int32: flat pair id of each padded row
        (stable order inside an expert), ``T*k`` in padding rows and past the end;
        ``tile_experts [cdiv(len(sorted_ids), block_m)]`` int32: expert of each tile
        (``E`` for tiles past the end); ``num_padded [1]`` int32: padded rows in use
        (a multiple of ``block_m``).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    bound = num_pairs + num_experts * (block_m - 1)
    keyed = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    # index_add_, not bincount: CUDA bincount reads the max id on the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, keyed, torch.ones_like(keyed))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded[num_experts] = 0  # invalid pairs get no rows
    pad_ends = padded.cumsum(0)
    pad_starts = pad_ends - padded
    group_starts = counts.cumsum(0) - counts
    order = torch.argsort(keyed, stable=True)
    sorted_keys = keyed[order]
    # Row r of the sort, expert e, goes to pad_starts[e] + (r - group_starts[e]); invalid
    # pairs (e = E) go to a spare slot past the bound, cut off below.
    dest = pad_starts[sorted_keys] + torch.arange(num_pairs, device=device) - group_starts[sorted_keys]
    dest = torch.where(sorted_keys < num_experts, dest, torch.full_like(dest, bound))
    sorted_ids = torch.full((bound + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    num_tiles = triton.cdiv(bound, block_m)
    tile_starts = torch.arange(num_tiles, device=device, dtype=torch.int64) * block_m
    tile_experts = torch.searchsorted(pad_ends[:num_experts], tile_starts, right=True).to(torch.int32)
    return sorted_ids[:bound], tile_experts, pad_ends[num_experts - 1:num_experts].to(torch.int32)


# ----------------------------------------------------------------------------- launch


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_w: torch.Tensor | None, sorted_ids: torch.Tensor,
          tile_experts: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_row_div: int, block_m: int,
          block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int,
          scale: torch.Tensor | None = None, scale_block: tuple[int, int] | None = None,
          silu_mul: bool = False) -> None:
    n, k = b.shape[1] // 2 if silu_mul else b.shape[1], b.shape[2]
    num_m_tiles = tile_experts.shape[0]
    grid = (num_m_tiles * triton.cdiv(n, block_n),)
    mode = 0 if scale is None else (1 if scale_block is None else 2)
    s_strides = (0, 0, 0) if scale is None else (*scale.stride(), 0)[:3]
    sbn, sbk = scale_block or (128, 128)
    _fused_moe_gemm_kernel[grid](
        a, b, c, topk_w if topk_w is not None else c, sorted_ids, tile_experts, num_padded,
        num_pairs, num_m_tiles,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        scale if scale is not None else c, *s_strides,
        SCALE_MODE=mode, SCALE_BN=sbn, SCALE_BK=sbk,
        N=n, K=k, A_ROW_DIV=a_row_div, MUL_WEIGHT=topk_w is not None, EVEN_K=k % block_k == 0, SILU_MUL=silu_mul,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and a.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
                         block_k: int | None = None, group_m: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, scales=None,
                         addend: torch.Tensor | None = None, deterministic: bool = False) -> torch.Tensor:
    """SwiGLU experts with the fused-MoE Triton kernel (contract of
    :func:`tandem.layers.moe.grouped_experts`).

    Args:
        x: ``[T, H]`` tokens (fp16 / bf16 / fp32).
        topk_ids: ``[T, k]`` integer local expert ids in ``[0, E)``; ``-1`` skips a slot.
        topk_weights: ``[T, k]`` routing weights (applied in fp32).
        w13: ``[E, 2I, H]`` gate (rows ``:I``) and up (rows ``I:``) projections.
        w2: ``[E, H, I]`` down projections.
        block_m: rows per expert tile (power of two >= 16).
        block_n, block_k: output columns and reduction depth per program (powers of two
            >= 16), shared by both GEMMs.
        group_m: M tiles per swizzle group; num_warps, num_stages: launch settings.
            Each launch setting left ``None`` comes from :func:`default_config` (with
            ``deterministic``: the one configuration of deterministic mode).
        scales: :class:`tandem.layers.moe.ExpertScales` of float8_e4m3fn ``w13``/``w2``
            (W8A16: weight tiles are converted to ``x.dtype`` in the kernel; per-channel
            scales multiply the accumulator in the epilogue, block scales each K tile's
            product, so ``block_k`` is capped at the scale block's ``bk``).
        addend: optional ``[T, H]`` tensor in ``x.dtype`` (unit stride along ``H``; the
            shared experts' output) added in the reduction kernel: the result is
            ``routed + addend`` rounded as the two tensors' torch sum.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over the
        valid slots (zeros for a token with none), plus ``addend``; the ``k`` terms are
        summed in fp32.

    Raises:
        ValueError: unsupported dtype, shape mismatch, bad tile sizes, or CPU tensors
            without the interpreter.
    """
    if not x.is_cuda and not _INTERPRET:
        raise ValueError("fused_experts_triton: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 "
                         "set before tandem.layers.fused_moe_triton is imported)")
    wdtype = x.dtype if scales is None else torch.float8_e4m3fn
    if x.dtype not in _SUPPORTED_DTYPES or w13.dtype != wdtype or w2.dtype != wdtype:
        raise ValueError(f"fused_experts_triton: x/w13/w2 must share one of {_SUPPORTED_DTYPES}, got "
                         f"{x.dtype}/{w13.dtype}/{w2.dtype}")
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    if (w13.shape[2] != hidden or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, inter)
            or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"fused_experts_triton: shapes x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps,
                 num_stages=num_stages)
    defaults = default_config(num_pairs, num_experts, deterministic)
    cfg = {key: v if v is not None else defaults[key] for key, v in given.items()}
    sblock = None if scales is None else scales.block
    if sblock is not None:
        cfg["block_k"] = min(cfg["block_k"], sblock[1])
        if sblock[1] % cfg["block_k"]:
            raise ValueError(f"fused_experts_triton: block_k={cfg['block_k']} must divide the FP8 scale block {sblock}")
    for name in ("block_m", "block_n", "block_k"):
        v = cfg[name]
        if v < 16 or v & (v - 1):
            raise ValueError(f"fused_experts_triton: {name}={v} must be a power of two >= 16")
    if cfg["group_m"] < 1:
        raise ValueError(f"fused_experts_triton: group_m={cfg['group_m']} must be >= 1")
    if addend is not None and (addend.shape != (num_tokens, hidden) or addend.dtype != x.dtype
                               or (hidden and addend.stride(1) != 1)):
        raise ValueError(f"fused_experts_triton: addend {tuple(addend.shape)} {addend.dtype} vs x "
                         f"{tuple(x.shape)} {x.dtype} (unit stride along H)")
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_pairs == 0 or hidden == 0:
        return out.zero_() if addend is None else out.copy_(addend)
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, tile_experts, num_padded = moe_align_block_size(topk_ids, num_experts, cfg["block_m"])
    # Rows of invalid pairs stay unwritten (torch.empty): never read as GEMM inputs of a
    # valid pair, and masked by the reduction.
    s13, s2 = (None, None) if scales is None else (scales.w13, scales.w2)
    if FUSE_SILU_MUL:
        # Half the output columns per program: each reads a gate and an up tile, the same
        # weight bytes as one tile of the unfused GEMM.
        h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        _gemm(x, w13, h, None, sorted_ids, tile_experts, num_padded, num_pairs, top_k,
              **dict(cfg, block_n=max(16, cfg["block_n"] // 2)), scale=s13, scale_block=sblock, silu_mul=True)
    else:
        gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
        _gemm(x, w13, gate_up, None, sorted_ids, tile_experts, num_padded, num_pairs, top_k, **cfg, scale=s13,
              scale_block=sblock)
        # The op's kernel in any fused-ops mode: this whole function is the Triton path, and
        # the epilogue above (the default) ignores the mode too.
        h = silu_and_mul(gate_up, mode="triton")
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    w_flat = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gemm(h, w2, y, w_flat, sorted_ids, tile_experts, num_padded, num_pairs, 1, **cfg, scale=s2, scale_block=sblock)
    ids_flat = topk_ids.reshape(-1).contiguous()
    block = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, ids_flat, out, addend if addend is not None else out, hidden, y.stride(0), out.stride(0),
        addend.stride(0) if addend is not None else 0, TOP_K=top_k, HAS_ADDEND=addend is not None, BLOCK=block,
        num_warps=max(1, min(4, block // 256)))
    return out
