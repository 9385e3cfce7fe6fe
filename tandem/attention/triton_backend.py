"""Paged attention in Triton: the CUDA backend.

Two kernels read K/V straight out of the paged cache through the block tables (layout in
:mod:`tandem.attention.metadata`):

* ``_paged_prefill_kernel`` handles every non-decode request of the step: variable-length
  queries, each attending causally to its whole sequence, cached prefix / earlier chunks
  included (query ``i`` of request ``r`` sits at position ``num_computed_tokens[r] + i``).
  It is a FlashAttention-2 style kernel (Dao, "FlashAttention-2: Faster Attention with
  Better Parallelism and Work Partitioning", 2023): one program owns a tile of query rows,
  streams the keys/values in tiles, and keeps an online softmax (running max, running sum,
  fp32 accumulator), so the score matrix never leaves registers. With grouped-query
  attention the rows of a tile are ``(token, q head)`` pairs of several q heads sharing one
  kv head, so each K/V tile loaded serves all of them.

* ``_paged_decode_kernel`` + ``_decode_reduce_kernel`` handle the leading
  ``num_decode_reqs`` requests (one query each) with split-KV, as in Flash-Decoding (Dao,
  Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023): the context of
  a request is cut into ``num_splits`` segments, one program per (request, kv head,
  segment) computes a partial softmax (log-sum-exp + normalised partial output) for the
  q heads of that kv head, and a second kernel combines the partials. The segment length
  is computed *inside* the kernel from ``seq_lens``, so the grid is
  ``(num_decode_reqs, num_kv_heads, num_splits)`` and ``num_splits`` depends only on host
  values that are fixed for a captured CUDA graph (number of decode requests, head counts,
  constructor limits); programs whose segment lies past the end of their sequence exit
  early and the reduce kernel ignores them.

In deterministic mode (``--deterministic``) every request, decode ones included, goes
through ``_paged_prefill_kernel``, compiled without FMA contraction: its key tiles start at
position 0 and a row's masked keys add exact zeros, so a token's output is the same bits
whatever the batch, the chunking, the prefix-cache hit or the phase (the tile shapes depend
only on head_dim and the GQA ratio).

``forward`` first writes the step's new K/V into the cache
(:func:`tandem.attention.triton_reshape_and_cache.reshape_and_cache`, one kernel), then runs
the decode and prefill kernels. It makes no host sync: it uses only the host ints already in the metadata.

An FP8 cache (``--kv-cache-dtype fp8``) is read as float8 tiles converted to q's dtype in
registers (half the KV bytes of bf16; a bf16 q is rounded to fp16 first, whose conversion
from e4m3 is one instruction); ``k_scale`` folds into the softmax scale and
``v_scale`` into the output normalisation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.triton_reshape_and_cache import reshape_and_cache
from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot
from tandem.triton_utils import program_slots

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _f16_query(q):
    """q saturated to fp16's range and rounded to fp16 (exact for bf16 values inside it), so
    that FP8 K/V tiles convert to q's dtype with one hardware instruction: e4m3 -> fp16
    is native on sm_89+, e4m3 -> bf16 goes through fp32. e4m3 values are exact in fp16,
    and p in [0, 1] keeps more mantissa in fp16 than in bf16."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


