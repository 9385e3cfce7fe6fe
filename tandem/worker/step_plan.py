"""The step plan: how the model runner executes one step, decided in one place.

Every decision about the shape of a step's forward lives here (after vLLM's
``v1/worker/dp_utils.py`` + ``ubatch_utils.py``; the design is in docs/architecture.md,
"The DBO decision"):

* **dual-batch overlap (DBO) thresholds**: a step is split into two ubatches only for an
  MoE model (``forward_steps``), with DBO on, from ``decode_token_threshold`` tokens for a
  decode-only step and ``prefill_token_threshold`` for a step with prefill tokens;
* **measured splits**: with ``measure_split`` a split is kept only where it was measured
  faster on every rank whose forwards exchange data: per decode CUDA-graph size at capture
  (:meth:`DBOPolicy.keep_split`), and once for steps with prefill tokens
  (:meth:`DBOPolicy.set_prefill_split`);
* **graph vs eager**: a decode-only step of at most the largest capture size replays a CUDA
  graph (an idle data-parallel rank can replay any size); with speculative decoding, a step
  without prompt tokens whose sequences hold at most ``1 + K`` tokens each (one verifying
  drafts) replays a verification graph when this rank plans alone;
* **padding**: a graph replays its capture size; under data parallelism every rank pads its
  eager forward to the largest token count of any rank; on the CPU a forward that holds
  prompt tokens runs at least :data:`CPU_MIN_PROMPT_TOKENS` rows;
* **cross-rank agreement**: one all-reduce (MAX) per step over the DP group
  (:func:`agree_across_dp`): graph mode only if every rank can, split only if every rank
  wants to (an idle rank votes yes), the largest token count. In graph mode the vote is
  not used: every rank replays the capture size of the largest batch, whose split or plain
  form all ranks agreed on at capture (an idle rank replays it with padding rows).

The result is a plain :class:`StepPlan`; :func:`tandem.worker.ubatching.forward_step`
executes it, for eager steps and for graph capture alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.distributed import parallel_state as ps


CPU_MIN_PROMPT_TOKENS = 16
"""Fewest rows of a CPU forward that holds prompt tokens. MKL's fp32 GEMM rounds a row
differently in calls of 1-3, 5-7 or 9-11 rows than in calls of 12 or more (RESULTS:
deterministic inference), so without padding a prompt's last tokens computed alone after a
prefix-cache hit would get other bits than in the forward of the whole prompt, and a
repeated greedy request could change its answer."""


class StepMode(enum.Enum):
    IDLE = "idle"  # no rank of the DP group has tokens: no forward at all
    EAGER = "eager"
    GRAPH = "graph"  # replay the decode CUDA graph of ``padded_tokens`` rows


@dataclass(frozen=True)
class UBatchSlice:
    """Flattened tokens ``[token_start, token_stop)`` of a (padded) step forming one ubatch."""

    token_start: int
    token_stop: int

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start


def ubatch_slices(padded_tokens: int) -> tuple[UBatchSlice, UBatchSlice]:
    """The two ubatches of a forward of ``padded_tokens`` tokens: cut at half the padded
    count, so that every rank (all running the same padded count) cuts alike; the second
    ubatch is the larger one when the count is odd."""
    cut = padded_tokens // 2
    return UBatchSlice(0, cut), UBatchSlice(cut, padded_tokens)


def can_split(num_tokens: int) -> bool:
    """Both halves of a ``num_tokens`` step hold a real token."""
    return 0 < num_tokens // 2 < num_tokens


@dataclass(frozen=True)
class StepPlan:
    """How one step runs on this rank.

    ``num_tokens``: this rank's real tokens; ``padded_tokens``: tokens of the forward (the
    graph's capture size, or the DP group's largest count; >= ``num_tokens``);
    ``ubatches``: the two ubatch slices of a DBO step, else None; ``query_len``: rows per
    sequence of the graph (1: a decode graph; ``1 + K``: a verification graph, whose capture
    size is ``padded_tokens // query_len``).
    """

    mode: StepMode
    num_tokens: int
    padded_tokens: int
    ubatches: tuple[UBatchSlice, UBatchSlice] | None = None
    query_len: int = 1

    @property
    def split(self) -> bool:
        return self.ubatches is not None


@dataclass
class DBOPolicy:
    """When a step is split into two ubatches (dual-batch overlap).

    Attributes:
        decode_token_threshold: smallest decode-only step that is split.
        prefill_token_threshold: smallest step with prefill tokens that is split.
        measure_split: keep a split only where it was measured faster (decode graph sizes
            at capture; steps with prefill tokens from one measured eager step). Eager
            decode-only steps follow the thresholds alone.
        prefill_split: steps with prefill tokens may split (set by the measurement).
        prefill_split_timings: (plain ms, split ms) of that measurement.
        graph_timings: per decode graph size, (plain ms, split ms) of the replays.
    """

    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512
    measure_split: bool = True
    prefill_split: bool = True
    prefill_split_timings: tuple[float, float] | None = None
    graph_timings: dict[int, tuple[float, float]] = field(default_factory=dict)

    def wants_split(self, num_tokens: int, decode_only: bool) -> bool:
        """This rank's eager-step view: above the threshold, and for steps with prefill
        tokens not measured slower."""
        if not decode_only and not self.prefill_split:
            return False
        threshold = self.decode_token_threshold if decode_only else self.prefill_token_threshold
        return num_tokens >= threshold and can_split(num_tokens)

    def graph_split_candidates(self, sizes: list[int]) -> set[int]:
        """Decode capture sizes captured as split graphs (before any measurement)."""
        return {s for s in sizes if s >= self.decode_token_threshold and can_split(s)}

    def keep_split(self, size: int, plain_ms: float, split_ms: float) -> bool:
        """Keep the split graph of ``size``? Only if every rank whose forwards exchange data
        measured it faster (timings differ between ranks; the choice must not)."""
        self.graph_timings[size] = (plain_ms, split_ms)
        return bool(ps.forward_min(int(split_ms < plain_ms)))

    def set_prefill_split(self, plain_ms: float, split_ms: float) -> bool:
        """Record the measured eager step; steps with prefill tokens split from now on only
        if every rank whose forwards exchange data found the split faster."""
        self.prefill_split_timings = (plain_ms, split_ms)
        self.prefill_split = bool(ps.forward_min(int(split_ms < plain_ms)))
        return self.prefill_split


def agree_across_dp(group: dist.ProcessGroup | None, num_tokens: int, wants_split: bool,
                    graph_ok: bool) -> tuple[int, bool, bool]:
    """One all-reduce (MAX) over the DP group of ``[1 - wants_split, num_tokens, 1 -
    graph_ok]`` (no collective without a group of several ranks).

    Returns:
        (largest token count of any rank, every rank wants a split, every rank can replay
        a graph).
    """
    if group is None or dist.get_world_size(group) == 1:
        return num_tokens, wants_split, graph_ok
    t = torch.tensor([int(not wants_split), num_tokens, int(not graph_ok)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    no_split, max_tokens, no_graph = t.tolist()
    return max_tokens, not no_split, not no_graph


def smallest_capture_size(sizes: list[int] | None, num_tokens: int) -> int | None:
    """The smallest of the ascending capture ``sizes`` holding ``num_tokens`` rows; None if
    none does (or no sizes)."""
    return next((s for s in sizes or () if s >= num_tokens), None)


@dataclass
class StepPlanner:
    """Plans every step of one model runner (see the module docstring).

    Args:
        dbo: the split policy; None: DBO off (or a dense model).
        graph_sizes: decode CUDA-graph capture sizes, ascending; None: eager only.
        graph_split_sizes: the capture sizes whose graph is split (set at capture).
        dp_group: the data-parallel group whose forwards must match (expert
            parallelism); None: this rank plans alone.
        min_prompt_tokens: fewest rows of an eager forward holding prompt tokens
            (:data:`CPU_MIN_PROMPT_TOKENS` on the CPU; 0: no minimum).
        verify_sizes: verification CUDA-graph capture sizes (sequences), ascending; None: none.
        verify_query_len: rows per sequence of those graphs (``1 + K``).
    """

    dbo: DBOPolicy | None = None
    graph_sizes: list[int] | None = None
    graph_split_sizes: set[int] = field(default_factory=set)
    dp_group: dist.ProcessGroup | None = None
    min_prompt_tokens: int = 0
    verify_sizes: list[int] | None = None
    verify_query_len: int = 0

    def graph_size(self, num_tokens: int) -> int | None:
        """The smallest capture size holding ``num_tokens`` rows; None if none does."""
        return smallest_capture_size(self.graph_sizes, num_tokens)

    def plan(self, num_tokens: int, decode_only: bool, with_prompt: bool = False, num_reqs: int = 0,
             max_query_len: int = 1) -> StepPlan:
        """The plan of a step of ``num_tokens`` tokens of ``num_reqs`` sequences on this rank
        (0: an idle DP rank; ``decode_only``: every sequence adds one token; ``with_prompt``:
        some token is a prompt token; ``max_query_len``: most tokens of one sequence). Every
        DP rank must call this once per step when a ``dp_group`` is set."""
        verify = self._verify_size(num_reqs, max_query_len, decode_only, with_prompt)
        if verify is not None:
            return StepPlan(StepMode.GRAPH, num_tokens, verify * self.verify_query_len, query_len=self.verify_query_len)
        graph_ok = self.graph_sizes is not None and (num_tokens == 0 or (decode_only and num_tokens <= self.graph_sizes[-1]))
        rows = max(num_tokens, self.min_prompt_tokens) if with_prompt else num_tokens
        max_tokens, split, graph = agree_across_dp(self.dp_group, rows, self._wants_split(num_tokens, decode_only, graph_ok),
                                                   graph_ok)
        if max_tokens == 0:
            return StepPlan(StepMode.IDLE, 0, 0)
        if graph:
            size = self.graph_size(max_tokens)
            return StepPlan(StepMode.GRAPH, num_tokens, size,
                            ubatch_slices(size) if size in self.graph_split_sizes else None)
        padded = max_tokens if self.dp_group is not None else rows
        return StepPlan(StepMode.EAGER, num_tokens, padded, ubatch_slices(padded) if split else None)

    def _verify_size(self, num_reqs: int, max_query_len: int, decode_only: bool, with_prompt: bool) -> int | None:
        """The verification graph's capture size for this step, or None (a decode step, a
        prompt, a longer query, a larger batch, or ranks that must agree on the step)."""
        if (self.verify_sizes is None or decode_only or with_prompt or self.dp_group is not None
                or not 1 < max_query_len <= self.verify_query_len):
            return None
        return smallest_capture_size(self.verify_sizes, num_reqs)

    def _wants_split(self, num_tokens: int, decode_only: bool, graph_ok: bool) -> bool:
        if self.dbo is None:
            return False
        if num_tokens == 0:
            # An idle rank runs padding only and follows the busy ranks: its vote must not
            # veto their split.
            return True
        if graph_ok:
            # Used only if some rank cannot replay a graph (an eager step): the capture-time
            # choice for this rank's size.
            return self.graph_size(num_tokens) in self.graph_split_sizes
        return self.dbo.wants_split(num_tokens, decode_only)
