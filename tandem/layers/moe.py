"""Mixture-of-Experts: routers of each family and expert compute without a per-expert loop.

Routing (top-k gating, Shazeer et al. 2017) gives every token ``k`` experts and weights:

* Mixtral (Jiang et al. 2024): softmax over all router logits, top-k, renormalise to sum 1
  (equal to a softmax over the top-k logits) — :func:`softmax_topk` with ``renormalize``.
* Qwen3-MoE: softmax, top-k, renormalise iff ``norm_topk_prob`` — :func:`softmax_topk`.
* DeepSeek-V2 (DeepSeek-AI 2024): softmax in fp32; ``greedy`` top-k or
  ``group_limited_greedy`` (keep the ``topk_group`` groups of experts with the highest
  best score, then top-k inside them); optional renormalisation (``norm_topk_prob``), then
  ``routed_scaling_factor`` — :func:`deepseek_v2_topk`.

On CUDA :class:`TopKRouter` runs the routing (with the logits GEMM) as one Triton kernel,
:func:`tandem.layers.fused_router.fused_router`; the torch functions are the CPU path and
the reference (``$TANDEM_MOE_ROUTER`` pins one).

Expert compute (:func:`grouped_experts`): the ``T*k`` (token, expert) pairs are sorted by
expert (a stable argsort of the flattened expert ids), each expert's rows are contiguous
(``offsets``), and the two SwiGLU GEMMs run as *grouped* GEMMs over those row groups —
``torch._grouped_mm`` (one kernel per GEMM on Hopper, bf16) or, as a fallback, ``torch.bmm``
over per-expert buffers padded to the largest group. The weighted results are scattered
back to token order and summed over the ``k`` choices. :func:`reference_experts` is the
plain per-expert loop used by tests and the micro-benchmark.

``impl="triton"`` runs the fused-MoE Triton kernel of :mod:`tandem.layers.fused_moe_triton`
instead (vLLM-style: each expert's sorted rows padded to ``BLOCK_M`` tiles, one program per
(expert tile, output-column tile) reading its weight tile once, the routing weight applied
in the second GEMM's epilogue). It is built for the memory-bound decode regime, where each
expert has a handful of rows and the layer's time is the read of the expert weights.
``impl="auto"`` (:func:`_resolve_impl`) on CUDA (sm90+) with fp16/bf16 takes the Triton
kernel when the number of (token, expert) pairs ``T*k`` is at most
:data:`TRITON_MAX_PAIRS` (the largest size measured against ``torch._grouped_mm``; figures
in benchmarks/RESULTS.md), ``torch._grouped_mm`` (or padded bmm) otherwise;
the choice is a host int from tensor shapes (no sync, stable under CUDA-graph capture for
a fixed batch size). On the CPU ``auto`` never picks Triton (its interpreter is slow).
``$TANDEM_MOE_IMPL`` (``auto`` by default) pins what ``auto`` means.

:class:`FusedMoE` holds the stacked expert weights (``w13 [E, 2I, H]``: gate rows then up
rows, as transformers' ``gate_up_proj``; ``w2 [E, H, I]``) and goes through the
all-to-all seam of :mod:`tandem.distributed.all2all` (dispatch -> local experts -> combine).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem import envs
from tandem.distributed.all2all import All2AllBackend, LocalAll2All
from tandem.layers import batch_invariant
from tandem.layers.linear import check_fp8_source
from tandem.layers.quantization.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight_per_channel

# ----------------------------------------------------------------------------- routing


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over ``logits [T, E]``, top-k, optional renormalisation.

    Returns ``(topk_ids [T, k] int64, topk_weights [T, k] fp32)``.
    """
    probs = logits.float().softmax(dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def deepseek_v2_topk(logits: torch.Tensor, top_k: int, topk_method: str = "greedy", n_group: int | None = None,
                     topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                     norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing over ``logits [T, E]`` (computed in fp32).

    ``group_limited_greedy`` splits the experts into ``n_group`` equal groups, keeps the
    ``topk_group`` groups whose best expert scores highest, and zeroes the other scores
    before the top-k. With ``norm_topk_prob`` (and ``k > 1``) the weights are renormalised
    to sum 1 (+1e-20) before ``routed_scaling_factor`` is applied, as in DeepSeek-V3 and
    vLLM; transformers 5 ignores ``norm_topk_prob`` for DeepSeek-V2, whose released
    checkpoints all set it False (where every implementation agrees).

    Returns ``(topk_ids [T, k] int64, topk_weights [T, k] fp32)``.

    Raises:
        ValueError: unknown ``topk_method`` or bad group settings.
    """
    scores = logits.float().softmax(dim=-1)
    if topk_method == "greedy":
        weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    elif topk_method == "group_limited_greedy":
        num_experts = scores.shape[-1]
        if not n_group or not topk_group or num_experts % n_group:
            raise ValueError(f"group_limited_greedy needs n_group dividing {num_experts} and topk_group; "
                             f"got n_group={n_group}, topk_group={topk_group}")
        group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"unknown DeepSeek topk_method {topk_method!r} (greedy, group_limited_greedy)")
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


class TopKRouter(nn.Module):
    """Router ``weight [E, H]`` (HF name ``mlp.gate.weight``) + a family's top-k rule.

    ``forward(x [T, H]) -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)``.

    On CUDA the whole routing runs as one Triton kernel
    (:func:`tandem.layers.fused_router.fused_router`, same semantics; ties in the top-k go
    to the lowest expert index, as CUDA ``torch.topk`` does); on the CPU the torch code
    below runs. ``$TANDEM_MOE_ROUTER`` (``auto``, ``triton``, ``torch``) pins the choice.

    Args:
        method: ``"softmax_topk"`` (Mixtral, Qwen3-MoE) or ``"deepseek_v2"``.
        fp32_logits: compute the logits in fp32 with an fp32 ``weight`` (DeepSeek: as
            transformers, which keeps ``gate.weight`` in fp32), instead of the model dtype.
        renormalize: softmax_topk's renormalisation / DeepSeek's ``norm_topk_prob``.

    The torch path's logits GEMM is batch-invariant in deterministic mode (the model's,
    :func:`tandem.layers.batch_invariant.build_mode`, kept as ``deterministic``).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, method: str = "softmax_topk", *,
                 renormalize: bool = False, fp32_logits: bool = False, topk_method: str = "greedy",
                 n_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if method not in ("softmax_topk", "deepseek_v2"):
            raise ValueError(f"unknown routing method {method!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if method == "deepseek_v2" and topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unknown DeepSeek topk_method {topk_method!r} (greedy, group_limited_greedy)")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size,
                                               dtype=torch.float32 if fp32_logits else None))
        self.top_k, self.method, self.renormalize, self.fp32_logits = top_k, method, renormalize, fp32_logits
        self.topk_method, self.n_group, self.topk_group = topk_method, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.deterministic = batch_invariant.build_mode()

    def _use_triton(self, x: torch.Tensor) -> bool:
        impl = envs.TANDEM_MOE_ROUTER
        if impl == "auto":
            return x.is_cuda and _triton_available()
        return impl == "triton"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_triton(x):
            return self._forward_triton(x)
        det = self.deterministic
        logits = (batch_invariant.linear(x.float(), self.weight.float(), deterministic=det) if self.fp32_logits
                  else batch_invariant.linear(x, self.weight, deterministic=det))
        if self.method == "softmax_topk":
            return softmax_topk(logits, self.top_k, self.renormalize)
        return deepseek_v2_topk(logits, self.top_k, self.topk_method, self.n_group, self.topk_group,
                                self.routed_scaling_factor, self.renormalize)

    def _forward_triton(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from tandem.layers.fused_router import fused_router  # lazy: Triton is optional

        if self.method == "softmax_topk":
            return fused_router(x, self.weight, self.top_k, round_logits=not self.fp32_logits,
                                renormalize=self.renormalize)
        grouped = self.topk_method == "group_limited_greedy"
        if grouped and (not self.n_group or not self.topk_group):
            raise ValueError(f"group_limited_greedy needs n_group and topk_group; got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")
        return fused_router(x, self.weight, self.top_k, round_logits=not self.fp32_logits,
                            renormalize=self.renormalize and self.top_k > 1, renorm_eps=1e-20,
                            scale=self.routed_scaling_factor, n_group=self.n_group if grouped else 0,
                            topk_group=self.topk_group if grouped else 0)


# ------------------------------------------------------------------------ expert compute


@dataclass
class ExpertSort:
    """The (token, expert) pairs of a step sorted by expert.

    Attributes:
        order: ``[T*k]`` int64, flat pair index of each sorted row (stable argsort of the
            expert ids; pairs with id ``-1`` — not this rank's expert — sort last).
        token_idx: ``[T*k]`` int64, token of each sorted row (``order // k``).
        counts: ``[E]`` int64 rows per expert.
        offsets: ``[E]`` int32 cumulative row ends (``torch._grouped_mm``'s ``offs``).
        sorted_ids: ``[T*k]`` int64 expert of each sorted row (``E`` for invalid pairs).
    """

    order: torch.Tensor
    token_idx: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    sorted_ids: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """Sort ``topk_ids [T, k]`` (local ids, ``-1`` = skip) by expert; no host sync."""
    k = topk_ids.shape[-1]
    flat = topk_ids.reshape(-1)
    keyed = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    order = torch.argsort(keyed, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, keyed, torch.ones_like(keyed))
    counts = counts[:num_experts]
    return ExpertSort(order, torch.div(order, k, rounding_mode="floor"), counts,
                      counts.cumsum(0).to(torch.int32), keyed[order])


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [..., 2I]`` (gate first)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs for this device/dtype (CPU: any float; CUDA:
    bf16 on compute capability >= 9.0)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


# impl="auto" on CUDA (sm90+, fp16/bf16): the fused-MoE Triton kernel up to this many
# (token, expert) pairs, the largest size at which it was measured against
# torch._grouped_mm (faster at every size measured, up to a 16384-token prefill step of a
# top-6 model: benchmarks/RESULTS.md, "fused-MoE Triton kernel" and "Session 10");
# above it auto keeps grouped_mm.
TRITON_MAX_PAIRS = 98304


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - CPU-only installs without Triton
        return False
    return True


IMPLS = envs.MOE_IMPLS


def _impl_from_env() -> str:
    """``$TANDEM_MOE_IMPL`` (default ``auto``): pins what ``impl="auto"`` means, e.g. to
    compare expert kernels end to end or to step around one on a new GPU."""
    return envs.TANDEM_MOE_IMPL


def _resolve_impl(impl: str, x: torch.Tensor, num_pairs: int = 0, fp8: bool = False,
                  deterministic: bool = False) -> str:
    """The expert-compute implementation for ``impl`` (``"auto"``: ``$TANDEM_MOE_IMPL`` if
    set, else resolved from the device, dtype and ``num_pairs`` = ``T*k``, a host int from
    shapes). FP8 experts (``fp8``) take the Triton kernel on every CUDA size (the others
    would dequantize all local experts per call); in deterministic mode (``deterministic``)
    the loop on the CPU and the Triton kernel on CUDA, at every size.

    Raises:
        ValueError: ``$TANDEM_MOE_IMPL`` names no implementation.
    """
    if impl == "auto":
        impl = _impl_from_env()
    if impl != "auto":
        return impl
    if x.device.type == "cpu" and deterministic:
        return "loop"  # deterministic mode: each expert's rows through the row-blocked GEMM
    if x.device.type == "cuda" and deterministic and _triton_available():
        return "triton"  # deterministic mode: one tile configuration at every batch size
    if x.device.type == "cuda":
        grouped = grouped_mm_available(x.device, x.dtype)
        if (x.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(x.device) >= (9, 0)
                and _triton_available() and 0 < num_pairs <= TRITON_MAX_PAIRS):
            return "triton"
        if fp8 and _triton_available():
            return "triton"
        return "grouped_mm" if grouped else "padded_bmm"
    # CPU: torch._grouped_mm loops over the groups in C++ — no host sync and no padding
    # (padded bmm multiplies E * max_group rows); the two are on par in
    # benchmarks/moe_grouped_gemm.py, both ahead of the Python loop for small batches.
    return "grouped_mm" if grouped_mm_available(x.device, x.dtype) else "padded_bmm"


def _padded_bmm_rows(xs: torch.Tensor, s: ExpertSort, w13: torch.Tensor, w2: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Both GEMMs as ``torch.bmm`` over ``[E, capacity, H]`` buffers. Capacity = the
    largest group (one host sync to read it), or ``num_tokens`` (an upper bound: a token
    picks an expert at most once) under CUDA-graph capture, where no sync is allowed.
    Returns the sorted rows' outputs; rows of invalid pairs hold garbage (masked by the
    caller)."""
    num_experts = w13.shape[0]
    capturing = xs.is_cuda and torch.cuda.is_current_stream_capturing()
    cap = num_tokens if capturing else (int(s.counts.max()) if xs.shape[0] else 0)
    if cap == 0:
        return xs.new_zeros(xs.shape[0], w2.shape[1])
    # Row r of expert e goes to buf[e, r - start[e]]; invalid pairs (id E) into a spare
    # slab E that is never multiplied.
    starts = torch.cat((s.offsets.long() - s.counts, s.offsets[-1:].long()))
    pos = (torch.arange(xs.shape[0], device=xs.device) - starts[s.sorted_ids]).clamp(max=cap - 1)
    buf = xs.new_zeros(num_experts + 1, cap, xs.shape[1])
    buf[s.sorted_ids, pos] = xs
    h = silu_and_mul(torch.bmm(buf[:num_experts], w13.transpose(1, 2)))
    y = torch.bmm(h, w2.transpose(1, 2))
    return y[s.sorted_ids.clamp(max=num_experts - 1), pos]


@dataclass
class ExpertScales:
    """Scales of FP8 expert weights (``w = q * scale``): per output channel ``w13 [E, 2I]``,
    ``w2 [E, H]`` fp32, or with ``block = (bn, bk)`` block-wise ``w13 [E, 2I/bn, H/bk]``,
    ``w2 [E, H/bn, I/bk]``."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None = None


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, impl: str = "auto", scales: ExpertScales | None = None,
                    addend: torch.Tensor | None = None, deterministic: bool = False) -> torch.Tensor:
    """SwiGLU experts over sorted (token, expert) pairs with grouped GEMMs.

    Args:
        x: ``[N, H]`` tokens (model dtype).
        topk_ids: ``[N, k]`` int64 local expert ids in ``[0, E)``; ``-1`` skips a slot.
        topk_weights: ``[N, k]`` fp32 routing weights.
        w13: ``[E, 2I, H]`` gate (rows ``:I``) and up (rows ``I:``) projections.
        w2: ``[E, H, I]`` down projections.
        impl: ``"grouped_mm"`` (``torch._grouped_mm``), ``"padded_bmm"``, ``"triton"``
            (:func:`tandem.layers.fused_moe_triton.fused_experts_triton`, default tiles),
            ``"loop"`` (:func:`reference_experts`) or ``"auto"`` (see the module docstring).
        scales: with float8_e4m3fn ``w13``/``w2``, their scales (W8A16: the activations stay
            in ``x.dtype``). ``triton`` converts the FP8 weight tiles in the kernel and
            applies the scales there (per-channel in the epilogue, block-wise per K tile);
            the other implementations dequantize the local experts' weights per call.
        addend: optional ``[N, H]`` in ``x.dtype`` added to the result (``routed + addend``
            in ``x.dtype``; ``triton`` adds it inside its reduction kernel).
        deterministic: batch-invariant mode (the layer's): ``auto`` resolves as the module
            docstring says, ``triton`` takes one tile configuration and ``loop`` the
            batch-invariant GEMM, so a token's result does not depend on the batch.

    Returns:
        ``[N, H]`` in ``x.dtype``: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over
        the valid slots ``j`` (zeros for a token with none), plus ``addend``. The weighting
        is done in fp32 and the ``k`` contributions are summed in ``x.dtype`` (in fp32 by
        ``triton``).

    Raises:
        ValueError: unknown ``impl``.
    """
    impl = _resolve_impl(impl, x, topk_ids.numel(), fp8=scales is not None, deterministic=deterministic)
    if scales is not None and impl != "triton":
        w13, w2 = (dequantize_weight(w13, scales.w13, scales.block, x.dtype),
                   dequantize_weight(w2, scales.w2, scales.block, x.dtype))
    if impl == "triton":
        from tandem.layers.fused_moe_triton import fused_experts_triton  # lazy: Triton is optional

        return fused_experts_triton(x, topk_ids, topk_weights, w13, w2, scales=scales, addend=addend,
                                    deterministic=deterministic)
    if impl == "loop":
        out = reference_experts(x, topk_ids, topk_weights, w13, w2, deterministic)
    else:
        out = _grouped_rows(x, topk_ids, topk_weights, w13, w2, impl)
    return out if addend is None else out + addend


