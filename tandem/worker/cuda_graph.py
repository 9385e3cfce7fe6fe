"""CUDA graphs of decode steps.

A decode step (every sequence adds one token) of ``n`` sequences replays the graph captured
for the capture size its step plan names (:mod:`tandem.worker.step_plan`: the smallest
capture size ``>= n`` of 1, 2, 4, multiples of 8 up to 256, then multiples of 16 up to
``max_num_seqs``, as vLLM does; under data + expert parallelism the size for the largest batch of any rank, and an
idle rank replays padding only), with the real sequences in its first ``n`` rows and
padding rows that write their K/V into the null block. Inputs travel
through persistent device buffers; the graph's output is the final hidden states
``[size, hidden]``.

With speculative decoding the same holds for steps that verify drafts (vLLM's "uniform
decode" graphs of query length ``1 + K``): every sequence owns ``query_len`` rows, its
tokens first, then padding rows (no K/V written; their positions follow its tokens, so
that causal attention keeps them out of its tokens' outputs; past the longest context they
read the null block). A step whose sequences hold
at most ``query_len`` generated tokens each replays them: the target's verification of
``K`` drafts, and the draft model's catch-up over a verified step's accepted tokens.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.distributed import parallel_state as ps
from tandem.progress import Progress
from tandem.worker.step_plan import DBOPolicy, smallest_capture_size, ubatch_slices
from tandem.worker.ubatching import forward_step

logger = logging.getLogger(__name__)


def cuda_median_ms(fn, warmup: int, iters: int) -> float:
    """Median wall time (ms, CUDA events on the current stream) of ``iters`` calls of
    ``fn()`` after ``warmup`` untimed ones; synchronizes after each call."""
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return float(np.median(times))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured for ``max_num_seqs`` (module docstring); the largest is ``max_num_seqs``."""
    sizes = ([s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, min(max_num_seqs, 256) + 1, 8))
             + list(range(272, max_num_seqs + 1, 16)))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


MAX_VERIFY_GRAPH_TOKENS = 512
"""Most rows (sequences x ``1 + K``) of a verification graph, as vLLM caps its captures."""


