"""Draft-model proposer: a smaller model of the same vocabulary proposes each sequence's
next ``K`` tokens (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023; vLLM's
``"method": "draft_model"``).

The draft model keeps its own paged KV cache with as many blocks as the target's, addressed
by the same block ids: a token's draft K/V sits in the slot of its target K/V. Prefix
caching, preemption and freeing therefore need nothing of their own: a block the target
reuses from the prefix cache holds the draft K/V of the same tokens too, because every
target forward is mirrored by a draft forward over the same tokens.

Per step, once the target has sampled (:meth:`DraftModelProposer.propose`, driven by
:class:`~tandem.worker.model_runner.ModelRunner`), ``K`` draft forwards:

1. *catch-up*: one forward over each sequence's confirmed tokens of the step (a prompt
   chunk, a decode's input token, a verified sequence's last token and accepted drafts; its
   rejected drafts are left out) followed, for each sequence that sampled, by the token it
   emitted; the logits of that last token give its first draft. So the draft cache always
   holds the K/V of confirmed tokens, as the target's does. The confirmed tokens whose K/V
   the previous proposal already wrote (the token it drafted after and the accepted drafts
   but the last: each was fed to the draft model at its position, over the same context) are
   left out, so that after a verified step the catch-up is one or two rows per sequence (the
   last draft when all were accepted, and the emitted token); a proposal's record is dropped
   when its sequence finishes or is preempted (:meth:`DraftModelProposer.forget`);
2. ``K - 1`` one-token forwards, each feeding its greedy (argmax) draft to the next. On
   CUDA (unless ``enforce_eager``) these replay CUDA graphs captured per batch size, as the
   target's decode steps do (:meth:`DraftModelProposer.capture_cuda_graphs`), and so does the
   catch-up after a verified step (at most ``K + 2`` rows per sequence, padded); a catch-up
   over prompt tokens runs eagerly.

The rejection sampler treats a draft as a point mass (vLLM's draft-model and EAGLE paths do
the same), which keeps the target's distribution.

A draft at position ``p`` writes its K/V at ``p``: the scheduler allocates ``K`` lookahead
slots past each sampling sequence's step for it (``Scheduler(num_lookahead_tokens=K)``).
Where it could not (no free block), or past ``max_model_len``, the write is skipped (slot
-1): later drafts of that sequence then attend to stale keys, which costs acceptance, never
correctness. A draft's K/V is overwritten by the catch-up when the sequence reaches its
position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from tandem.distributed.forward_context import RowPhases
from tandem.model_loader.loader import load_tokenizer
from tandem.worker.cuda_graph import DecodeCUDAGraphs
from tandem.worker.ubatching import StepInputs, forward_step


def check_draft_model(target_hf, draft_hf, target_tokenizer: str, draft_path: str, max_model_len: int,
                      compare_tokenizers: bool = True) -> None:
    """Refuse a draft model the target cannot verify: another vocabulary (size, or tokens:
    with ``compare_tokenizers`` the tokenizers of ``target_tokenizer`` and ``draft_path``
    are compared unless they are the same path) or a context shorter than ``max_model_len``.

    Raises:
        ValueError: naming ``speculative_config.model`` and what differs.
    """
    name = f"speculative_config.model {draft_path!r}"
    if draft_hf.vocab_size != target_hf.vocab_size:
        raise ValueError(f"{name} has a vocabulary of {draft_hf.vocab_size} tokens, the target "
                         f"{target_hf.vocab_size}: the draft model must share the target's tokenizer.")
    context = getattr(draft_hf, "max_position_embeddings", max_model_len)
    if context < max_model_len:
        raise ValueError(f"{name} has a context of {context} tokens, below max_model_len ({max_model_len}): "
                         f"lower --max-model-len.")
    if compare_tokenizers and os.path.realpath(draft_path) != os.path.realpath(target_tokenizer) and \
            load_tokenizer(draft_path).get_vocab() != load_tokenizer(target_tokenizer).get_vocab():
        raise ValueError(f"{name} has another tokenizer than the target (same size, other tokens): the draft "
                         f"model must share the target's tokenizer.")


@dataclass
class DraftStep:
    """A sampled target step as a model-based proposer takes it in (built by the model
    runner; every array host-side, every tensor on the device).

    ``S`` sequences, ``T`` step tokens; ``R`` of the sequences emitted a token.
    """

    inputs: StepInputs  # the target's step: num_computed, query_start_loc, prompt_lens
    input_ids: torch.Tensor  # [T] int64: the step's input ids
    keep: np.ndarray  # [S] int64: each sequence's confirmed step tokens (all but rejected drafts)
    sampled: np.ndarray  # [R] int64: the sequences (indices into S) that emitted, in the order of emitted
    emitted: torch.Tensor  # [R] int64: each one's last emitted token
    propose: bool  # drafts wanted after this step (else the proposer's cache only)
    block_table_np: np.ndarray  # [S, max_blocks] int32: the sequences' block ids (0: none)
    block_table: torch.Tensor  # [S, width] int32, width covering K positions past an emitted token
    # EAGLE: the target's hidden states of the step [T, H'] (the final ones, or the
    # concatenated inputs of the EAGLE-3 layers), and, for each sequence that did not emit,
    # its next known token (its prompt continues; -1 for those that emitted) [S] int64.
    target_hidden: torch.Tensor | None = None
    next_token_ids: np.ndarray | None = None
    # The sequences' ids [S] (a draft model leaves out the K/V its last proposal wrote).
    seq_ids: list[int] | None = None


class DraftModelProposer:
    """Greedy drafts of a draft model over its own paged KV cache.

    Args:
        model: a Tandem causal LM (``forward`` + ``compute_logits``) whose vocabulary is
            the target's.
        kv_caches: its cache, one ``[2, num_blocks, block_size, kv_heads, head_dim]``
            tensor per layer, ``num_blocks`` the target cache's.
        num_speculative_tokens: ``K``, drafts per sequence and step (>= 1).
        block_size: tokens per block (the target's).
        max_model_len: longest sequence; no draft K/V is written at or past it.
        device: where the model lives.
    """

    # The runner hands EAGLE heads the target's hidden states (DraftStep.target_hidden).
    uses_target_hidden = False

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], num_speculative_tokens: int,
                 block_size: int, max_model_len: int, device: torch.device) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.model = model
        self.kv_caches = kv_caches
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        self.catch_up_graphs: DecodeCUDAGraphs | None = None
        # Per sequence, what its last proposal wrote: the position of the token it drafted
        # after, and the cache slots of that token and the next K - 1 ([K] int64, -1: not written).
        self._written: dict[int, tuple[int, np.ndarray]] = {}

    def forget(self, seq_ids) -> None:
        """Drop the proposals' records of finished or preempted sequences (their blocks are
        freed: what the records say was written is gone)."""
        for sid in seq_ids:
            self._written.pop(sid, None)

    def capture_cuda_graphs(self, max_num_seqs: int, max_blocks_per_seq: int,
                            catch_up_sizes: list[int] | None = None) -> None:
        """Capture the one-token draft forwards (every draft after a step's first) as CUDA
        graphs, one per batch size up to ``max_num_seqs`` (:mod:`tandem.worker.cuda_graph`;
        ``max_blocks_per_seq``: the block tables' width); larger batches run eagerly. With
        ``catch_up_sizes`` (the target's verification graph sizes), also the catch-up over a
        verified step (at most ``K + 2`` tokens per sequence: the step's tokens and the one
        it emitted) for those batch sizes."""
        self.cuda_graphs = DecodeCUDAGraphs(self._graph_model(), self.kv_caches, max_num_seqs, max_blocks_per_seq,
                                            self.block_size, self.device, label="draft")
        self.cuda_graphs.capture()
        if catch_up_sizes:
            self.catch_up_graphs = DecodeCUDAGraphs(self.model, self.kv_caches, catch_up_sizes[-1], max_blocks_per_seq,
                                                    self.block_size, self.device, sizes=catch_up_sizes,
                                                    label="draft catch-up", query_len=self.num_speculative_tokens + 2,
                                                    max_position=self.max_model_len - 1)
            self.catch_up_graphs.pool = self.cuda_graphs.pool  # never replayed together
            self.catch_up_graphs.capture()

    def _graph_model(self) -> torch.nn.Module:
        """What the graphs capture: ``forward(ids, positions, kv_caches, meta) -> [n, H]``."""
        return self.model

    @torch.inference_mode()
    def propose(self, d: DraftStep) -> torch.Tensor | None:
        """Write the draft cache for a step's confirmed tokens and, when ``d.propose``,
        draft ``K`` tokens after each emitted one.

        Returns:
            ``[R, K]`` int64 on the device (draft ``k`` of sequence ``r`` follows draft
            ``k-1``, the first follows ``d.emitted[r]``); None without drafts.
        """
        step, keep = d.inputs, d.keep
        num_seqs = len(keep)
        emit_seqs = d.sampled if d.propose else np.zeros(0, dtype=np.int64)
        emits = np.zeros(num_seqs, dtype=np.int64)
        emits[emit_seqs] = 1
        skip = self._already_written(d, emit_seqs)
        todo = keep - skip
        q_lens = todo + emits
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        computed = step.num_computed + skip
        positions = np.arange(total, dtype=np.int64) + np.repeat(computed - qsl[:-1], q_lens)
        offsets = np.arange(int(todo.sum())) - np.repeat(np.cumsum(todo) - todo, todo)
        emit_at = qsl[emit_seqs] + todo[emit_seqs]
        ids = torch.empty(total, dtype=torch.long, device=self.device)
        ids[self._h2d(np.repeat(qsl[:-1], todo) + offsets)] = d.input_ids[self._h2d(
            np.repeat(step.query_start_loc[:-1] + skip, todo) + offsets)]
        if len(emit_seqs):
            ids[self._h2d(emit_at)] = d.emitted
        row_of_token = np.repeat(np.arange(num_seqs), q_lens)
        catch_up = StepInputs(np.zeros(total, dtype=np.int64), positions,
                              self._slots(d.block_table_np[row_of_token], positions), qsl, computed,
                              computed + q_lens, d.block_table, [], [], step.prompt_lens)
        hidden = self._catch_up(catch_up, ids)
        self._record(d, emit_seqs, positions[emit_at])
        if not len(emit_seqs):
            return None
        first = self.model.compute_logits(hidden[self._h2d(emit_at)]).argmax(dim=-1)
        return self._decode(first, None, positions[emit_at] + 1, d.block_table_np[emit_seqs],
                            d.block_table[self._h2d(emit_seqs)])

    def _already_written(self, d: DraftStep, emit_seqs: np.ndarray) -> np.ndarray:
        """``[S]``: each sequence's leading confirmed step tokens whose K/V its last proposal
        wrote into the slots they still map to (0 for a sequence that does not emit: its
        catch-up keeps a row)."""
        skip = np.zeros(len(d.keep), dtype=np.int64)
        if d.seq_ids is None or not self._written:
            return skip
        k = self.num_speculative_tokens
        for i in emit_seqs:
            record = self._written.get(d.seq_ids[i])
            if record is None or record[0] != d.inputs.num_computed[i]:
                continue
            pos, slots = record
            now = self._slots(np.repeat(d.block_table_np[i:i + 1], k, axis=0), pos + np.arange(k))
            same = (slots >= 0) & (slots == now)
            skip[i] = min(int(d.keep[i]), k if same.all() else int(np.argmin(same)))
        return skip

    def _record(self, d: DraftStep, emit_seqs: np.ndarray, emit_positions: np.ndarray) -> None:
        """Note, per emitting sequence, the slots its proposal writes: the emitted token's
        (in the catch-up) and the next ``K - 1`` drafts' (in :meth:`_decode`)."""
        if d.seq_ids is None:
            return
        if self._written:  # the step's sequences' older records (none while nothing speculates)
            for sid in d.seq_ids:
                self._written.pop(sid, None)
        k = self.num_speculative_tokens
        pos = emit_positions[:, None] + np.arange(k)[None, :]
        tables = np.repeat(d.block_table_np[emit_seqs], k, axis=0)
        slots = self._slots(tables, pos.reshape(-1)).reshape(-1, k)
        for j, i in enumerate(emit_seqs):
            self._written[d.seq_ids[i]] = (int(emit_positions[j]), slots[j])

    def _decode(self, first: torch.Tensor, hidden: torch.Tensor | None, positions: np.ndarray,
                block_table_np: np.ndarray, block_table: torch.Tensor) -> torch.Tensor:
        """``[R, K]``: ``first`` (``[R]``, fed at ``positions``), then ``K - 1`` greedy tokens,
        each from a one-token forward of the previous one (:meth:`_run`, given the previous
        forward's states for a head fed its own, ``hidden``; None for a draft model)."""
        num = len(positions)
        qsl = np.arange(num + 1, dtype=np.int64)
        ids, drafts = first, [first]
        for k in range(self.num_speculative_tokens - 1):
            pos = np.minimum(positions + k, self.max_model_len - 1)
            step = StepInputs(np.zeros(num, dtype=np.int64), pos, self._slots(block_table_np, positions + k), qsl, pos,
                              pos + 1, block_table, [], [])
            size = None if self.cuda_graphs is None else self.cuda_graphs.size_for(num)
            out, hidden = self._run(step, ids, hidden) if size is None else self._replay(step, ids, hidden, size)
            ids = self.model.compute_logits(out).argmax(dim=-1)
            drafts.append(ids)
        return torch.stack(drafts, dim=1)

    def _catch_up(self, inputs: StepInputs, ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, H]``: the catch-up forward; as a captured graph when no token in it
        is a prompt token and every sequence has one token in it (a step without drafts, as
        while ``disable_by_batch_size`` holds speculation off) or at most ``K + 2`` (after
        a verified step), else eager."""
        num = inputs.num_reqs
        generated = inputs.generated_mask()
        if self.cuda_graphs is None or not (generated is None or generated.all()):
            return self._forward(inputs, ids)
        if inputs.num_tokens == num:
            size = self.cuda_graphs.size_for(num)
            return self._forward(inputs, ids) if size is None else self._replay(inputs, ids, None, size)[0]
        graphs = self.catch_up_graphs
        size = None if graphs is None else graphs.size_for(num)
        if size is None or inputs.max_query_len > graphs.query_len:
            return self._forward(inputs, ids)
        return graphs.run(num, ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, inputs.num_computed,
                          inputs.block_table, size, inputs.query_start_loc)

    def _run(self, inputs: StepInputs, ids: torch.Tensor, hidden: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward: (states for logits, states for the next position: none here)."""
        return self._forward(inputs, ids), None

    def _replay(self, step: StepInputs, ids: torch.Tensor, hidden: torch.Tensor | None, size: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_run` of a one-token step as the CUDA graph of capture ``size``."""
        return self.cuda_graphs.run(step.num_reqs, ids, step.positions, step.slot_mapping, step.seq_lens,
                                    step.num_computed, step.block_table, size), None

    def _slots(self, table_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slots of ``positions`` (``[N]``; ``table_rows`` ``[N, max_blocks]``: each
        one's block ids), -1 (no write) past ``max_model_len`` or in a block not allocated."""
        inside = positions < self.max_model_len
        pos = np.minimum(positions, self.max_model_len - 1)
        blocks = table_rows[np.arange(len(pos)), pos // self.block_size].astype(np.int64)
        return np.where(inside & (blocks > 0), blocks * self.block_size + pos % self.block_size, -1)

    def _forward(self, inputs: StepInputs, ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, H]``: the draft model over ``inputs`` (eager, unpadded); its
        int4 layers take each row's phase from the prompt lengths (none given: generated)."""
        n = inputs.num_tokens
        generated = inputs.generated_mask()
        phases = (RowPhases(slice(0, n), slice(n, n), n, n) if generated is None
                  else RowPhases.from_mask(generated, self.device))
        return forward_step(self.model, self.kv_caches, ids, self._h2d(np.minimum(inputs.positions, self.max_model_len - 1)),
                            n, None, lambda start, stop: inputs.metadata(self.device), lambda start, stop: phases)

    def _h2d(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device, non_blocking=True)


__all__ = ["DraftModelProposer", "DraftStep", "check_draft_model"]
