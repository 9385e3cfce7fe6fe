"""Paged multi-head latent attention (MLA) decode in Triton.

The decode half of DeepSeek-V2's MLA (:mod:`tandem.layers.mla`) with *absorbed* weights:
``kv_b_proj``'s key half is folded into the query, so every head of a decode token
attends over the cached latents directly — multi-query attention with one shared "KV
head" per token, keys ``[c_kv, k_pe]`` (``kv_lora_rank + rope_dim``) and values ``c_kv``
(``kv_lora_rank``). The output stays in the latent space (``W_uv`` is applied by the
caller). As in FlashMLA (DeepSeek-AI, 2025) and vLLM's / SGLang's Triton MLA decode, the
heads are the rows of the matrix products, so each latent tile read from the cache serves
``BLOCK_H`` heads at once.

Cache layout (one tensor per layer, see :mod:`tandem.layers.mla`): ``kv_cache [1,
num_blocks, block_size, 1, kv_lora_rank + rope_dim]``, slot ``s = block * block_size +
offset`` holds ``concat(c_kv, k_pe)`` of one token; request ``r``'s token ``t`` lives in
physical block ``block_tables[r, t // block_size]``. Keys are mapped to their blocks one
by one, so any block size works.

Kernels (split-KV, as in Flash-Decoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding for
long-context inference", 2023):

* ``_mla_decode_kernel``: one program per (request, group of ``heads_per_program`` heads,
  KV segment); the group's heads are the first rows of a ``BLOCK_H``-row query tile (the
  rest masked). Scores ``q_lat . c_kv + q_pe . k_pe`` are two dots (``kv_lora_rank`` and
  ``rope_dim`` wide: 512 + 64 need no padding to 1024), the softmax is online in fp32 and
  base 2 (``log2(e)`` folded into the scale), ``acc += p @ c_kv`` (the ``c_kv`` tile is
  loaded once for both dots). The context of a request is cut into at most ``num_splits``
  segments of whole ``BLOCK_N`` tiles, each at least ``min_tiles_per_split`` tiles long, so
  short contexts use fewer segments than the grid has; the segment of a program is
  computed *inside* the kernel from ``seq_lens``, so the grid ``(num_reqs,
  cdiv(num_heads, heads_per_program), num_splits)`` depends only on host values fixed for
  a captured CUDA graph. Programs whose segment lies past the end of their sequence exit
  at once. With one split the kernel writes the normalised output directly.
* the dense backend's ``_decode_reduce_kernel`` (:mod:`tandem.attention.triton_backend`)
  combines the partial outputs of the non-empty segments by their log-sum-exp, one program
  per (request, head); the segmentation is the same.

Launch parameters come from :data:`DECODE_LAUNCH_TABLE` by batch size (tuned with
``benchmarks/mla_decode.py sweep``). Under CUDA-graph capture the split bound is the
block-table width (``max_model_len``), not the step's contexts, so a split count in the
table applies as is; the minimum segment length is what keeps short contexts unsplit.

Nothing syncs with the host: :func:`mla_decode_attention` uses only tensor shapes and the
optional host bound ``max_seq_len``.

Supported dtypes: fp16, bf16 and fp32 (``q_lat``, ``q_pe``, the cache and the output share
one); any ``kv_lora_rank`` / ``rope_dim`` (powers of two run unpadded). Under
``TRITON_INTERPRET=1`` the kernels run on the CPU (bf16 dots are upcast to fp32 there).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from tandem.attention.triton_backend import REDUCE_BLOCK_S, _decode_reduce_kernel
from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot
from tandem.triton_utils import program_slots

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)



@dataclasses.dataclass(frozen=True)
class MLADecodeLaunch:
    """Launch parameters of one decode batch-size range (a row of :data:`DECODE_LAUNCH_TABLE`).

    Attributes:
        max_batch: the row serves decode batches of up to this many requests (and more
            than the previous row's ``max_batch``).
        num_splits: KV segments per request, the grid's third dimension; ``None``: as many
            as fill the GPU in one wave (:func:`mla_num_splits`).
        min_tokens_per_split: a segment holds at least this many keys (rounded up to whole
            ``block_n`` tiles), so short contexts use fewer segments than ``num_splits``
            (the others exit at once); outside CUDA-graph capture it also caps the split
            count at ``ceil(max_seq_len / min_tokens_per_split)``.
        block_n: keys per inner iteration (a power of two >= 16).
        block_h: rows of a program's query tile (a power of two >= 16: ``tl.dot``'s minimum).
        heads_per_program: heads a program serves (<= ``block_h``; the other rows are
            masked). Fewer than ``block_h`` gives more programs without splitting the KV
            (no partial outputs to combine) at the cost of reading each latent tile once
            per head group (the later reads mostly from L2: the groups of a request run
            side by side).
        num_warps, num_stages: Triton launch options.
        maxnreg: register cap per thread (Triton's ``maxnreg``; 0: ptxas decides).
            65536 / (128 threads x 168) gives a 4-warp program a third slot per SM where
            shared memory allows (block_n 16).
    """

    max_batch: int
    num_splits: int | None
    min_tokens_per_split: int
    block_n: int
    block_h: int
    heads_per_program: int
    num_warps: int
    num_stages: int
    maxnreg: int = 0


#: Launch parameters by decode batch size; the first row whose ``max_batch`` covers the
#: batch applies (the last row serves any larger batch). For the DeepSeek-V2-Lite shape (16
#: heads, 512 + 64) on an H200; ``benchmarks/mla_decode.py sweep`` measures the launch space
#: and prints rows of this form to paste here; the rows were chosen from its runs over the
#: seed workload's mixed 128-384 contexts (and, up to 256 requests, 2048-token ones), and
#: benchmarks/RESULTS.md (sessions 8, 15 and 16) gives what each choice trades. Up to 112
#: requests, fewer than the GPU's program slots, the split heuristic fills one wave; the
#: minimum segment grows with the batch (one, two, four tiles), since small batches of short
#: contexts gain most from more programs and larger ones lose to the reduce. From 113 no
#: split (one program per request and head group, so no reduce kernel): splitting still pays
#: on long contexts there but costs the reduce and fp32 partials on short ones. From 513 a
#: register cap of 168 gives a third program per SM, and two pipeline stages leave the
#: capped kernel the fewest spills.
DECODE_LAUNCH_TABLE: tuple[MLADecodeLaunch, ...] = (
    MLADecodeLaunch(max_batch=8, num_splits=None, min_tokens_per_split=32, block_n=32, block_h=16,
                    heads_per_program=16, num_warps=4, num_stages=2),
    MLADecodeLaunch(max_batch=64, num_splits=None, min_tokens_per_split=64, block_n=32, block_h=16,
                    heads_per_program=16, num_warps=4, num_stages=2),
    MLADecodeLaunch(max_batch=112, num_splits=None, min_tokens_per_split=128, block_n=32, block_h=16,
                    heads_per_program=16, num_warps=4, num_stages=2),
    MLADecodeLaunch(max_batch=512, num_splits=1, min_tokens_per_split=32, block_n=32, block_h=16,
                    heads_per_program=16, num_warps=4, num_stages=5),
    MLADecodeLaunch(max_batch=1 << 31, num_splits=1, min_tokens_per_split=32, block_n=32, block_h=16,
                    heads_per_program=16, num_warps=4, num_stages=2, maxnreg=168),
)
#: Split-count heuristic bound (``num_splits=None``): at most this many segments.
MAX_NUM_SPLITS = 32
#: Resident programs per SM the split-count heuristic fills: what the register file holds
#: of the uncapped 4-warp program the heuristic's rows launch (offline ``ptxas``, RESULTS
#: session 15).
PROGRAMS_PER_SM = 2


def decode_launch(num_reqs: int, table: tuple[MLADecodeLaunch, ...] = DECODE_LAUNCH_TABLE) -> MLADecodeLaunch:
    """The row of ``table`` that serves a decode batch of ``num_reqs`` requests."""
    for row in table:
        if num_reqs <= row.max_batch:
            return row
    return table[-1]


# Split counts (and the partial-output strides) and the block-table width change with every
# step: not specialised on, so that one variant per launch row serves every step (see
# triton_backend._paged_decode_kernel).
@triton.jit(do_not_specialize=["num_splits", "min_tiles_per_split", "stride_lr", "stride_lh", "stride_btr"])
def _mla_decode_kernel(
    q_lat_ptr,
    q_pe_ptr,
    cache_ptr,
    out_ptr,  # final output (DIRECT) or fp32 partial outputs [R, H, S, KV_RANK]
    lse_ptr,  # fp32 partial log2-sum-exp [R, H, S] (unused when DIRECT)
    seq_lens_ptr,
    block_tables_ptr,
    num_heads,
    heads_per_program,  # <= BLOCK_H: the first heads_per_program rows of the tile are real heads
    num_splits,
    min_tiles_per_split,  # >= 1: segments hold at least this many BLOCK_N tiles
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cb,
    stride_cs,
    stride_or,
    stride_oh,
    stride_os,
    stride_lr,
    stride_lh,
    stride_btr,
    stride_btb,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # heads per program (>= 16: tl.dot minimum)
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    KV_RANK: tl.constexpr,  # kv_lora_rank
    ROPE_DIM: tl.constexpr,  # qk_rope_head_dim
    BLOCK_R: tl.constexpr,  # KV_RANK padded to a power of two >= 16
    BLOCK_P: tl.constexpr,  # ROPE_DIM padded to a power of two >= 16
    DIRECT: tl.constexpr,  # one split: write the normalised output, no reduce pass
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    req = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles_per_split)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    if not DIRECT:
        if tile_start >= tile_end:
            return  # segment past the end of this sequence; the reduce skips it

    rows = tl.arange(0, BLOCK_H)
    head = head_group * heads_per_program + rows
    head_valid = (rows < heads_per_program) & (head < num_heads)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    # Column masks only where the latent / rope width is padded (keeps loads vectorised).
    if BLOCK_R == KV_RANK:
        qr_mask = head_valid[:, None]
    else:
        qr_mask = head_valid[:, None] & (offs_r[None, :] < KV_RANK)
    if BLOCK_P == ROPE_DIM:
        qp_mask = head_valid[:, None]
    else:
        qp_mask = head_valid[:, None] & (offs_p[None, :] < ROPE_DIM)
    q_lat = tl.load(
        q_lat_ptr + req.to(tl.int64) * stride_qlt + head.to(tl.int64)[:, None] * stride_qlh + offs_r[None, :],
        mask=qr_mask, other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + req.to(tl.int64) * stride_qpt + head.to(tl.int64)[:, None] * stride_qph + offs_p[None, :],
        mask=qp_mask, other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_btr

    for tile in range(tile_start, tile_end):
        k_pos = tile * BLOCK_N + offs_n
        k_valid = k_pos < seq_len
        phys = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_btb, mask=k_valid, other=0).to(tl.int64)
        slot = cache_ptr + phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        if BLOCK_R == KV_RANK:
            c_mask = k_valid[:, None]
        else:
            c_mask = k_valid[:, None] & (offs_r[None, :] < KV_RANK)
        if BLOCK_P == ROPE_DIM:
            p_mask = k_valid[:, None]
        else:
            p_mask = k_valid[:, None] & (offs_p[None, :] < ROPE_DIM)
        # An FP8 cache (scale 1.0) is converted to q's dtype in registers.
        c_kv = tl.load(slot[:, None] + offs_r[None, :], mask=c_mask, other=0.0).to(q_lat.dtype)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(slot[:, None] + KV_RANK + offs_p[None, :], mask=p_mask, other=0.0).to(q_pe.dtype)
        s = _dot(q_lat, tl.trans(c_kv), PRECISION, UPCAST)
        s += _dot(q_pe, tl.trans(k_pe), PRECISION, UPCAST)
        s = tl.where(k_valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: each tile holds >= 1 valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(c_kv.dtype), c_kv, PRECISION, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty sequence (padding request): output 0
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + req.to(tl.int64) * stride_or + head.to(tl.int64)[:, None] * stride_oh + offs_r[None, :]
    if DIRECT:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qr_mask)
    else:
        tl.store(o_ptrs + split * stride_os, o, mask=qr_mask)
        lse = m_i + tl.log2(l_i)
        lse_off = req.to(tl.int64) * stride_lr + head.to(tl.int64) * stride_lh + split
        tl.store(lse_ptr + lse_off, lse, mask=head_valid)


def mla_num_splits(num_reqs: int, num_heads: int, max_len: int, device: torch.device, *, heads_per_program: int,
                   min_tokens_per_split: int, num_splits: int | None = None) -> int:
    """KV segments per request for a decode batch (host ints only, no sync):
    ``num_splits``, or if ``None`` as many as fill the GPU's program slots
    (:data:`PROGRAMS_PER_SM` per SM) in one wave, up to :data:`MAX_NUM_SPLITS`; at most one
    per ``min_tokens_per_split`` keys of ``max_len`` (a bound on the context lengths)."""
    if num_splits is None:
        programs = max(1, num_reqs * -(-num_heads // heads_per_program))
        slots = program_slots(device, PROGRAMS_PER_SM)
        # Rounded down: a grid a few programs larger than the slots runs a second wave, which
        # takes as long as the first.
        num_splits = max(1, min(slots // programs, MAX_NUM_SPLITS))
    return max(1, min(num_splits, -(-max_len // min_tokens_per_split)))


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    min_tokens_per_split: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    heads_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Absorbed-MLA decode attention over the paged latent cache (one query per request).

    Args:
        q_lat: ``[nd, H, R]`` absorbed query ``q_nope W_uk`` (``R = kv_lora_rank``); any
            strides with a unit last one (e.g. a transposed ``[H, nd, R]`` bmm output).
        q_pe: ``[nd, H, P]`` rotated RoPE query (``P = qk_rope_head_dim``), same dtype.
        kv_cache: ``[1, num_blocks, block_size, 1, R + P]`` latents ``concat(c_kv, k_pe)``,
            same dtype; slots contiguous in the last dim.
        block_tables: ``[>= nd, max_blocks]`` int32 physical block ids; row ``r`` serves
            request ``r`` (rows past ``nd`` are ignored).
        seq_lens: ``[>= nd]`` int32 context lengths (device), the new token included;
            0 gives a zero output.
        scale: softmax scale.
        out: optional ``[nd, H, R]`` output (any strides with a unit last one), q's dtype.
        max_seq_len: host upper bound on ``seq_lens[:nd]``, caps the split count outside
            CUDA-graph capture; ``None``: the block-table width. Under capture the split
            count depends only on ``nd``, ``H`` and the block-table width.
        num_splits, min_tokens_per_split, block_n, block_h, heads_per_program, num_warps,
            num_stages, maxnreg: launch
            parameters (see :class:`MLADecodeLaunch`); ``None`` takes them from the row of
            :data:`DECODE_LAUNCH_TABLE` for ``nd`` (the split count then goes through
            :func:`mla_num_splits`; a given ``num_splits`` is used as is).
        deterministic: batch-invariant mode (the caller's): the last row of
            :data:`DECODE_LAUNCH_TABLE` whatever ``nd``, and one split unless
            ``num_splits`` is given, so a request's reduction order does not follow the batch.

    Returns:
        ``[nd, H, R]`` attention output in the latent space (before ``W_uv``), q's dtype.

    Raises:
        ValueError: unsupported dtypes or inconsistent shapes.
    """
    nd, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    _, _, block_size, _, width = kv_cache.shape
    if q_pe.shape[:2] != (nd, num_heads):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)}")
    if width != rank + rope or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [1, blocks, block_size, 1, {rank} + {rope}]")
    if block_tables.dim() != 2 or block_tables.shape[0] < nd or seq_lens.shape[0] < nd:
        # The kernels index rows 0..nd-1 of both without bounds checks.
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"need >= {nd} rows")
    if (q_lat.dtype not in _SUPPORTED_DTYPES or q_pe.dtype != q_lat.dtype
            or kv_cache.dtype not in (q_lat.dtype, torch.float8_e4m3fn)):
        raise ValueError(f"unsupported dtypes q_lat={q_lat.dtype} q_pe={q_pe.dtype} kv_cache={kv_cache.dtype}")
    # Deterministic mode: one launch row whatever the batch, so a request's tiles, and with
    # them its reduction order, do not follow the batch size.
    row = DECODE_LAUNCH_TABLE[-1] if deterministic else decode_launch(nd)
    block_n = block_n or row.block_n
    min_tokens_per_split = min_tokens_per_split or row.min_tokens_per_split
    # A given block_h serves as many heads unless told otherwise.
    heads_per_program = heads_per_program or (row.heads_per_program if block_h is None else block_h)
    block_h = block_h or row.block_h
    for name, val in (("block_n", block_n), ("block_h", block_h)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if not 1 <= heads_per_program <= block_h:
        raise ValueError(f"heads_per_program must be in [1, block_h={block_h}], got {heads_per_program}")
    if out is None:
        out = torch.empty(nd, num_heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    elif out.shape != (nd, num_heads, rank) or out.dtype != q_lat.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not [{nd}, {num_heads}, {rank}] {q_lat.dtype}")
    if nd == 0:
        return out
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("out and kv_cache need a unit stride in the last dim")

    cache = kv_cache[0, :, :, 0]  # [num_blocks, block_size, R + P]
    head_groups = -(-num_heads // heads_per_program)
    if num_splits is None and deterministic:
        num_splits = 1  # deterministic mode: segment boundaries independent of the batch
    if num_splits is None:
        bound = block_tables.shape[1] * block_size
        capturing = q_lat.is_cuda and torch.cuda.is_current_stream_capturing()
        if max_seq_len is not None and not capturing:
            bound = min(bound, max_seq_len)
        num_splits = mla_num_splits(nd, num_heads, bound, q_lat.device, heads_per_program=heads_per_program,
                                    min_tokens_per_split=min_tokens_per_split, num_splits=row.num_splits)
    min_tiles_per_split = -(-min_tokens_per_split // block_n)
    direct = num_splits == 1
    if direct:
        part_out, lse = out, out
        po_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part_out = torch.empty(nd, num_heads, num_splits, rank, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(nd, num_heads, num_splits, dtype=torch.float32, device=q_lat.device)
        po_strides, lse_strides = part_out.stride()[:3], lse.stride()[:2]
    block_r = max(16, triton.next_power_of_2(rank))
    block_p = max(16, triton.next_power_of_2(rope))
    _mla_decode_kernel[(nd, head_groups, num_splits)](
        q_lat, q_pe, cache, part_out, lse, seq_lens, block_tables,
        num_heads, heads_per_program, num_splits, min_tiles_per_split, scale * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), *po_strides, *lse_strides,
        block_tables.stride(0), block_tables.stride(1),
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_N=block_n, KV_RANK=rank, ROPE_DIM=rope,
        BLOCK_R=block_r, BLOCK_P=block_p, DIRECT=direct,
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRET and q_lat.dtype == torch.bfloat16,
        num_warps=num_warps or row.num_warps, num_stages=num_stages or row.num_stages,
        maxnreg=(row.maxnreg if maxnreg is None else maxnreg) or None,
    )
    if not direct:
        _decode_reduce_kernel[(nd, num_heads)](
            part_out, lse, out, seq_lens, num_splits, min_tiles_per_split,
            *part_out.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            BLOCK_N=block_n, BLOCK_S=REDUCE_BLOCK_S, DIM=rank, BLOCK_D=block_r,
            num_warps=4,
        )
    return out
