"""Model runner: builds a step's input tensors, runs the model, samples.

One-step-ahead execution (DESIGN.md): a step's sampled token ids stay on the device in
``prev_sampled``; when the scheduler marks a sequence's last input token as the previous
step's sample, the runner copies it into ``input_ids`` on the device (no host round
trip). The device-to-host copy of the sampled ids is started non-blocking on a side
stream and waited on only by ``PendingOutput.result()``.

On the CPU, where torch kernels run synchronously, steps execute on one worker thread
(torch releases the GIL inside kernels), so the caller's output processing still overlaps
the model's compute, with the same pipeline structure as on a GPU.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from tandem.core.scheduler import ScheduledSequence, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.worker.cuda_graph import DecodeCUDAGraphs, cuda_median_ms
from tandem.distributed import parallel_state as ps
from tandem.distributed.dp_coordination import StepPlan, coordinate_step
from tandem.distributed.forward_context import ForwardContext, forward_context
from tandem.worker.ubatching import (StepInputs, empty_step_inputs, pad_step_inputs, run_ubatches,
                                     split_point)
from tandem.worker.sampler import SamplingBatch, SamplerOutput, sample, token_seed

logger = logging.getLogger(__name__)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens computed in one step for one sequence.

    ``token_ids`` / ``logprobs``: ``[n, 1 + K]`` (the actual next prompt token first, then
    the top K); ``ranks``: ``[n]``; ``start``: index in the prompt of the first token they
    score (>= 1).
    """

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Host-side result of one step: one sampled token per sampling sequence."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    # Per sampling row, when any row asked for logprobs: ([1+K] ids, [1+K] logprobs, rank).
    logprobs: list[tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class DBOConfig:
    """Smallest steps split into two ubatches (decode-only steps / steps with prefill);
    ``measure_split``: keep a split decode CUDA graph only where its replay was
    measured faster than the plain one (:class:`DecodeCUDAGraphs` ``measure_dbo``), and
    split steps with prefill tokens only if a split step of the largest size was
    (:meth:`ModelRunner.measure_prefill_split`)."""

    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512
    measure_split: bool = True


@dataclass
class SeqState:
    seq_id: int
    params: SamplingParams
    prompt_len: int
    num_sampled: int
    penalty_slot: int | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None
    prompt_token_ids: list[int]
    # Prompt logprobs are shared by a request's n sequences: only its first computes them.
    wants_prompt_logprobs: bool = False
    block_ids: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None  # [V] bool: allowed_token_ids
    bad_words: BadWords | None = None


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

    def bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, additive bias: -inf where banned now, else 0)."""
        match = ((self.prefix == self.recent[None, :]) | ~self.valid).all(dim=-1)
        vals = torch.where(match, float("-inf"), 0.0)
        single = torch.full(self.single.shape, float("-inf"), device=self.single.device)
        return torch.cat([self.single, self.last]), torch.cat([single, vals])


class PendingOutput:
    """A launched step's output; ``result()`` waits for its device-to-host copy."""

    def __init__(self, seq_ids: list[int], host: dict[str, torch.Tensor], event, prompt_lp: dict, k: int) -> None:
        self._seq_ids = seq_ids
        self._host = host
        self._event = event
        self._prompt_lp = prompt_lp
        self._k = k

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        h = self._host
        out = ModelRunnerOutput(self._seq_ids, h["sampled"].tolist())
        if "logprobs" in h:
            ids, lps, ranks = h["logprob_token_ids"].tolist(), h["logprobs"].tolist(), h["ranks"].tolist()
            out.logprobs = list(zip(ids, lps, ranks))
        for sid, start in self._prompt_lp.items():
            out.prompt_logprobs[sid] = PromptLogprobs(start, h[f"plp_ids_{sid}"].tolist(), h[f"plp_vals_{sid}"].tolist(),
                                                      h[f"plp_ranks_{sid}"].tolist())
        return out


class _Done:
    def __init__(self, value: ModelRunnerOutput) -> None:
        self._value = value

    def result(self) -> ModelRunnerOutput:
        return self._value


