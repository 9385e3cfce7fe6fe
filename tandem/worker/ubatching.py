"""A step's forward inputs, their ubatches, and the one forward executor.

Dual-batch overlap (DBO; vLLM "[Core/DBO][1/N] Add Dual-Batch Overlap mechanism", SGLang
two-batch overlap) cuts a step's flattened tokens in two where
:func:`tandem.worker.step_plan.ubatch_slices` says. A request whose tokens straddle the cut
appears in both ubatches: the second part's ``num_computed_tokens`` is advanced by the
tokens of the first part, so each ubatch's attention sees exactly the keys an unsplit step
would (the first part's K/V are written to the paged cache by the first ubatch before the
second reads them in stream order).

:func:`forward_step` runs a forward as its :class:`~tandem.worker.step_plan.StepPlan` says,
for eager steps and CUDA-graph capture alike; :func:`run_ubatches` alternates the two
ubatches' generator-based forwards (one thread), each under its own forward context (its
ubatch id selects its all-to-all buffers); both must yield the same number of times.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.distributed.forward_context import ForwardContext, RowPhases, forward_context
from tandem.distributed.pipeline import IntermediateTensors
from tandem.worker.step_plan import UBatchSlice


@dataclass
class StepInputs:
    """Host-side inputs of one forward pass (a step or a ubatch).

    Host arrays: ``input_ids`` / ``positions`` / ``slot_mapping`` ``[num_tokens]`` int64,
    ``query_start_loc`` ``[num_reqs + 1]``, ``num_computed`` / ``seq_lens`` ``[num_reqs]``;
    ``block_table``: ``[num_reqs, width]`` int32 tensor (on the device: gathered from the
    persistent input batch). ``prev_dst`` / ``prev_src``: token positions whose input id is
    the previous step's sample (row ``prev_src`` of it). ``prompt_lens``: ``[num_reqs]``
    int64, each request's prompt length (None: not tracked; see :meth:`generated_mask`).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    seq_lens: np.ndarray
    block_table: torch.Tensor
    prev_dst: list[int]
    prev_src: list[int]
    prompt_lens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        """Most tokens of one request in the step (0 without requests)."""
        return int(np.diff(self.query_start_loc).max()) if self.num_reqs else 0

    def num_decode_reqs(self) -> int:
        q = np.diff(self.query_start_loc)
        nz = np.flatnonzero(q != 1)
        return int(nz[0]) if len(nz) else len(q)

    def generated_mask(self) -> np.ndarray | None:
        """``[num_tokens]`` bool: the token is at or past its request's prompt length (a
        generated token, decoded or recomputed); None when prompt lengths are not tracked."""
        if self.prompt_lens is None:
            return None
        q_lens = np.diff(self.query_start_loc)
        per_token = self.prompt_lens if len(q_lens) == self.num_tokens else np.repeat(self.prompt_lens, q_lens)
        return self.positions >= per_token

    def metadata(self, device: torch.device) -> AttentionMetadata:
        """Attention metadata on ``device`` (non-blocking copies, no host sync)."""
        h2d = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            query_start_loc=h2d(self.query_start_loc.astype(np.int32)),
            seq_lens=h2d(self.seq_lens.astype(np.int32)),
            num_computed_tokens=h2d(self.num_computed.astype(np.int32)),
            block_tables=self.block_table.to(device, non_blocking=True),
            slot_mapping=h2d(self.slot_mapping),
            max_query_len=self.max_query_len,
            max_seq_len=int(self.seq_lens.max()) if len(self.seq_lens) else 0,
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            num_decode_reqs=self.num_decode_reqs(),
        )

    def slice_tokens(self, start: int, end: int) -> "StepInputs":
        """The ubatch made of flattened tokens ``[start, end)``."""
        qsl = self.query_start_loc
        r0 = int(np.searchsorted(qsl, start, side="right")) - 1
        r1 = int(np.searchsorted(qsl, end, side="left"))
        starts = np.maximum(qsl[r0:r1], start)
        ends = np.minimum(qsl[r0 + 1 : r1 + 1], end)
        # Tokens of a request that fall before the cut are already computed for this part.
        skipped = starts - qsl[r0:r1]
        num_computed = self.num_computed[r0:r1] + skipped
        q_lens = ends - starts
        new_qsl = np.zeros(len(q_lens) + 1, dtype=qsl.dtype)
        np.cumsum(q_lens, out=new_qsl[1:])
        prev = [(d - start, s) for d, s in zip(self.prev_dst, self.prev_src) if start <= d < end]
        return StepInputs(
            input_ids=self.input_ids[start:end],
            positions=self.positions[start:end],
            slot_mapping=self.slot_mapping[start:end],
            query_start_loc=new_qsl,
            num_computed=num_computed,
            seq_lens=num_computed + q_lens,
            block_table=self.block_table[r0:r1],
            prev_dst=[d for d, _ in prev],
            prev_src=[s for _, s in prev],
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[r0:r1],
        )


def empty_step_inputs() -> StepInputs:
    """A step with no tokens (an idle data-parallel rank), to be padded."""
    z = np.zeros(0, dtype=np.int64)
    return StepInputs(z, z, z, np.zeros(1, dtype=np.int64), z, z, torch.zeros((0, 1), dtype=torch.int32), [], [])