def _grouped_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, impl: str) -> torch.Tensor:
    """:func:`grouped_experts` with ``grouped_mm`` / ``padded_bmm`` (no addend)."""
    n, k = topk_ids.shape
    s = sort_by_expert(topk_ids, w13.shape[0])
    xs = x[s.token_idx]  # [N*k, H]
    if impl == "grouped_mm":
        h = silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=s.offsets))
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=s.offsets)
    elif impl == "padded_bmm":
        ys = _padded_bmm_rows(xs, s, w13, w2, n)
    else:
        raise ValueError(f"unknown MoE impl {impl!r} (auto, grouped_mm, padded_bmm, triton, loop)")
    # Rows past the last group (invalid pairs) are not written by _grouped_mm: mask them.
    valid = s.sorted_ids < w13.shape[0]
    w_sorted = topk_weights.reshape(-1)[s.order].float()
    ys = torch.where(valid[:, None], ys.float() * w_sorted[:, None], 0.0).to(x.dtype)
    y = torch.empty_like(ys).index_copy_(0, s.order, ys)
    return y.view(n, k, w2.shape[1]).sum(dim=1)


def reference_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """The per-expert Python loop (reference for :func:`grouped_experts`, same contract);
    with ``deterministic`` its GEMMs are batch-invariant (:func:`batch_invariant.linear`)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        h = silu_and_mul(batch_invariant.linear(x[tok], w13[e], deterministic=deterministic))
        y = batch_invariant.linear(h, w2[e], deterministic=deterministic)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer, behind the dispatch/combine seam.

    Parameters: ``w13 [E_local, 2I, H]`` and ``w2 [E_local, H, I]``, ``E_local`` =
    ``all2all.placement.num_local_experts`` (all experts for the ``local`` backend).

    FP8 (:mod:`tandem.layers.quantization.apply`): ``w13``/``w2`` in float8_e4m3fn with
    ``w13_weight_scale`` / ``w2_weight_scale`` (:class:`ExpertScales` layout), from an FP8
    checkpoint (:meth:`create_fp8_weights`, :meth:`load_expert_scale`) or quantized per
    output channel after loading (:meth:`finish_fp8_weights`).

    ``forward(hidden [T, H], topk_ids [T, k] global ids int64, topk_weights [T, k] fp32,
    addend [T, H] | None) -> [T, H]``; ``addend`` (the shared experts' output, allowed iff
    :attr:`fuses_addend`) is added inside the expert compute's reduction.
    :meth:`forward_steps` is the same computation as a generator that yields right after
    each launch half (``"dispatch"``, ``"combine"``), for dual-batch overlap.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 all2all: All2AllBackend | None = None, impl: str = "auto") -> None:
        super().__init__()
        self.all2all = all2all if all2all is not None else LocalAll2All(num_experts)
        if self.all2all.placement.num_experts != num_experts:
            raise ValueError("all2all placement and MoE layer disagree on the number of experts")
        e_local = self.all2all.placement.num_local_experts
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.impl = impl
        self.deterministic = batch_invariant.build_mode()  # the model's mode (grouped_experts)
        self.w13 = nn.Parameter(torch.empty(e_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(e_local, hidden_size, intermediate_size))

    @property
    def fuses_addend(self) -> bool:
        """Whether :meth:`forward_steps` takes an ``addend``: the tokens stay on this rank
        (``local`` backend), so the expert compute's output is the layer's."""
        return isinstance(self.all2all, LocalAll2All)

    def expert_compute(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
                       addend: torch.Tensor | None = None) -> torch.Tensor:
        scales = None
        if self.w13.dtype == FP8_DTYPE:
            scales = ExpertScales(self.w13_weight_scale, self.w2_weight_scale, self.weight_block)
        return grouped_experts(x, local_ids, weights, self.w13, self.w2, self.impl, scales, addend,
                               self.deterministic)

    # ------------------------------------------------------------------- FP8
    weight_block: tuple[int, int] | None = None

    def create_fp8_weights(self, block: tuple[int, int] | None) -> None:
        """FP8 ``w13``/``w2`` and NaN-filled scales ``w13_weight_scale`` /
        ``w2_weight_scale`` in the layout of :class:`ExpertScales`, for an FP8 checkpoint.

        Raises:
            ValueError: block-wise scales with this rank's intermediate size not a
                multiple of the block.
        """
        e, two_i, h = self.w13.shape
        i = two_i // 2
        for name in ("w13", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE), requires_grad=False)
            for attr in ("full_shape", "shard"):
                if hasattr(old, attr):
                    setattr(new, attr, getattr(old, attr))
            setattr(self, name, new)
        self.weight_block = tuple(block) if block else None
        if block:
            bn, bk = block
            if i % bn or i % bk:
                raise ValueError(f"block-wise FP8 experts ({bn}x{bk}) need the intermediate size per rank ({i}) to "
                                 f"be a multiple of the block")
            s13, s2 = (e, two_i // bn, -(-h // bk)), (e, -(-h // bn), i // bk)
        else:
            s13, s2 = (e, two_i), (e, h)
        nan = float("nan")  # marks scales no checkpoint tensor wrote (checked after loading)
        self.w13_weight_scale = nn.Parameter(torch.full(s13, nan, dtype=torch.float32), requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.full(s2, nan, dtype=torch.float32), requires_grad=False)

    def _tp_slice(self, t: torch.Tensor, dim: int, unit: int = 1) -> torch.Tensor:
        """This rank's part of an intermediate-dim axis given whole (``unit``: elements of
        the axis per tensor entry); no TP sharding here, see ParallelFusedMoE."""
        return t

    def load_expert_scale(self, which: str, expert: int, tensor: torch.Tensor, shard: int | None = None) -> bool:
        """Copy one expert's checkpoint weight scale (``which``/``shard`` as
        :meth:`load_expert`): per tensor ``[1]``, per channel ``[rows, 1]`` or block-wise
        ``[rows/bn, cols/bk]``, of the whole (unsharded) matrix. Returns False when another
        rank owns the expert.

        Raises:
            ValueError: no FP8 weights here, expert id or shape out of range.
        """
        if self.w13.dtype != FP8_DTYPE:
            raise ValueError("an FP8 weight scale for experts that are not FP8 (checkpoint without an FP8 "
                             "quantization_config?)")
        local = self._local_index(expert)
        if local is None:
            return False
        t = tensor.float()
        if self.weight_block is not None:
            bn, bk = self.weight_block
            t = self._tp_slice(t, 0, bn) if which == "w13" else self._tp_slice(t, 1, bk)
        elif t.numel() == 1:
            t = t.reshape(1).expand(self.intermediate_size if which == "w13" else self.hidden_size)
        else:
            t = t.reshape(-1)
            t = self._tp_slice(t, 0) if which == "w13" else t
        dst = (self.w13_weight_scale if which == "w13" else self.w2_weight_scale)[local]
        if shard is not None:
            rows = dst.shape[0] // 2
            dst = dst.narrow(0, shard * rows, rows)
        if dst.shape != t.shape:
            raise ValueError(f"expert {expert} {which} scale: checkpoint {tuple(tensor.shape)} vs model "
                             f"{tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t)
        return True

    def finish_fp8_weights(self, name: str) -> None:
        """After loading: quantize high-precision experts per output channel (online), or
        check that an FP8 checkpoint provided every local expert's scales.

        Raises:
            ValueError: a scale is missing.
        """
        if self.w13.dtype == FP8_DTYPE:
            for pname in ("w13_weight_scale", "w2_weight_scale"):
                if torch.isnan(getattr(self, pname)).any():
                    raise ValueError(f"checkpoint lacks {pname} of some experts of {name}")
            return
        for pname in ("w13", "w2"):
            w = getattr(self, pname).data
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):  # one expert at a time: bounded fp32 temporaries
                q[e], scale[e] = quantize_weight_per_channel(w[e])
            setattr(self, pname, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{pname}_weight_scale", nn.Parameter(scale, requires_grad=False))

    def forward_steps(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      addend: torch.Tensor | None = None) -> Generator[str, None, torch.Tensor]:
        if addend is not None and not self.fuses_addend:
            raise ValueError(f"{type(self).__name__} with the {self.all2all.name!r} backend takes no addend")
        handle = self.all2all.dispatch_launch(hidden, topk_ids, topk_weights)
        yield "dispatch"
        x, ids, w, meta = self.all2all.dispatch_wait(handle)
        out = self.expert_compute(x, ids, w, addend)
        handle = self.all2all.combine_launch(out, meta)
        yield "combine"
        return self.all2all.combine_wait(handle)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                addend: torch.Tensor | None = None) -> torch.Tensor:
        return drain(self.forward_steps(hidden, topk_ids, topk_weights, addend))

    # -------------------------------------------------------------- weight loading
    def load_fused(self, which: str, tensor: torch.Tensor) -> None:
        """Copy a stacked ``[E, ...]`` checkpoint tensor (``gate_up_proj``/``down_proj``);
        only this rank's experts are kept.

        Raises:
            ValueError: shape mismatch.
        """
        p = self.w13 if which == "w13" else self.w2
        pl = self.all2all.placement
        src = tensor[pl.first_local_expert: pl.first_local_expert + pl.num_local_experts]
        if tuple(src.shape) != tuple(p.shape) or tensor.shape[0] != self.num_experts:
            raise ValueError(f"expert tensor {which}: checkpoint {tuple(tensor.shape)} vs model "
                             f"{(self.num_experts, *p.shape[1:])}")
        check_fp8_source(p, src)
        with torch.no_grad():
            p.copy_(src)

    def _local_index(self, expert: int) -> int | None:
        """This rank's index of global ``expert``, or None when another rank owns it.

        Raises:
            ValueError: expert id out of range.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} out of range [0, {self.num_experts})")
        pl = self.all2all.placement
        return expert - pl.first_local_expert if pl.is_local(expert) else None

    def load_expert(self, which: str, expert: int, tensor: torch.Tensor, shard: int | None = None) -> bool:
        """Copy one expert's matrix (``which`` = "w13" with ``shard`` 0 = gate / 1 = up, or
        "w2"). Returns False (and copies nothing) when another rank owns the expert.

        Raises:
            ValueError: expert id or shape out of range.
        """
        local = self._local_index(expert)
        if local is None:
            return False
        dst = (self.w13 if which == "w13" else self.w2)[local]
        if shard is not None:
            dst = dst.narrow(0, shard * self.intermediate_size, self.intermediate_size)
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {expert} {which}: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}")
        check_fp8_source(dst, tensor)
        with torch.no_grad():
            dst.copy_(tensor)
        return True


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts, DeepSeek), HF names ``gate``,
    ``experts``, ``shared_experts``. ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def forward_steps(self, x: torch.Tensor) -> Generator[str, None, torch.Tensor]:
        """The block as a generator yielding at the experts' communication points; the
        shared experts run while the dispatch is in flight, or, when there is no exchange
        (``experts.fuses_addend``), first, their output added in the routed experts'
        reduction (one kernel less)."""
        topk_ids, topk_weights = self.gate(x)
        if self.shared_experts is not None and self.experts.fuses_addend:
            return (yield from self.experts.forward_steps(x, topk_ids, topk_weights, self.shared_experts(x)))
        steps = self.experts.forward_steps(x, topk_ids, topk_weights)
        yield next(steps)  # dispatch launched
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = yield from steps
        return out if shared is None else out + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drain(self.forward_steps(x))


def drain(steps: Generator) -> object:
    """Run a forward generator to its end in one go (no overlap); returns its value."""
    try:
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value