# The first prefill request's index changes with every step's decode count, and the block-table
# width with its longest context (eager steps pass the step's own width): specialising on them
# (== 1, % 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["req_offset", "stride_btr"])
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_computed_ptr,
    block_tables_ptr,
    req_offset,
    qk_scale,  # softmax scale * log2(e) (* k_scale of an FP8 cache): the kernel works in base 2
    v_scale,  # FP8 cache: the values' scale, applied to the output (1.0 otherwise)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btr,
    stride_btb,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GQA: tl.constexpr,  # q heads per kv head
    HEADS_PER_PROG: tl.constexpr,  # q heads of one kv head handled by one program
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    F16_DOTS: tl.constexpr,  # bf16 q over an FP8 cache: both dots in fp16 (see _f16_query)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS_PER_PROG
    q_block = tl.program_id(0)
    req = tl.program_id(1) + req_offset
    head_group = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = tl.load(num_computed_ptr + req)

    first_head = head_group * HEADS_PER_PROG
    kv_head = first_head // GQA

    # Rows of the tile: (token, head) pairs, head fastest.
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // HEADS_PER_PROG
    head = first_head + offs_m % HEADS_PER_PROG
    row_valid = tok < q_len
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if F16_DOTS:
        q = _f16_query(q)
    q_pos = ctx_len + tok  # position of each row's token in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_btr
    head_off = kv_head.to(tl.int64) * stride_ch

    # Keys every row of the tile sees (position <= the tile's first token): no mask.
    first_pos = ctx_len + q_block * BLOCK_Q
    n_full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    # Last key any row of the tile sees.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len))

    for start_n in range(0, n_full, BLOCK_N):
        k_pos = start_n + offs_n
        phys = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_btb).to(tl.int64)
        kv_off = phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :]).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :]).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    # Diagonal tiles: causal mask and sequence end.
    for start_n in range(n_full, kv_end, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < kv_end
        phys = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_btb, mask=k_valid, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Every row sees key 0, so m_new is finite after the first tile; guard anyway.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * v_scale
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# Split counts change with every step's batch and contexts, and the partial-output strides
# with them, as does the block-table width (see _paged_prefill_kernel): specialising on them
# (== 1, % 16) would build kernel variants mid-serving.
@triton.jit(do_not_specialize=["num_splits", "stride_lr", "stride_lh", "stride_btr"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # final output (DIRECT) or fp32 partial outputs [R, Hq, S, D]
    lse_ptr,  # fp32 partial log2-sum-exp [R, Hq, S] (unused when DIRECT)
    seq_lens_ptr,
    block_tables_ptr,
    num_splits,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_or,
    stride_oh,
    stride_os,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btr,
    stride_btb,
    BLOCK_SIZE: tl.constexpr,
    GQA: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GQA padded to a power of two >= 16 (tl.dot minimum)
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalised output, no reduce pass
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    F16_DOTS: tl.constexpr,  # bf16 q over an FP8 cache: both dots in fp16 (see _f16_query)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    if not DIRECT:
        if tile_start >= tile_end:
            return  # segment past the end of this sequence; the reduce skips it

    offs_h = tl.arange(0, BLOCK_H)
    head = kv_head * GQA + offs_h
    head_valid = offs_h < GQA
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = req.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh  # decode req r owns token r
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=head_valid[:, None], other=0.0)
    if F16_DOTS:
        q = _f16_query(q)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_btr
    head_off = kv_head.to(tl.int64) * stride_ch

    for tile in range(tile_start, tile_end):
        k_pos = tile * BLOCK_N + offs_n
        k_valid = k_pos < seq_len
        phys = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_btb, mask=k_valid, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=k_valid[:, None], other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: each tile holds >= 1 valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty sequence (padding request): output 0
    o = acc / l_safe[:, None] * v_scale
    o_rows = req.to(tl.int64) * stride_or + head.to(tl.int64) * stride_oh
    if DIRECT:
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    else:
        o_rows += split * stride_os
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o, mask=head_valid[:, None])
        lse = m_i + tl.log2(l_i)
        lse_off = req.to(tl.int64) * stride_lr + head.to(tl.int64) * stride_lh + split
        tl.store(lse_ptr + lse_off, lse, mask=head_valid)


@triton.jit(do_not_specialize=["num_splits", "min_tiles_per_split", "stride_lr", "stride_lh"])
def _decode_reduce_kernel(
    part_out_ptr,
    lse_ptr,
    out_ptr,
    seq_lens_ptr,
    num_splits,
    min_tiles_per_split,  # segments hold at least this many BLOCK_N tiles (MLA; 1 for the dense kernel)
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_ot,
    stride_oh,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits combined per iteration (any count of splits works)
    DIM: tl.constexpr,  # output width (head_dim; MLA: kv_lora_rank)
    BLOCK_D: tl.constexpr,  # DIM rounded up to a power of two
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    # Same segmentation as _paged_decode_kernel (and triton_mla._mla_decode_kernel): count the non-empty segments.
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles_per_split), 1)
    num_valid = tl.cdiv(num_tiles, tiles_per_split)

    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < DIM
    lse_base = req.to(tl.int64) * stride_lr + head.to(tl.int64) * stride_lh
    p_base = req.to(tl.int64) * stride_pr + head.to(tl.int64) * stride_ph
    # Online log-sum-exp over the splits, BLOCK_S at a time (every chunk holds a valid split,
    # so the running max is finite after the first).
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_valid, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_valid = offs_s < num_valid
        lse = tl.load(lse_ptr + lse_base + offs_s, mask=s_valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.where(s_valid, tl.exp2(lse - m_new), 0.0)
        part = tl.load(part_out_ptr + p_base + offs_s[:, None] * stride_ps + offs_d[None, :],
                       mask=s_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    denom = tl.where(denom == 0.0, 1.0, denom)  # no valid split (seq_len 0): output 0
    o = acc / denom
    o_off = req.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_valid)


#: Splits ``_decode_reduce_kernel`` combines per iteration: fixed, so that one compiled
#: variant serves every split count.
REDUCE_BLOCK_S = 4


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is <= ``cap``."""
    d = 1
    while n % (d * 2) == 0 and d * 2 <= cap:
        d *= 2
    return d


class TritonAttentionBackend:
    """Paged prefill (FlashAttention-2 style) + split-KV paged decode (Flash-Decoding).

    Args:
        max_model_len: longest sequence the engine serves; bounds the number of decode
            splits (``ceil(max_model_len / min_tokens_per_split)``). ``None``: no bound
            other than ``max_num_splits``.
        max_num_splits: upper limit on decode KV splits per request. The decode grid is
            ``(num_decode_reqs, num_kv_heads, num_splits)`` with ``num_splits`` in
            ``[1, max_num_splits]``, chosen from the number of decode requests and heads
            (to fill the GPU) and, outside CUDA-graph capture, capped by
            ``meta.max_seq_len``. Under capture it depends only on the batch shape, and the
            segment boundaries are computed in the kernel from ``seq_lens``, so a captured
            graph replays correctly for any sequence lengths.
        min_tokens_per_split: smallest context segment worth its own program.
        prefill_block_m: rows (query tokens x q heads) per prefill program; ``None``: by
            head_dim (128 for head_dim <= 64, else 64).
        block_n: keys per inner iteration of both kernels (any block size works: keys
            are mapped to physical blocks one by one).
        deterministic: batch-invariant mode (:mod:`tandem.layers.batch_invariant`): decode
            requests run through the prefill kernel (see :meth:`forward`).

    Launch defaults were tuned on an H200 (bf16, 32 q / 8 kv heads; the figures reached
    are in benchmarks/RESULTS.md).
    """

    name = "triton"

    def __init__(
        self,
        max_model_len: int | None = None,
        max_num_splits: int = 32,
        min_tokens_per_split: int = 256,
        prefill_block_m: int | None = None,
        block_n: int = 64,
        deterministic: bool = False,
    ) -> None:
        for name, val in (("prefill_block_m", prefill_block_m), ("block_n", block_n)):
            if val is not None and (val < 16 or val & (val - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")
        if max_num_splits < 1 or min_tokens_per_split < 1:
            raise ValueError("max_num_splits and min_tokens_per_split must be >= 1")
        if max_model_len is not None:
            max_num_splits = min(max_num_splits, max(1, -(-max_model_len // min_tokens_per_split)))
        self.max_num_splits = max_num_splits
        self.min_tokens_per_split = min_tokens_per_split
        self.prefill_block_m = prefill_block_m
        self.block_n = block_n
        self.deterministic = deterministic
        # Launch overrides (None: heuristic), for tuning.
        self.prefill_num_warps: int | None = None
        self.prefill_num_stages: int | None = None
        self.decode_num_warps: int | None = None
        self.decode_num_stages: int | None = None
        self.decode_maxnreg: int | None = None

    # ------------------------------------------------------------------ helpers

    def num_decode_splits(self, num_decode_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        """KV splits per decode request for this step (host ints only, no sync); the count,
        and with it the segment boundaries, follows the batch (deterministic mode runs no
        decode kernel: see :meth:`forward`)."""
        if self.max_num_splits == 1:
            return 1
        # Rounded up, unlike the MLA heuristic: five of these programs fit an SM, so aiming at
        # two per SM never starts a second wave (rounding down measured worse: RESULTS session 16).
        splits = -(-program_slots(device, 2) // max(1, num_decode_reqs * num_kv_heads))
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            # Eager step: no point splitting short contexts.
            splits = min(splits, -(-max_seq_len // self.min_tokens_per_split))
        return max(1, min(splits, self.max_num_splits))

    def _decode_launch(self, cache_dtype: torch.dtype) -> dict:
        """The decode kernel's launch options. An FP8 cache's kernel converts its tiles in
        registers: left alone it takes ~150 registers a thread and fits 3 programs per SM, too
        few loads in flight to reach the bandwidth bf16 reaches; capped at 96 (and one more
        pipeline stage) it fits 5, for the same bits (RESULTS: Stop 65)."""
        fp8 = cache_dtype == torch.float8_e4m3fn
        launch = dict(num_warps=self.decode_num_warps or 4, num_stages=self.decode_num_stages or (3 if fp8 else 2))
        maxnreg = self.decode_maxnreg or (96 if fp8 else None)
        return launch if maxnreg is None else dict(launch, maxnreg=maxnreg)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
        if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
            raise ValueError(f"TritonAttentionBackend needs a power-of-two head_dim in [16, 256], got {head_dim}")
        if cache_head_dim != head_dim:
            raise ValueError(f"q head_dim {head_dim} != kv cache head_dim {cache_head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if q.dtype not in _SUPPORTED_DTYPES or kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
            raise ValueError(f"unsupported dtypes q={q.dtype} kv_cache={kv_cache.dtype}")

        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
        if kv_cache.dtype == q.dtype:
            k_scale = v_scale = 1.0  # scales only apply to FP8 contents
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        gqa = num_heads // num_kv_heads
        qk_scale = scale * k_scale * math.log2(math.e)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        upcast = _INTERPRET and q.dtype == torch.bfloat16
        bt = meta.block_tables
        common = dict(PRECISION=precision, UPCAST=upcast,
                      F16_DOTS=kv_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16)

        # Deterministic mode (``self.deterministic``): decode requests go
        # through the prefill kernel as one-token queries, so that a token's keys are reduced
        # by the one kernel, tile by tile from position 0, whether it is computed in a
        # prefill, a chunk, after a prefix hit or as a decode; FMA contraction is off so
        # that a key tile gives the same bits in the unmasked and the causal loop.
        deterministic = self.deterministic
        nd = 0 if deterministic else meta.num_decode_reqs
        if nd > 0:
            block_h = max(16, triton.next_power_of_2(gqa))
            splits = self.num_decode_splits(nd, num_kv_heads, meta.max_seq_len, q.device)
            direct = splits == 1
            if direct:
                part_out, lse, po_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
            else:
                part_out = torch.empty(nd, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
                lse = torch.empty(nd, num_heads, splits, dtype=torch.float32, device=q.device)
                po_strides = part_out.stride()[:3]
                lse_strides = lse.stride()[:2]
            _paged_decode_kernel[(nd, num_kv_heads, splits)](
                q, key_cache, value_cache, part_out, lse, meta.seq_lens, bt,
                splits, qk_scale, v_scale,
                q.stride(0), q.stride(1), *po_strides, *lse_strides,
                key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                bt.stride(0), bt.stride(1),
                BLOCK_SIZE=block_size, GQA=gqa, BLOCK_H=block_h, BLOCK_N=self.block_n, HEAD_DIM=head_dim,
                DIRECT=direct, **self._decode_launch(kv_cache.dtype), **common,
            )
            if not direct:
                _decode_reduce_kernel[(nd, num_heads)](
                    part_out, lse, out, meta.seq_lens, splits, 1,
                    *part_out.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
                    BLOCK_N=self.block_n, BLOCK_S=REDUCE_BLOCK_S, DIM=head_dim,
                    BLOCK_D=head_dim,
                    num_warps=4,
                )

        num_prefill = meta.num_reqs - nd
        if num_prefill > 0 and meta.max_query_len > 0:
            if head_dim <= 64:
                block_m, warps, stages = 128, 8, 3
            elif head_dim <= 128:
                block_m, warps, stages = 64, 4, 2
            else:
                block_m, warps, stages = 64, 8, 1
            block_m = self.prefill_block_m or block_m
            heads_per_prog = _pow2_divisor(gqa, block_m // 4)
            block_q = block_m // heads_per_prog
            grid = (triton.cdiv(meta.max_query_len, block_q), num_prefill, num_heads // heads_per_prog)
            _paged_prefill_kernel[grid](
                q, key_cache, value_cache, out,
                meta.query_start_loc, meta.seq_lens, meta.num_computed_tokens, bt,
                nd, qk_scale, v_scale,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                bt.stride(0), bt.stride(1),
                BLOCK_SIZE=block_size, GQA=gqa, HEADS_PER_PROG=heads_per_prog, BLOCK_Q=block_q,
                BLOCK_N=self.block_n, HEAD_DIM=head_dim,
                num_warps=self.prefill_num_warps or warps,
                num_stages=self.prefill_num_stages or stages, enable_fp_fusion=not deterministic, **common,
            )
        return out