def pad_step_inputs(inputs: StepInputs, num_tokens: int, block_size: int) -> StepInputs:
    """Append padding tokens up to ``num_tokens`` as one extra request.

    Padding tokens have id 0 and RoPE position 0, write their K/V into the null block
    (slot -1) and attend only to it (a block table row of zeros, wide enough for the
    padding request's own length), so they change nothing.
    """
    pad = num_tokens - inputs.num_tokens
    if pad <= 0:
        return inputs
    zeros = np.zeros(pad, dtype=np.int64)
    width = max(inputs.block_table.shape[1], -(-pad // block_size))
    table = inputs.block_table.new_zeros((inputs.num_reqs + 1, width))
    table[: inputs.num_reqs, : inputs.block_table.shape[1]] = inputs.block_table
    return StepInputs(
        input_ids=np.concatenate([inputs.input_ids, zeros]),
        positions=np.concatenate([inputs.positions, zeros]),
        slot_mapping=np.concatenate([inputs.slot_mapping, np.full(pad, -1, dtype=np.int64)]),
        query_start_loc=np.append(inputs.query_start_loc, num_tokens),
        num_computed=np.append(inputs.num_computed, 0),
        seq_lens=np.append(inputs.seq_lens, pad),
        block_table=table,
        prev_dst=inputs.prev_dst,
        prev_src=inputs.prev_src,
        # Padding tokens count as prompt tokens (position 0 < pad).
        prompt_lens=None if inputs.prompt_lens is None else np.append(inputs.prompt_lens, pad),
    )


def run_ubatches(first: Generator, second: Generator,
                 contexts: tuple[ForwardContext, ForwardContext] | None = None) -> tuple[object, object]:
    """Alternate two forward generators until both return; returns their results.

    Each ``next`` runs one ubatch up to its next yield point (e.g. right after launching an
    all-to-all), so the other ubatch's compute is issued while that communication is in
    flight; with ``contexts``, ubatch ``i`` runs under ``contexts[i]``. Both must pass the
    same number of yield points.

    Raises:
        AssertionError: the ubatches yielded a different number of times.
        Exception: whatever a ubatch raised; the other generator is closed first, so no
            ubatch is left suspended mid-step.
    """
    gens = [first, second]
    results: list[object] = [None, None]
    done = [False, False]
    yields = [0, 0]
    try:
        while not all(done):
            for i, g in enumerate(gens):
                if done[i]:
                    continue
                try:
                    if contexts is None:
                        next(g)
                    else:
                        with forward_context(contexts[i]):
                            next(g)
                    yields[i] += 1
                except StopIteration as stop:
                    done[i] = True
                    results[i] = stop.value
    except BaseException:
        for g in gens:
            g.close()
        raise
    assert yields[0] == yields[1], f"ubatches passed {yields[0]} and {yields[1]} yield points"
    return results[0], results[1]


def forward_step(model, kv_caches: list[torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor,
                 padded_tokens: int, ubatches: tuple[UBatchSlice, UBatchSlice] | None,
                 metadata: Callable[[int, int], AttentionMetadata],
                 row_phases: Callable[[int, int], RowPhases | None] | None = None,
                 intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
    """Run the model over ``padded_tokens`` tokens, whole or as two overlapped ubatches.

    Args:
        model: ``forward(ids, positions, kv_caches, meta)``; with ``ubatches`` also
            ``forward_steps`` (the same forward as a generator yielding at its exchanges).
        input_ids / positions: ``[padded_tokens]`` int64 device tensors.
        ubatches: the plan's two ubatch slices, or None.
        metadata: ``(start, stop) -> AttentionMetadata`` of tokens ``[start, stop)``.
        row_phases: ``(start, stop) ->`` the :class:`RowPhases` of tokens ``[start,
            stop)``, set in their forward context; None: not known.
        intermediate: on a pipeline stage after the first, the previous stage's residual
            stream (not with ``ubatches``).

    Returns:
        hidden states ``[padded_tokens, hidden]`` (a pipeline stage before the last: its
        :class:`~tandem.distributed.pipeline.IntermediateTensors`). Multi-rank exchanges pad
        to the largest forward (or ubatch) of the step, which every rank runs alike.
    """
    phases = row_phases or (lambda start, stop: None)
    if ubatches is None:
        # Only a split model takes the previous stage's tensors (the others have no such argument).
        stage_in = {} if intermediate is None else {"intermediate": intermediate}
        with forward_context(ForwardContext(padded_tokens, row_phases=phases(0, padded_tokens))):
            return model(input_ids[:padded_tokens], positions[:padded_tokens], kv_caches, metadata(0, padded_tokens),
                         **stage_in)
    size = max(u.num_tokens for u in ubatches)
    gens = [model.forward_steps(input_ids[u.token_start:u.token_stop], positions[u.token_start:u.token_stop], kv_caches,
                                metadata(u.token_start, u.token_stop)) for u in ubatches]
    contexts = tuple(ForwardContext(size, ubatch_id=i, row_phases=phases(u.token_start, u.token_stop))
                     for i, u in enumerate(ubatches))
    return torch.cat(run_ubatches(*gens, contexts=contexts))
