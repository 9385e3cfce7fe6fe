"""MoE routing in one Triton kernel: router logits -> softmax -> (group-limited) top-k ->
(renormalise) -> scaled weights.

The torch routing of :class:`tandem.layers.moe.TopKRouter` launches about seven small
kernels per MoE layer on CUDA (dtype casts of ``x`` and of the router weight, the GEMM and
its split-K reduction, softmax, top-k, the scaling). At decode sizes each costs a few
microseconds inside a CUDA graph, while the work is a ``[T, H] x [H, E]`` product and a
per-token selection over ``E`` values. :func:`fused_router` does it in one launch (as
vLLM's ``fused_topk`` / ``grouped_topk`` do the selection; here the logits GEMM is folded
in as well): one program per ``BLOCK_T`` tokens computes the ``[BLOCK_T, E]`` logits over
``H`` in fp32 and selects the experts in registers.

Semantics (those of :func:`tandem.layers.moe.softmax_topk` and
:func:`tandem.layers.moe.deepseek_v2_topk`):

* Logits: ``x @ weight.T`` accumulated in fp32. Every product is exact: 16-bit ``x`` times
  a weight of the same dtype is exact in fp32; an fp32 weight with bf16 ``x`` (DeepSeek,
  whose router weight transformers keeps in fp32) is split in the kernel into three bf16
  parts ``hi + mid + lo`` that sum to it exactly (8 + 8 + 8 significant bits), each part
  multiplied on the tensor cores; fp32 ``x`` (or fp16 ``x`` with an fp32 weight) uses
  IEEE fp32 FMAs. Only the summation order differs from a torch fp32 GEMM (which has none
  fixed). ``round_logits`` rounds the logits to ``x``'s dtype, as a GEMM in the model
  dtype does (Mixtral, Qwen3-MoE).
* ``softmax`` over the experts in fp32 (``exp(l - max) / sum``).
* ``group_limited_greedy`` (``n_group`` > 0): the ``topk_group`` groups of ``E / n_group``
  consecutive experts with the highest best probability are kept, the other probabilities
  set to 0, as DeepSeek-V2 does.
* Top-k by probability, largest first. **Ties go to the lowest expert index** (for the
  groups too), as CUDA ``torch.topk`` resolves them (its ``gatherTopK`` takes the values
  equal to the k-th largest in index order); the CPU ``torch.topk`` picks any of them.
* ``renormalize``: ``w / (sum(w) + renorm_eps)``; then ``w * scale``.

Shapes: ``x [T, H]`` fp32/fp16/bf16 (unit stride along ``H``), ``weight [E, H]``
fp32/fp16/bf16; returns ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` fp32. No host
sync, grid from shapes: CUDA-graph safe; ``T = 0`` launches nothing. On the CPU the kernel
needs the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.triton_utils import INTERPRET as _INTERPRET
from tandem.triton_utils import dot as _dot

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_T = 16  # tokens per program (tl.dot's minimum M)
MAX_EXPERTS = 1024  # one program holds a token block's logits over all experts in registers

# How the logits GEMM multiplies (constexpr MODE of the kernel).
_DOT_NATIVE = 0  # x and weight share a dtype: one dot in it (IEEE for fp32)
_DOT_SPLIT_BF16 = 1  # bf16 x, fp32 weight: weight = hi + mid + lo in bf16, three exact dots
_DOT_FP32 = 2  # other mixes: both operands in fp32, IEEE dot


# Not specialised on the token count (== 1, % 16): no compile for a size first met mid-run.
@triton.jit(do_not_specialize=["num_tokens"])
def _fused_router_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, H] router weight
    ids_ptr,  # [T, TOP_K] int64 out
    weights_ptr,  # [T, TOP_K] fp32 out
    num_tokens,
    stride_xm,
    stride_we,
    scale,
    renorm_eps,
    H: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # power of two >= TOP_K
    N_GROUP: tl.constexpr,  # 0: greedy; else group-limited over N_GROUP groups
    TOPK_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,  # power of two >= N_GROUP (>= 1)
    MODE: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_valid = rows < num_tokens
    experts = tl.arange(0, E_PAD)
    e_valid = experts < E
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + experts[None, :] * stride_we + offs_k[:, None]

    acc = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_valid = offs_k < H - k0
        a = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=e_valid[None, :] & k_valid[:, None], other=0.0)
        if MODE == 0:
            acc += _dot(a, b, "ieee", UPCAST)
        elif MODE == 1:
            # Exact split of the fp32 weight: each residual keeps the bits the previous
            # bf16 part dropped (at most 16, then 8), so hi + mid + lo == b.
            hi = b.to(tl.bfloat16)
            r = b - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            acc += _dot(a, hi, "ieee", UPCAST)
            acc += _dot(a, mid, "ieee", UPCAST)
            acc += _dot(a, lo, "ieee", UPCAST)
        else:
            acc += _dot(a.to(tl.float32), b.to(tl.float32), "ieee", False)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    logits = acc
    if ROUND_LOGITS:
        logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(e_valid[None, :], logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    probs = p / tl.sum(p, 1)[:, None]

    scores = probs
    if N_GROUP > 0:
        group_of = experts // (E // N_GROUP)
        groups = tl.arange(0, G_PAD)
        gscores = tl.full((BLOCK_T, G_PAD), float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            best_g = tl.max(tl.where((group_of == g)[None, :], probs, float("-inf")), 1)
            gscores = tl.where((groups == g)[None, :], best_g[:, None], gscores)
        keep = tl.zeros((BLOCK_T, E_PAD), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, sel = tl.max(gscores, 1, return_indices=True, return_indices_tie_break_left=True)
            keep = keep | (group_of[None, :] == sel[:, None])
            gscores = tl.where(groups[None, :] == sel[:, None], float("-inf"), gscores)
        scores = tl.where(keep, probs, tl.where(e_valid[None, :], 0.0, float("-inf")))

    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        val, idx = tl.max(scores, 1, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where((slots == j)[None, :], val[:, None], top_w)
        top_i = tl.where((slots == j)[None, :], idx[:, None], top_i)
        scores = tl.where(experts[None, :] == idx[:, None], float("-inf"), scores)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, 1)[:, None] + renorm_eps)
    top_w = top_w * scale

    out_mask = row_valid[:, None] & (slots < TOP_K)[None, :]
    out_offs = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(ids_ptr + out_offs, top_i.to(tl.int64), mask=out_mask)
    tl.store(weights_ptr + out_offs, top_w, mask=out_mask)


def _dot_mode(x_dtype: torch.dtype, w_dtype: torch.dtype) -> int:
    if x_dtype == w_dtype:
        return _DOT_NATIVE
    if x_dtype == torch.bfloat16 and w_dtype == torch.float32:
        return _DOT_SPLIT_BF16
    return _DOT_FP32


def fused_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, round_logits: bool = False,
                 renormalize: bool = False, renorm_eps: float = 0.0, scale: float = 1.0, n_group: int = 0,
                 topk_group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``x [T, H]`` with the router ``weight [E, H]`` (see the module docstring).

    Args:
        top_k: experts per token, ``1 <= top_k <= E``.
        round_logits: round the fp32 logits to ``x.dtype`` before the softmax.
        renormalize: divide the top-k probabilities by their sum plus ``renorm_eps``.
        scale: multiplies the (renormalised) weights (DeepSeek's ``routed_scaling_factor``).
        n_group, topk_group: group-limited top-k over ``n_group`` groups keeping
            ``topk_group``; ``n_group = 0`` for plain top-k.

    Returns:
        ``(topk_ids [T, top_k] int64, topk_weights [T, top_k] fp32)``, largest first.

    Raises:
        ValueError: unsupported dtypes, shapes or settings, or CPU tensors without the
            Triton interpreter.
    """
    if not x.is_cuda and not _INTERPRET:
        raise ValueError("fused_router: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before "
                         "tandem.layers.fused_router is imported)")
    if x.dtype not in _SUPPORTED_DTYPES or weight.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"fused_router: dtypes x {x.dtype}, weight {weight.dtype} (fp32/fp16/bf16)")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_router: shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"fused_router: top_k={top_k} with {num_experts} experts (at most {MAX_EXPERTS})")
    if n_group and (num_experts % n_group or not 1 <= topk_group <= n_group):
        raise ValueError(f"fused_router: n_group={n_group} must divide {num_experts} and 1 <= topk_group="
                         f"{topk_group} <= n_group")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return ids, weights
    if hidden and x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    e_pad = triton.next_power_of_2(num_experts)
    # Bound the [BLOCK_K, E_PAD] weight tile (and its bf16 split) held in registers.
    block_k = max(16, min(128, 4096 // e_pad, triton.next_power_of_2(max(hidden, 1))))
    _fused_router_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        x, weight, ids, weights, num_tokens, x.stride(0), weight.stride(0), float(scale), float(renorm_eps),
        H=hidden, E=num_experts, E_PAD=e_pad, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        N_GROUP=n_group, TOPK_GROUP=topk_group if n_group else 0, G_PAD=triton.next_power_of_2(max(n_group, 1)),
        MODE=_dot_mode(x.dtype, weight.dtype), ROUND_LOGITS=round_logits, RENORMALIZE=renormalize,
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16, BLOCK_T=BLOCK_T, BLOCK_K=block_k,
        num_warps=4 if e_pad <= 128 else 8,
    )
    return ids, weights