class ModelRunner:
    """Executes ``SchedulerOutput``s on one device.

    Args:
        model: a Tandem causal LM (``forward`` + ``compute_logits``).
        kv_caches: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.
        block_size: tokens per block.
        vocab_size: logits width.
        max_num_seqs: rows of the penalty state tables; largest CUDA-graph batch.
        device: where the model lives.
        max_model_len: longest sequence (sizes the CUDA-graph block-table buffer).
        enforce_eager: never use CUDA graphs.
        dbo: dual-batch overlap thresholds; None disables it.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, vocab_size: int,
                 max_num_seqs: int, device: torch.device, max_model_len: int = 2048, enforce_eager: bool = True,
                 dbo: DBOConfig | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.states: dict[int, SeqState] = {}
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[int, int] = {}
        self.max_num_seqs = max_num_seqs
        self._free_slots = list(range(max_num_seqs))
        self._output_counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._is_cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._is_cuda else None
        self._executor = None if self._is_cuda else ThreadPoolExecutor(1, thread_name_prefix="tandem-step")
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        if self._is_cuda and not enforce_eager:
            dbo_min = dbo.decode_token_threshold if dbo is not None and hasattr(model, "forward_steps") else None
            self.cuda_graphs = DecodeCUDAGraphs(model, kv_caches, max_num_seqs, -(-max_model_len // block_size), block_size,
                                                device, dbo_min_size=dbo_min,
                                                measure_dbo=dbo is not None and dbo.measure_split)
            self.cuda_graphs.capture()
        # Data-parallel coordination group (gloo), set by the distributed launcher.
        self.dp_group: dist.ProcessGroup | None = None
        self.dbo = dbo
        self.num_dbo_steps = 0
        # Steps with prefill tokens may split (DBO on); measure_prefill_split may say no.
        self.prefill_split = True
        self.prefill_split_timings: tuple[float, float] | None = None
        # Per step, when timing is on: (start event, end event, sequences, all decode?,
        # total context tokens read by attention).
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int, bool, int]] | None = None
        # Host time of each step's input building, when timing is on (tandem.step_timing).
        self.step_times = None

    def _h2d(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: a blocking host-to-device copy would wait for the in-flight step.
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    # ----------------------------------------------------------------- state
    def _add_seq(self, req) -> None:
        p = req.sampling_params
        slot = None
        if p.has_penalties:
            if self._output_counts is None:
                self._output_counts = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.int32, device=self.device)
                self._prompt_mask = torch.zeros(self.max_num_seqs, self.vocab_size, dtype=torch.bool, device=self.device)
            slot = self._free_slots.pop()
            self._prompt_mask[slot].zero_()
            self._prompt_mask[slot, self._h2d(req.prompt_token_ids, torch.long)] = True
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=self.vocab_size)
            self._output_counts[slot].copy_(counts.to(torch.int32), non_blocking=True)
        bias = None
        if p.logit_bias:
            bias = (self._h2d(list(p.logit_bias.keys()), torch.long), self._h2d(list(p.logit_bias.values()), torch.float32))
        st = SeqState(req.seq_id, p, req.num_prompt_tokens, req.num_output_tokens, slot, bias,
                      req.prompt_token_ids, p.prompt_logprobs is not None and req.index == 0)
        if p.allowed_token_ids is not None:
            st.allowed = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            st.allowed[self._h2d(p.allowed_token_ids, torch.long)] = True
        if p.bad_words_token_ids:
            st.bad_words = BadWords.build(p.bad_words_token_ids, req.output_token_ids, self.device)
        self.states[req.seq_id] = st

    def _drop_seq(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None and st.penalty_slot is not None:
            self._free_slots.append(st.penalty_slot)

    # ----------------------------------------------------------------- execute
    def execute_model(self, so: SchedulerOutput):
        """Launch a step. Returns an object whose ``result()`` is its ``ModelRunnerOutput``.

        Steps run in submission order; ``result()`` of step N may be called after step
        N+1 was launched.
        """
        if self._executor is not None:
            fut: Future = self._executor.submit(self._run_to_host, so)
            return fut
        return self._execute(so)

    def _run_to_host(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._execute(so).result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput):
        t_prep = time.perf_counter()
        for sid in so.finished_seq_ids:
            self._drop_seq(sid)
        for sid in so.preempted_seq_ids:
            self._drop_seq(sid)
        for seq in so.scheduled:
            if seq.new_request is not None:
                self._drop_seq(seq.seq_id)
                self._add_seq(seq.new_request)
            self.states[seq.seq_id].block_ids.extend(seq.new_block_ids)
        seqs, inputs = [], None
        if not so.is_empty:
            # Decode sequences (one new token) first: backends batch them uniformly.
            seqs = sorted(so.scheduled, key=lambda s: s.num_new_tokens != 1)
            inputs = self._prepare_inputs(seqs)
        t_prep = time.perf_counter() - t_prep
        num_tokens = inputs.num_tokens if inputs is not None else 0
        num_decode = inputs.num_decode_reqs() if inputs is not None else 0
        graphs = self.cuda_graphs
        # An idle data-parallel rank can replay any size (padding rows only).
        graph_ok = graphs is not None and (inputs is None or (num_decode == inputs.num_reqs
                                                               and inputs.num_reqs <= graphs.max_size))
        if graph_ok and inputs is not None:
            # Used only if some rank cannot replay a graph (eager step): the capture-time
            # choice for this rank's size. In graph mode the replayed size decides.
            wants_split = graphs.padded_size(num_tokens) in graphs.split_sizes
        else:
            wants_split = self._wants_split(inputs)
        plan = coordinate_step(self.dp_group, num_tokens, num_tokens, wants_split, graph_ok)
        if plan.max_tokens == 0:
            return _Done(ModelRunnerOutput([], []))
        # Every DP rank replays the size of the largest batch of any rank; a size is split
        # on all ranks or on none (agreed at capture), so the exchanges match. An idle rank
        # can split too (padding rows), so plan.split, the eager steps' vote, is not used.
        graph_size = graphs.padded_size(plan.max_tokens) if plan.graph_mode else None
        if graph_size is not None and graph_size in graphs.split_sizes:
            self.num_dbo_steps += 1
        if inputs is None:
            # Idle data-parallel rank: a dummy batch keeps the MoE collectives matched.
            if graph_size is not None:
                graphs.run_padding(graph_size)
            else:
                self._forward(empty_step_inputs(), torch.empty(0, dtype=torch.long, device=self.device), plan)
            return _Done(ModelRunnerOutput([], []))
        num_reqs = inputs.num_reqs
        qsl = inputs.query_start_loc

        dev = self.device
        timing = self.step_events is not None
        if timing:
            ev_start = torch.cuda.Event(enable_timing=True)
            ev_start.record()
        input_ids_t = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
        if inputs.prev_dst:
            input_ids_t[self._h2d(inputs.prev_dst, torch.long)] = self.prev_sampled[self._h2d(inputs.prev_src, torch.long)]
        if graph_size is not None:
            hidden = graphs.run(num_reqs, input_ids_t, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
                                inputs.num_computed, inputs.block_table, size=graph_size)
        else:
            hidden = self._forward(inputs, input_ids_t, plan)

        sample_rows = [r for r, s in enumerate(seqs) if s.sample]
        sample_seq_ids = [seqs[r].seq_id for r in sample_rows]
        logits_idx = self._h2d([int(qsl[r + 1]) - 1 for r in sample_rows], torch.long)
        prompt_lp, prompt_lp_tensors = self._prompt_logprobs(seqs, qsl, hidden)
        host: dict[str, torch.Tensor] = {}
        k = -1
        if sample_rows:
            logits = self.model.compute_logits(hidden[logits_idx])
            states = [self.states[sid] for sid in sample_seq_ids]
            t_batch = time.perf_counter()
            batch = self._sampling_batch(states)
            t_prep += time.perf_counter() - t_batch
            k = batch.max_num_logprobs
            out: SamplerOutput = sample(logits, batch, self._output_counts, self._prompt_mask)
            sampled = out.sampled
            self._record_sampled(states, sampled)
            host_src = {"sampled": sampled}
            if out.logprobs is not None:
                host_src.update(logprobs=out.logprobs, logprob_token_ids=out.logprob_token_ids, ranks=out.sampled_ranks)
        else:
            sampled = torch.empty(0, dtype=torch.long, device=dev)
            host_src = {"sampled": sampled}
        self.prev_sampled = sampled
        host_src.update(prompt_lp_tensors)
        if timing:
            ev_end = torch.cuda.Event(enable_timing=True)
            ev_end.record()
            self.step_events.append((ev_start, ev_end, num_reqs, num_decode == num_reqs, int(inputs.seq_lens.sum())))
        if self.step_times is not None:
            self.step_times.add(so.step_id, "prepare", t_prep)
        self.prev_rows = {sid: i for i, sid in enumerate(sample_seq_ids)}
        event = None
        if self._is_cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._copy_stream):
                for name, t in host_src.items():
                    host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host[name].copy_(t, non_blocking=True)
                    t.record_stream(self._copy_stream)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        else:
            host = host_src
        return PendingOutput(sample_seq_ids, host, event, prompt_lp, k)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    def _wants_split(self, inputs: StepInputs | None) -> bool:
        """This rank's view: DBO on, an MoE model, and a step above the threshold. An idle
        data-parallel rank (``inputs`` None) runs padding only and follows the busy ranks:
        its vote must not veto their split."""
        if self.dbo is None or not hasattr(self.model, "forward_steps"):
            return False
        if inputs is None:
            return True
        n = inputs.num_tokens
        decode_only = inputs.num_decode_reqs() == inputs.num_reqs
        if not decode_only and not self.prefill_split:
            return False
        threshold = self.dbo.decode_token_threshold if decode_only else self.dbo.prefill_token_threshold
        return n >= threshold and split_point(n, n) is not None

    @torch.inference_mode()
    def measure_prefill_split(self, num_tokens: int, iters: int = 3) -> tuple[float, float] | None:
        """Time an eager step of ``num_tokens`` prefill tokens (one dummy request of random
        ids, K/V into the null block) plain and as two ubatches (CUDA events, median of
        ``iters`` after a warm-up of each). One request is a long prompt's chunk, whose
        second ubatch also attends to the first's keys: the costliest split, so the policy
        errs towards not splitting a step of short prompts. Steps with prefill tokens then
        split only if the split one was faster on every rank whose forwards exchange data
        (:func:`tandem.distributed.parallel_state.forward_min`). Every such rank must call
        this at the same point with the same ``num_tokens`` (the MoE exchanges pair up).

        Returns:
            (plain ms, split ms), also kept in ``prefill_split_timings``; None when nothing
            was measured (DBO off, not CUDA, a dense model, or ``num_tokens`` below the
            prefill threshold).
        """
        if (self.dbo is None or not self._is_cuda or not hasattr(self.model, "forward_steps")
                or num_tokens < self.dbo.prefill_token_threshold):
            return None
        dummy = pad_step_inputs(empty_step_inputs(), num_tokens, self.block_size)
        # Random ids: routing spreads over the experts as in real prompts. A generator of its
        # own leaves the engine's seeded global one untouched.
        gen = torch.Generator(device=self.device).manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (num_tokens,), device=self.device, generator=gen)
        num_dbo_steps = self.num_dbo_steps
        times = []
        for split in (False, True):
            plan = StepPlan(num_tokens, num_tokens, split, False)
            times.append(cuda_median_ms(lambda: self._forward(dummy, ids, plan), warmup=1, iters=iters))
        self.num_dbo_steps = num_dbo_steps
        self.prefill_split_timings = (times[0], times[1])
        self.prefill_split = bool(ps.forward_min(int(times[1] < times[0])))
        logger.info("dual-batch overlap for steps with prefill tokens: %s (a %d-token step took %.2f ms plain, "
                    "%.2f ms split)", "on" if self.prefill_split else "off", num_tokens, times[0], times[1])
        return self.prefill_split_timings

    def _forward(self, inputs: StepInputs, input_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Eager forward of a step, padded to the size every DP rank agreed on and, when
        the plan says so, run as two overlapped ubatches. Returns ``[num_tokens, H]``."""
        n = inputs.num_tokens
        padded = max(plan.padded_tokens, n) if self.dp_size > 1 else n
        full = pad_step_inputs(inputs, padded, self.block_size)
        if padded > n:
            input_ids = torch.cat([input_ids, torch.zeros(padded - n, dtype=torch.long, device=self.device)])
        dev = self.device
        positions = torch.from_numpy(full.positions).to(dev, non_blocking=True)
        cut = padded // 2 if plan.split else padded
        ctx = ForwardContext(max_tokens_per_rank=padded - cut if plan.split else padded, dp_size=self.dp_size)
        with forward_context(ctx):
            if not plan.split:
                return self.model(input_ids, positions, self.kv_caches, full.metadata(dev))[:n]
            first, second = full.slice_tokens(0, cut), full.slice_tokens(cut, padded)
            h0, h1 = run_ubatches(
                self.model.forward_steps(input_ids[:cut], positions[:cut], self.kv_caches, first.metadata(dev)),
                self.model.forward_steps(input_ids[cut:], positions[cut:], self.kv_caches, second.metadata(dev)),
            )
        self.num_dbo_steps += 1
        return torch.cat([h0, h1])[:n]

    def _prepare_inputs(self, seqs: list[ScheduledSequence]) -> StepInputs:
        num_reqs = len(seqs)
        q_lens = np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        computed = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        input_ids = np.zeros(int(qsl[-1]), dtype=np.int64)
        prev_dst, prev_src = [], []
        tables = [self.states[s.seq_id].block_ids for s in seqs]
        block_table = np.zeros((num_reqs, max(len(t) for t in tables)), dtype=np.int32)
        for r, s in enumerate(seqs):
            start = qsl[r]
            input_ids[start : start + len(s.token_ids)] = s.token_ids
            if s.uses_prev_sample:
                prev_dst.append(int(start) + s.num_new_tokens - 1)
                prev_src.append(self.prev_rows[s.seq_id])
            block_table[r, : len(tables[r])] = tables[r]
        if (q_lens == 1).all():
            positions = computed.copy()
        else:
            positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, q_lens)])
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        bs = self.block_size
        slot_mapping = block_table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        return StepInputs(input_ids, positions, slot_mapping, qsl, computed, computed + q_lens, block_table,
                          prev_dst, prev_src)

    def _record_sampled(self, states: list[SeqState], sampled: torch.Tensor) -> None:
        pen_rows = [i for i, st in enumerate(states) if st.penalty_slot is not None]
        if pen_rows:
            slots = self._h2d([states[i].penalty_slot for i in pen_rows], torch.long)
            toks = sampled[self._h2d(pen_rows, torch.long)]
            self._output_counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
        for i, st in enumerate(states):
            st.num_sampled += 1
            if st.bad_words is not None:
                st.bad_words.record(sampled[i : i + 1])

    def _sampling_batch(self, states: list[SeqState]) -> SamplingBatch:
        dev = self.device
        temps = [st.params.temperature for st in states]
        greedy = [st.params.greedy for st in states]
        top_k = [min(st.params.top_k, self.vocab_size) if st.params.top_k > 0 else self.vocab_size for st in states]
        top_p = [st.params.top_p for st in states]
        min_p = [st.params.min_p for st in states]
        all_greedy, all_random = all(greedy), not any(greedy)
        pen = [i for i, st in enumerate(states) if st.penalty_slot is not None]
        seeded = [(i, token_seed(st.params.seed, st.num_sampled)) for i, st in enumerate(states)
                  if st.params.seed is not None and not st.params.greedy]
        b_rows, b_toks, b_vals = [], [], []
        for i, st in enumerate(states):
            if st.logit_bias is not None:
                ids, vals = st.logit_bias
                b_rows.append(torch.full_like(ids, i))
                b_toks.append(ids)
                b_vals.append(vals)
            if st.bad_words is not None:
                ids, vals = st.bad_words.bias()
                b_rows.append(torch.full_like(ids, i))
                b_toks.append(ids)
                b_vals.append(vals)
            if st.num_sampled < st.params.min_tokens:
                stop_ids = sorted(st.params.all_stop_token_ids | set(st.params.stop_token_ids))
                if stop_ids:
                    ids = self._h2d(stop_ids, torch.long)
                    b_rows.append(torch.full_like(ids, i))
                    b_toks.append(ids)
                    b_vals.append(torch.full(ids.shape, float("-inf"), device=dev))
        allowed = [i for i, st in enumerate(states) if st.allowed is not None]
        lp = [st.params.logprobs for st in states if st.params.logprobs is not None]
        f32 = lambda xs: self._h2d(xs, torch.float32)  # noqa: E731
        return SamplingBatch(
            temperature=f32(temps),
            top_k=self._h2d(top_k, torch.long),
            top_p=f32(top_p),
            min_p=f32(min_p),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else self._h2d(greedy, torch.bool),
            need_top_k=any(k < self.vocab_size for k, g in zip(top_k, greedy) if not g),
            need_top_p=any(p < 1.0 for p, g in zip(top_p, greedy) if not g),
            need_min_p=any(p > 0.0 for p, g in zip(min_p, greedy) if not g),
            penalty_rows=self._h2d(pen, torch.long) if pen else None,
            penalty_slots=self._h2d([states[i].penalty_slot for i in pen], torch.long) if pen else None,
            presence=f32([states[i].params.presence_penalty for i in pen]) if pen else None,
            frequency=f32([states[i].params.frequency_penalty for i in pen]) if pen else None,
            repetition=f32([states[i].params.repetition_penalty for i in pen]) if pen else None,
            bias=(torch.cat(b_rows), torch.cat(b_toks), torch.cat(b_vals)) if b_rows else None,
            allowed=(self._h2d(allowed, torch.long), torch.stack([states[i].allowed for i in allowed])) if allowed else None,
            seeded=seeded,
            max_num_logprobs=max(lp) if lp else -1,
        )

    def _prompt_logprobs(self, seqs, qsl, hidden: torch.Tensor) -> tuple[dict[int, int], dict[str, torch.Tensor]]:
        """Logprobs of the prompt tokens following each scheduled prompt position.

        Returns ({seq_id: index of the first scored prompt token}, device tensors named
        ``plp_{ids,vals,ranks}_{seq_id}``), copied to the host with the sampled ids (no sync).
        """
        starts, tensors = {}, {}
        for r, s in enumerate(seqs):
            st = self.states[s.seq_id]
            k = st.params.prompt_logprobs
            if not st.wants_prompt_logprobs or s.num_computed_tokens >= st.prompt_len:
                continue
            start = s.num_computed_tokens
            # Positions whose next token is still in the prompt.
            end = min(start + s.num_new_tokens, st.prompt_len - 1)
            if end <= start:
                continue
            lo = int(qsl[r])
            lp = self.model.compute_logits(hidden[lo : lo + end - start]).log_softmax(dim=-1)
            nxt = self._h2d(st.prompt_token_ids[start + 1 : end + 1], torch.long)
            tok_lp = lp.gather(1, nxt[:, None])
            ranks = (lp > tok_lp).sum(-1) + 1
            ids, vals = nxt[:, None], tok_lp
            if k > 0:
                top_lp, top_ids = lp.topk(k, dim=-1)
                ids, vals = torch.cat([ids, top_ids], 1), torch.cat([vals, top_lp], 1)
            starts[s.seq_id] = start + 1
            tensors.update({f"plp_ids_{s.seq_id}": ids, f"plp_vals_{s.seq_id}": vals, f"plp_ranks_{s.seq_id}": ranks})
        return starts, tensors