def verify_capture_sizes(max_num_seqs: int, max_spec_batch: int | None, query_len: int) -> list[int]:
    """Batch sizes of the verification graphs: the decode capture sizes up to the largest
    batch that speculates (``max_spec_batch``, None: ``max_num_seqs``) whose rows fit
    :data:`MAX_VERIFY_GRAPH_TOKENS` (at least size 1)."""
    limit = min(max_num_seqs, max_spec_batch or max_num_seqs, max(1, MAX_VERIFY_GRAPH_TOKENS // query_len))
    return capture_sizes(limit)


class DecodeCUDAGraphs:
    """Captured decode forwards of one model, one per capture size.

    Args:
        model: ``forward(input_ids, positions, kv_caches, meta) -> hidden``.
        kv_caches: the per-layer paged caches.
        max_num_seqs: largest batch captured.
        max_blocks_per_seq: width of the block-table buffer.
        block_size: tokens per KV block.
        device: a CUDA device.
        dbo: the dual-batch overlap policy (the model needs ``forward_steps``); None: off.
            Sizes from its decode threshold up are captured as split graphs: two ubatches
            of half the rows each, their forwards interleaved at the MoE dispatch/combine
            yield points. With ``dbo.measure_split`` the plain graph of each such size is
            captured too, the replays of both are timed (median of a few, CUDA events) and
            the split one kept only where :meth:`DBOPolicy.keep_split` says (faster on
            every rank whose forwards exchange data), so that DBO never slows a decode step
            down (splitting re-reads every weight per ubatch, which costs more than it
            hides when the link is fast against compute). The timed replays run on the
            capture buffers (context of one token): attention, which both variants share,
            is under-weighted, which favours the unsplit graph.
        sizes: capture sizes (default: ``capture_sizes(max_num_seqs)``).
        label: what the graphs are, for the progress bar and log ("decode"; a
            speculative-decoding proposer's: "draft").
        query_len: rows per sequence (module docstring): 1 for decode steps; more for
            steps that verify drafts (no DBO then).
        max_position: largest position the model embeds (padding rows are clamped to it).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, dbo: DBOPolicy | None = None,
                 sizes: list[int] | None = None, label: str = "decode", query_len: int = 1,
                 max_position: int | None = None) -> None:
        if query_len < 1 or (query_len > 1 and dbo is not None):
            raise ValueError(f"query_len must be >= 1 (and 1 with dual-batch overlap), got {query_len}")
        self.model = model
        self.label = label
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        n, q = self.max_size, query_len
        self.query_len = q
        self.max_position = max_position if max_position is not None else max_blocks_per_seq * block_size - 1
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        self.num_computed = torch.zeros(n, dtype=torch.int32, device=device)
        # Every ubatch's query_start_loc restarts at 0: one arange serves all.
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
        # Padding rows of a sequence near the longest context sit past it: the extra
        # columns map them to the null block.
        self.max_blocks_per_seq = max_blocks_per_seq + -(-(q - 1) // block_size)
        self.block_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.block_size = block_size
        self.dbo = dbo
        self.split_sizes = dbo.graph_split_candidates(self.sizes) if dbo is not None else set()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.device = device

    def _meta(self, token_start: int, token_end: int) -> AttentionMetadata:
        q = self.query_len
        start, end = token_start // q, token_end // q
        size = end - start
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[start:end],
            num_computed_tokens=self.num_computed[start:end],
            block_tables=self.block_tables[start:end],
            slot_mapping=self.slot_mapping[token_start:token_end],
            max_query_len=q,
            # The longest possible context: eager warm-up then picks the kernel variants
            # (e.g. the decode split count) that the capture uses.
            max_seq_len=self.max_blocks_per_seq * self.block_size,
            query_start_loc_cpu=list(range(0, (size + 1) * q, q)),
            seq_lens_cpu=[q] * size,
            num_decode_reqs=size if q == 1 else 0,
        )

    def _forward(self, size: int, split: bool) -> torch.Tensor:
        tokens = size * self.query_len
        return forward_step(self.model, self.kv_caches, self.input_ids, self.positions, tokens,
                            ubatch_slices(size) if split else None, self._meta)

    def _capture(self, size: int, split: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._forward(size, split)  # compile / autotune kernels outside the capture
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._forward(size, split)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def _replay_ms(self, g: torch.cuda.CUDAGraph) -> float:
        return cuda_median_ms(g.replay, warmup=2, iters=5)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so that smaller graphs reuse its memory pool."""
        with Progress(f"Capturing {self.label} CUDA graphs", logger, total=len(self.sizes), unit="graphs",
                      show=ps.get_rank() == 0) as progress:
            for size in reversed(self.sizes):
                progress.stage(f"batch size {size}")
                split = size in self.split_sizes
                g, out = self._capture(size, split)
                if split and self.dbo.measure_split:
                    plain_g, plain_out = self._capture(size, False)
                    if not self.dbo.keep_split(size, self._replay_ms(plain_g), self._replay_ms(g)):
                        self.split_sizes.discard(size)
                        g, out = plain_g, plain_out
                self.graphs[size], self.outputs[size] = g, out
                progress.update()
            torch.cuda.synchronize(self.device)
        logger.info("captured %s CUDA graphs for batch sizes %s", self.label, self.sizes)
        if self.dbo is not None and self.dbo.graph_timings:
            logger.info("dual-batch overlap kept for decode sizes %s (replay ms plain/split: %s)", sorted(self.split_sizes),
                        {s: f"{a:.2f}/{b:.2f}" for s, (a, b) in sorted(self.dbo.graph_timings.items())})

    def run(self, n: int, input_ids: torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, num_computed: np.ndarray, block_table: torch.Tensor, size: int,
            query_start_loc: np.ndarray | None = None) -> torch.Tensor:
        """Replay the graph of capture size ``size`` (the step plan's: under data + expert
        parallelism the one for the largest batch of any rank, so that the ranks' exchanges
        match) for ``n <= size`` sequences; returns hidden states ``[num_tokens, hidden]``.

        ``input_ids`` ``[num_tokens]`` and ``block_table`` ``[n, width]`` int32 are device
        tensors (the ids may hold the previous step's samples); the rest are host arrays
        (``positions`` / ``slot_mapping`` per token, ``seq_lens`` / ``num_computed`` per
        sequence), copied into the persistent buffers without a host sync. With
        ``query_len > 1``, ``query_start_loc`` ``[n + 1]`` gives each sequence's tokens
        (at most ``query_len`` each; None: one each).
        """
        h2d = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        q = self.query_len
        rows = None
        if q > 1:
            qsl = np.arange(n + 1, dtype=np.int64) if query_start_loc is None else query_start_loc
            rows, positions, slot_mapping = self._padded_rows(qsl, num_computed, slot_mapping)
            seq_lens = num_computed + q
        rows_d = None if rows is None else h2d(rows)
        if rows is None:
            self.input_ids[: len(input_ids)].copy_(input_ids)
        else:
            self.input_ids[: n * q].index_copy_(0, rows_d, input_ids)
        self.positions[: len(positions)].copy_(h2d(positions))
        self.slot_mapping[: len(slot_mapping)].copy_(h2d(slot_mapping))
        self.seq_lens[:n].copy_(h2d(seq_lens.astype(np.int32)))
        self.num_computed[:n].copy_(h2d(num_computed.astype(np.int32)))
        width = block_table.shape[1]
        self.block_tables[:n, :width].copy_(block_table)
        if q > 1:
            self.block_tables[:n, width:].fill_(0)
        out = self._replay(n, size)
        return out if rows_d is None else out.index_select(0, rows_d)

    def _padded_rows(self, qsl: np.ndarray, num_computed: np.ndarray, slot_mapping: np.ndarray
                     ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """For ``query_len > 1``: each token's row in the padded layout (None when every
        sequence fills its rows), and every row's position and cache slot (-1 on padding)."""
        q, n = self.query_len, len(qsl) - 1
        q_lens = np.diff(qsl)
        if q_lens.max(initial=0) > q:
            raise ValueError(f"a sequence has {int(q_lens.max())} tokens; these graphs hold {q} per sequence")
        positions = np.minimum(np.repeat(num_computed.astype(np.int64), q) + np.tile(np.arange(q), n), self.max_position)
        if (q_lens == q).all():
            return None, positions, slot_mapping
        rows = np.repeat(np.arange(n) * q - qsl[:-1], q_lens) + np.arange(int(qsl[-1]))
        slots = np.full(n * q, -1, dtype=np.int64)
        slots[rows] = slot_mapping
        return rows, positions, slots

    def size_for(self, n: int) -> int | None:
        """The smallest capture size holding ``n`` rows; None above the largest."""
        return smallest_capture_size(self.sizes, n)

    def run_padding(self, size: int) -> None:
        """Replay the graph of ``size`` with padding rows only: an idle data-parallel rank's
        share of the expert-parallel exchanges."""
        self._replay(0, size)

    def _replay(self, n: int, size: int) -> torch.Tensor:
        q = self.query_len
        if size > n:
            self.slot_mapping[n * q: size * q].fill_(-1)
            self.seq_lens[n:size].fill_(q)
            if q > 1:  # the causal kernel reads a row's keys up to its context: none
                self.num_computed[n:size].fill_(0)
            self.block_tables[n:size, 0].fill_(0)
        self.graphs[size].replay()
        return self.outputs[size][: n * q]
