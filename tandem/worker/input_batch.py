"""The persistent input batch: one row per live sequence, kept on the device across steps.

After vLLM's ``v1/worker/gpu_input_batch.py``. A sequence gets a row when it is first
scheduled (or rescheduled after a preemption) and keeps it until it finishes or is
preempted. The row holds its block table, its sampling parameters and, for penalised
sequences, its output-token counts and prompt-token mask, on the device, with host
mirrors of what the host needs (block ids for the slot mapping, flags that pick the
sampler's code paths). Each step only the rows of new sequences and the block ids appended
since the last step cross from the host (:meth:`InputBatch.flush`); the step's block table
and sampling tensors are gathered on the device by row index (one host-to-device copy of
the step's row indices).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tandem.core.sched_output import NewRequestData
from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import SamplingBatch, token_seed

# The per-row scalar sampling parameters: the columns of the fp32 table, by SamplingParams
# field (top_k is an integer < 2**24, exact in fp32). A new per-row scalar is a name here and
# its use in the sampler (SamplingBatch).
SCALAR_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty")
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(len(SCALAR_SAMPLING_FIELDS))


@dataclass
class BadWords:
    """A sequence's bad words on the device. ``single``: ``[S]`` ids always masked (one-token
    words). Longer words: ``prefix [W, L]`` (right-aligned, ``valid [W, L]`` marks the
    real ids) and ``last [W]``; ``last`` is masked when ``recent [L]``, the last L output
    ids (-1 before the first), ends with the word's prefix (vLLM's rule)."""

    single: torch.Tensor
    prefix: torch.Tensor
    valid: torch.Tensor
    last: torch.Tensor
    recent: torch.Tensor

    @classmethod
    def build(cls, words: list[list[int]], output_ids: list[int], device: torch.device) -> "BadWords":
        single = [w[0] for w in words if len(w) == 1]
        longer = [w for w in words if len(w) > 1]
        width = max((len(w) - 1 for w in longer), default=0)
        prefix = [[-1] * (width - len(w) + 1) + w[:-1] for w in longer]
        valid = [[False] * (width - len(w) + 1) + [True] * (len(w) - 1) for w in longer]
        recent = ([-1] * width + list(output_ids))[len(output_ids):] if width else []
        t = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        return cls(t(single, torch.long), t(prefix, torch.long).view(len(longer), width),
                   t(valid, torch.bool).view(len(longer), width), t([w[-1] for w in longer], torch.long),
                   t(recent, torch.long))

    def record(self, token: torch.Tensor) -> None:
        """Append this step's sampled id (``[1]`` int64 on the device)."""
        if self.recent.numel():
            self.recent = torch.cat([self.recent[1:], token])

    def bias(self, after: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, additive bias: -inf where banned now, else 0); with ``after``, as
        if those ids had been sampled too (a verified position's drafts before it)."""
        recent = self.recent
        if after and recent.numel():
            recent = torch.cat([recent, torch.tensor(after, dtype=torch.long, device=recent.device)])[-recent.numel():]
        match = ((self.prefix == recent[None, :]) | ~self.valid).all(dim=-1)
        vals = torch.where(match, float("-inf"), 0.0)
        single = torch.full(self.single.shape, float("-inf"), device=self.single.device)
        return torch.cat([self.single, self.last]), torch.cat([single, vals])


@dataclass
class CachedRequestState:
    """Host state of one sequence with a row (vLLM's ``CachedRequestState``)."""

    seq_id: int
    row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    compute_prompt_logprobs: bool
    num_blocks: int = 0
    # Output tokens known when the sequence got its row (after a preemption: recomputed with the prompt).
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def known_token(self, position: int) -> int:
        """The token at ``position`` of the tokens known when the sequence got its row
        (its prompt, then its outputs then).

        Raises:
            IndexError: a position past them.
        """
        p = self.prompt_len
        return self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]


class InputBatch:
    """Rows of the live sequences (see the module docstring).

    Args:
        max_num_seqs: rows.
        max_blocks_per_seq: block-table width (``ceil(max_model_len / block_size)``).
        vocab_size: width of the penalty tables.
        device: where the rows live.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.states: dict[int, CachedRequestState] = {}
        # Sequences that compute their prompt's logprobs (most steps have none to look at).
        self.prompt_logprobs_seq_ids: set[int] = set()
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.block_table_np = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.params = torch.zeros(max_num_seqs, len(SCALAR_SAMPLING_FIELDS), dtype=torch.float32, device=device)
        # Host mirrors of what picks the sampler's paths, indexed by row.
        self.greedy_np = np.zeros(max_num_seqs, dtype=bool)
        self.params_np = np.zeros((max_num_seqs, len(SCALAR_SAMPLING_FIELDS)), dtype=np.float32)
        self.has_penalty_np = np.zeros(max_num_seqs, dtype=bool)
        self.num_logprobs_np = np.full(max_num_seqs, -1, dtype=np.int64)
        self.num_sampled_np = np.zeros(max_num_seqs, dtype=np.int64)
        self.min_tokens_np = np.zeros(max_num_seqs, dtype=np.int64)
        self.seed: list[int | None] = [None] * max_num_seqs
        # Sparse per-row logit additions, on the device: logit_bias (ids, values) and the
        # stop ids masked while a sequence is below min_tokens.
        self.logit_bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_num_seqs
        self.min_tokens_stop_ids: list[torch.Tensor | None] = [None] * max_num_seqs
        self.bad_words: list[BadWords | None] = [None] * max_num_seqs
        self.has_bias_np = np.zeros(max_num_seqs, dtype=bool)  # logit_bias, min_tokens stop ids or bad words
        # allowed_token_ids: a [vocab] bool mask per row that has them.
        self.allowed: list[torch.Tensor | None] = [None] * max_num_seqs
        self.has_allowed_np = np.zeros(max_num_seqs, dtype=bool)
        self.has_bad_words_np = np.zeros(max_num_seqs, dtype=bool)
        # Penalty tables [rows, vocab], allocated when a penalised sequence first arrives.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        # The parts of the last step's SamplingBatch fixed by its rows' parameters, and those
        # rows (bytes of the int64 array): reused while the batch's rows stay the same.
        self._fixed_batch: tuple[bytes, SamplingBatch] | None = None
        # Host updates not yet on the device.
        self._new_rows: list[int] = []
        self._new_block_cells: list[tuple[int, int, int]] = []

    def _h2d(self, data, dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: a blocking host-to-device copy would wait for the in-flight step.
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ rows
    def add_request(self, data: NewRequestData) -> None:
        """Give a sequence a row (replacing any it had) and stage its parameters."""
        self.remove_request(data.seq_id)
        row = self._free_rows.pop()
        self._fixed_batch = None  # a row's parameters change
        p = data.sampling_params
        self.states[data.seq_id] = CachedRequestState(data.seq_id, row, p, data.prompt_token_ids,
                                                      data.compute_prompt_logprobs,
                                                      output_token_ids=data.output_token_ids)
        if data.compute_prompt_logprobs:
            self.prompt_logprobs_seq_ids.add(data.seq_id)
        self.block_table_np[row] = 0
        self.params_np[row] = [getattr(p, name) for name in SCALAR_SAMPLING_FIELDS]
        self.params_np[row, _TOP_K] = min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size
        self.greedy_np[row] = p.greedy
        self.has_penalty_np[row] = p.has_penalties
        self.num_logprobs_np[row] = -1 if p.logprobs is None else p.logprobs
        self.num_sampled_np[row] = data.num_output_tokens
        self.min_tokens_np[row] = p.min_tokens
        self.seed[row] = p.seed
        self.logit_bias[row] = None
        if p.logit_bias:
            self.logit_bias[row] = (self._h2d(list(p.logit_bias.keys()), torch.long),
                                    self._h2d(list(p.logit_bias.values()), torch.float32))
        stop_ids = sorted(p.all_stop_token_ids | set(p.stop_token_ids)) if p.min_tokens > 0 else []
        self.min_tokens_stop_ids[row] = self._h2d(stop_ids, torch.long) if stop_ids else None
        self.bad_words[row] = (BadWords.build(p.bad_words_token_ids, data.output_token_ids, self.device)
                               if p.bad_words_token_ids else None)
        self.has_bias_np[row] = bool(p.logit_bias) or bool(stop_ids) or self.bad_words[row] is not None
        self.has_bad_words_np[row] = self.bad_words[row] is not None
        self.allowed[row] = None
        self.has_allowed_np[row] = p.allowed_token_ids is not None
        if p.allowed_token_ids is not None:
            self.allowed[row] = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            self.allowed[row][self._h2d(p.allowed_token_ids, torch.long)] = True
        if p.has_penalties:
            self._init_penalty_row(row, data)
        self._new_rows.append(row)

    def _init_penalty_row(self, row: int, data: NewRequestData) -> None:
        if self.output_counts is None:
            rows = len(self.block_table_np)
            self.output_counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, self._h2d(data.prompt_token_ids, torch.long)] = True
        counts = torch.bincount(torch.tensor(data.output_token_ids, dtype=torch.long), minlength=self.vocab_size)
        self.output_counts[row].copy_(counts.to(torch.int32), non_blocking=True)

    def remove_request(self, seq_id: int) -> None:
        """Free a finished or preempted sequence's row (no-op for an unknown one)."""
        st = self.states.pop(seq_id, None)
        if st is not None:
            self._free_rows.append(st.row)
            self.prompt_logprobs_seq_ids.discard(seq_id)

    def append_blocks(self, seq_id: int, block_ids: list[int]) -> None:
        """Append KV blocks to a sequence's block table (staged for the device)."""
        if not block_ids:
            return
        st = self.states[seq_id]
        start, st.num_blocks = st.num_blocks, st.num_blocks + len(block_ids)
        self.block_table_np[st.row, start : st.num_blocks] = block_ids
        self._new_block_cells.extend((st.row, start + i, b) for i, b in enumerate(block_ids))

    def flush(self) -> None:
        """Copy the staged rows and block ids to the device (one copy each)."""
        if self._new_rows:
            rows = self._h2d(self._new_rows, torch.long)
            self.block_table[rows] = 0
            self.params[rows] = self._h2d(self.params_np[self._new_rows], torch.float32)
            self._new_rows = []
        if self._new_block_cells:
            cells = self._h2d(self._new_block_cells, torch.long)
            self.block_table.index_put_((cells[:, 0], cells[:, 1]), cells[:, 2].to(torch.int32))
            self._new_block_cells = []

    # ------------------------------------------------------------------ a step
    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """Rows ``[n]`` int64 of the given sequences."""
        return np.fromiter((self.states[s].row for s in seq_ids), dtype=np.int64, count=len(seq_ids))

    def sampling_batch(self, rows: np.ndarray, bad_words: bool = True) -> SamplingBatch:
        """The sampler's inputs for sequences in ``rows`` (batch row ``i`` = ``rows[i]``);
        without ``bad_words`` their masks are left out of the bias (speculative
        verification adds each position's own, :meth:`bad_words_bias`).

        What only the rows' parameters decide is built once for a set of rows and reused
        while a step's rows are the same as the previous one's (decode steps between two
        admissions or finishes); the seeds and the bias follow each row's token count."""
        key = rows.tobytes()
        if self._fixed_batch is None or self._fixed_batch[0] != key:
            self._fixed_batch = (key, self._fixed_sampling_batch(rows))
        fixed = self._fixed_batch[1]
        seeded = [(int(i), token_seed(self.seed[rows[i]], int(self.num_sampled_np[rows[i]])))
                  for i in np.flatnonzero(~self.greedy_np[rows]) if self.seed[rows[i]] is not None]
        bias = self._bias(rows, bad_words)
        return replace(fixed, seeded=seeded, bias=bias) if seeded or bias is not None else fixed

    def _fixed_sampling_batch(self, rows: np.ndarray) -> SamplingBatch:
        """A SamplingBatch of ``rows`` without seeds or bias."""
        rows_t = self._h2d(rows, torch.long)
        p = self.params[rows_t]
        greedy = self.greedy_np[rows]
        host = self.params_np[rows]
        random = ~greedy
        pen = np.flatnonzero(self.has_penalty_np[rows])
        pen_t = self._h2d(pen, torch.long) if len(pen) else None
        return SamplingBatch(
            temperature=p[:, _TEMPERATURE],
            top_k=p[:, _TOP_K].long(),
            top_p=p[:, _TOP_P],
            min_p=p[:, _MIN_P],
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            greedy_mask=None if greedy.all() or not greedy.any() else self._h2d(greedy, torch.bool),
            need_top_k=bool((host[random, _TOP_K] < self.vocab_size).any()),
            need_top_p=bool((host[random, _TOP_P] < 1.0).any()),
            need_min_p=bool((host[random, _MIN_P] > 0.0).any()),
            penalty_rows=pen_t,
            penalty_slots=rows_t[pen_t] if pen_t is not None else None,
            presence=p[pen_t, _PRESENCE] if pen_t is not None else None,
            frequency=p[pen_t, _FREQUENCY] if pen_t is not None else None,
            repetition=p[pen_t, _REPETITION] if pen_t is not None else None,
            bias=None,
            seeded=[],
            max_num_logprobs=int(self.num_logprobs_np[rows].max()) if len(rows) else -1,
            allowed=self._allowed(rows),
        )

    def _allowed(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch rows [A], masks [A, vocab]) of the rows with allowed_token_ids."""
        idx = np.flatnonzero(self.has_allowed_np[rows])
        if not len(idx):
            return None
        return self._h2d(idx, torch.long), torch.stack([self.allowed[rows[i]] for i in idx])

    def _bias(self, rows: np.ndarray, bad_words: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(batch rows, token ids, values) of logit_bias, bad words (unless not
        ``bad_words``) and the min_tokens stop-id masks, in that order per row."""
        b_rows, b_toks, b_vals = [], [], []
        for i in np.flatnonzero(self.has_bias_np[rows]):
            row = rows[i]
            bad = self.bad_words[row] if bad_words else None
            parts = [self.logit_bias[row], bad.bias() if bad is not None else None]
            stop = self.min_tokens_stop_ids[row]
            if stop is not None and self.num_sampled_np[row] < self.min_tokens_np[row]:
                parts.append((stop, torch.full(stop.shape, float("-inf"), device=self.device)))
            for part in parts:
                if part is not None:
                    b_rows.append(torch.full_like(part[0], int(i)))
                    b_toks.append(part[0])
                    b_vals.append(part[1])
        return (torch.cat(b_rows), torch.cat(b_toks), torch.cat(b_vals)) if b_rows else None

    def record_sampled(self, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """Count the step's sampled tokens ``[n]`` into the penalty tables of penalised
        rows, advance every row's token index and its bad-word history."""
        pen = np.flatnonzero(self.has_penalty_np[rows])
        if len(pen):
            slots = self._h2d(rows[pen], torch.long)
            toks = sampled[self._h2d(pen, torch.long)]
            self.output_counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
        self.num_sampled_np[rows] += 1
        for i in np.flatnonzero(self.has_bad_words_np[rows]):
            self.bad_words[rows[i]].record(sampled[i : i + 1])

    def bad_words_bias(self, row: int, after: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row ``row``'s bad-word masks (token ids, -inf or 0) as if ``after`` had been
        sampled too; None without bad words."""
        bad = self.bad_words[row]
        return None if bad is None else bad.bias(after)

    def record_emitted(self, rows: np.ndarray, emitted: list[list[int]]) -> None:
        """Count the tokens each row that verified draft tokens emitted (``emitted[i]``,
        one or more per row) into the penalty tables of penalised rows and the bad-word
        histories, and advance the rows' token index by as many."""
        pen = np.flatnonzero(self.has_penalty_np[rows])
        if len(pen):
            slots = self._h2d(np.repeat(rows[pen], [len(emitted[i]) for i in pen]), torch.long)
            toks = self._h2d([t for i in pen for t in emitted[i]], torch.long)
            self.output_counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
        self.num_sampled_np[rows] += np.fromiter((len(e) for e in emitted), dtype=np.int64, count=len(emitted))
        for i in np.flatnonzero(self.has_bad_words_np[rows]):
            for tok in emitted[i]:
                self.bad_words[rows[i]].record(torch.tensor([tok], dtype=torch.long, device=self.device))
