"""Model runner: executes one ``SchedulerOutput`` per step on one device.

A step, in order (docs/architecture.md, "The step pipeline"):

1. :meth:`ModelRunner._update_states`: rows of new sequences and appended block ids go into
   the persistent :class:`~tandem.worker.input_batch.InputBatch`;
2. :meth:`ModelRunner._prepare_inputs`: the step's flat input arrays (decode sequences
   first);
3. :meth:`StepPlanner.plan <tandem.worker.step_plan.StepPlanner.plan>`: eager or CUDA graph,
   padding, one forward or two ubatches, agreed across data-parallel ranks;
4. :meth:`ModelRunner._forward`: the forward as planned;
5. :meth:`ModelRunner._logits`: logits of the sampling positions, prompt logprobs;
6. :meth:`ModelRunner._sample_step`: the grammar bitmask (if any) applied, sampling;
7. :meth:`ModelRunner._copy_to_host`: the device-to-host copy, waited on only by
   :meth:`AsyncModelRunnerOutput.result`.

Speculative decoding: a sequence scheduled with draft tokens
(``ScheduledSequence.spec_token_ids``) gets the logits of its last known token and of each
draft, turned into the target's probabilities as the sampler would (temperature, min-p,
top-k, top-p; greedy and deterministic rows one-hot), and
:func:`~tandem.spec_decode.rejection_sampler.rejection_sample` picks its accepted drafts
and one more token. The other sequences of the step sample as always. The accepted counts
are read on the host within the step. With a draft
model (:class:`~tandem.spec_decode.draft_model.DraftModelProposer`) or an EAGLE head
(:class:`~tandem.spec_decode.eagle.EagleProposer`, given the step's target hidden states:
an EAGLE-3 head's target returns its layer inputs after them), once the step has sampled,
the proposer takes in the step's confirmed tokens and proposes the next drafts of every
sequence that sampled (``ModelRunnerOutput.draft_token_ids``). They also stay on the
device for the next step, which the engine may launch before this one's output reaches the
host (``ScheduledSequence.num_device_drafts``): its input ids are filled from them and its
positions corrected by the drafts this step rejected (``prev_rejected``; docs/architecture.md,
"One step ahead").

A step with constrained sequences (``SchedulerOutput.structured_output_seq_ids``) stops
after 5: ``execute_model`` returns None, and :meth:`ModelRunner.sample_tokens`, given their
:class:`~tandem.structured_output.bitmask.GrammarBitmask`, runs 6 and 7 (vLLM's
``execute_model`` / ``sample_tokens`` split), so the engine builds the bitmask while the
forward runs.

One-step-ahead execution: a step's sampled token ids stay on the device in
``prev_sampled``; when the scheduler marks a sequence's last input token as the previous
step's sample, the runner copies it into ``input_ids`` on the device (no host round trip).
The device-to-host copy of the sampled ids is started non-blocking on a side stream.

On the CPU, where torch kernels run synchronously, steps execute on one worker thread
(torch releases the GIL inside kernels), so the caller's output processing still overlaps
the model's compute, with the same pipeline structure as on a GPU. The thread is the
:class:`~tandem.worker.worker.Worker`'s ``step_thread``, which also loaded the model (see
there why); ``TANDEM_CPU_STEP_THREAD=off`` (or no ``step_thread``) runs steps inline instead
(``execute_model`` then returns a handle of a finished step: the same results in the same
order, without the overlap). The thread stays the default on every core count: inline steps
on the caller's thread stall under load (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from tandem import envs
from tandem.config.speculative import SpeculativeConfig
from tandem.core.sched_output import ScheduledSequence, SchedulerOutput
from tandem.distributed import parallel_state as ps
from tandem.distributed.forward_context import ForwardContext, RowPhases, forward_context
from tandem.distributed.pipeline import IntermediateTensors
from tandem.outputs import ModelRunnerOutput
from tandem.models.llama import split_aux_hidden_states
from tandem.spec_decode.draft_model import DraftModelProposer, DraftStep
from tandem.spec_decode.rejection_sampler import rejection_sample
from tandem.step_timing import StepSpan, WallClockEvent
from tandem.structured_output.bitmask import GrammarBitmask, apply_token_bitmask
from tandem.worker.cuda_graph import DecodeCUDAGraphs, cuda_median_ms, verify_capture_sizes
from tandem.worker.input_batch import InputBatch
from tandem.worker.pipeline_stage import PipelineStage
from tandem.worker.sampler import SamplerOutput, SamplingBatch, repeat_rows, sample, target_distribution
from tandem.worker.step_plan import CPU_MIN_PROMPT_TOKENS, DBOPolicy, StepMode, StepPlan, StepPlanner, ubatch_slices
from tandem.worker.step_results import PromptLogprobTensors, RowLogprobs, SampledLogprobTensors, StepResultTensors
from tandem.worker.ubatching import StepInputs, empty_step_inputs, forward_step, pad_step_inputs

logger = logging.getLogger(__name__)


class AsyncModelRunnerOutput:
    """A launched step; ``result()`` waits for it and returns its ``ModelRunnerOutput``
    (the one type ``execute_model`` returns, on every device)."""

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve = resolve

    def result(self) -> ModelRunnerOutput:
        return self._resolve()


def _empty_output() -> AsyncModelRunnerOutput:
    return AsyncModelRunnerOutput(lambda: ModelRunnerOutput([], []))


@dataclass
class _SpecVerify:
    """The sequences of a step that verify draft tokens, and the rejection sampler's
    inputs for them."""

    index: list[int]  # positions in the step's sequences
    seq_ids: list[int]
    rows: np.ndarray  # [R] int64: their input-batch rows
    num_drafts: list[int]  # [R]
    draft_at: torch.Tensor  # [sum(num_drafts)] int64 on the device: the drafts' indices in the step's tokens
    batch: SamplingBatch  # one row per verified position (1 + num_drafts per sequence)
    greedy: bool | torch.Tensor  # rejection_sample's greedy argument
    generators: dict[int, torch.Generator]  # seeded sequences' draws, by index in seq_ids
    # [sum(num_drafts)] int64 on the device, gathered from the step's input ids once they
    # are built (drafts proposed on the device included).
    draft_ids: torch.Tensor | None = None


@dataclass
class _StepSampling:
    """Who samples in a step, and the sampler's inputs for them (built with the step's
    inputs, before its forward is launched)."""

    index: list[int]  # positions in the step's sequences (decode first)
    seq_ids: list[int]  # one per row of the step's logits
    rows: np.ndarray  # [len(seq_ids)] int64: their input-batch rows
    batch: SamplingBatch | None  # None when none samples
    spec: _SpecVerify | None = None  # sequences with draft tokens (not in the above)


@dataclass
class _DraftInputs:
    """A step's inputs as the draft model takes them in after sampling."""

    inputs: StepInputs
    input_ids: torch.Tensor  # [num_tokens] int64 on the device
    rows: np.ndarray  # [S] int64: the step's sequences' input-batch rows
    known: np.ndarray  # [S] int64: each sequence's step tokens before its drafts
    propose: bool  # drafts wanted (SchedulerOutput.propose_drafts); else the cache only
    seq_ids: list[int]  # [S] the step's sequences
    # EAGLE (DraftStep): the target's hidden states [num_tokens, H'], and each
    # sequence's next known token where its step does not reach its last one (else -1).
    target_hidden: torch.Tensor | None = None
    next_token_ids: np.ndarray | None = None


@dataclass
class _ForwardedStep:
    """A step run up to its logits, waiting to be sampled."""

    step_id: int
    sampling: _StepSampling
    logits: torch.Tensor | None  # [len(seq_ids), V] float; None when none samples
    spec_logits: torch.Tensor | None  # [sum(1 + num_drafts), V] float of sampling.spec
    draft: _DraftInputs | None  # with a draft model
    results: StepResultTensors  # its prompt logprobs so far; sampling adds the rest
    t_prep: float  # host seconds spent building the step's inputs
    # The step's span, its end not recorded yet, when step timing is on.
    timing: StepSpan | None


def cpu_step_thread(device: torch.device) -> bool:
    """Whether steps on ``device`` run on a worker thread (module docstring): on the CPU
    unless ``TANDEM_CPU_STEP_THREAD=off``; never on CUDA (kernels are asynchronous there)."""
    return device.type != "cuda" and envs.TANDEM_CPU_STEP_THREAD == "on"


class ModelRunner:
    """Executes ``SchedulerOutput``s on one device.

    Args:
        model: a Tandem causal LM (``forward`` + ``compute_logits``; ``forward_steps`` for
            dual-batch overlap).
        kv_caches: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.
        block_size: tokens per block.
        vocab_size: logits width.
        max_num_seqs: rows of the input batch; largest CUDA-graph batch.
        device: where the model lives.
        max_model_len: longest sequence (sizes the block tables).
        enforce_eager: never use CUDA graphs.
        dbo: dual-batch overlap policy; None (or a dense model) disables it.
        drafter: a draft model or EAGLE head proposing each sampling sequence's next
            drafts; None: none.
        step_thread: the single-thread executor CPU steps run on (module docstring; the
            runner shuts it down); None: steps run inline.
        stage: this rank's pipeline stage (:class:`~tandem.worker.pipeline_stage.PipelineStage`);
            None without pipeline parallelism.
        speculative_config: speculative decoding's settings (None: off); with CUDA graphs
            the steps that verify drafts replay graphs of ``1 + K`` rows per sequence up to
            the batch that speculates (:func:`~tandem.worker.cuda_graph.verify_capture_sizes`),
            and a draft model's catch-up over them graphs of ``K + 2``.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, vocab_size: int,
                 max_num_seqs: int, device: torch.device, max_model_len: int = 2048, enforce_eager: bool = True,
                 dbo: DBOPolicy | None = None, drafter: DraftModelProposer | None = None,
                 step_thread: ThreadPoolExecutor | None = None, stage: PipelineStage | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.stage = stage
        self.drafter = drafter
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.dbo = dbo if hasattr(model, "forward_steps") else None
        max_blocks = -(-max_model_len // block_size)
        self.input_batch = InputBatch(max_num_seqs, max_blocks, vocab_size, device)
        # The previous step, for the next one's inputs (one-step-ahead execution): each
        # sampling sequence's last emitted token, then (with drafts proposed) its next K
        # drafts from _prev_drafts_at on; its row in them by seq_id; and, when it verified
        # drafts, each row's rejected ones (the next step's positions are corrected by them).
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[int, int] = {}
        self.prev_rejected: list[int] | None = None
        self._prev_drafts_at = (0, 0)  # (first index, drafts per row)
        # A step waiting for sample_tokens (a Future of it on the CPU worker thread).
        self._deferred: _ForwardedStep | Future | AsyncModelRunnerOutput | None = None
        self._is_cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._is_cuda else None
        self._executor = step_thread
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        self.verify_graphs: DecodeCUDAGraphs | None = None
        if self._is_cuda and not enforce_eager:
            self.cuda_graphs = DecodeCUDAGraphs(model, kv_caches, max_num_seqs, max_blocks, block_size, device,
                                                dbo=self.dbo)
            self.cuda_graphs.capture()
            verify_sizes = None
            # Expert parallelism agrees on every step over the DP group: verification stays eager there.
            if speculative_config is not None and stage is None and ps.get_ep_size() == 1:
                q = 1 + speculative_config.num_speculative_tokens
                verify_sizes = verify_capture_sizes(max_num_seqs, speculative_config.disable_by_batch_size, q)
                self.verify_graphs = DecodeCUDAGraphs(model, kv_caches, verify_sizes[-1], max_blocks, block_size,
                                                      device, sizes=verify_sizes, label="verification", query_len=q,
                                                      max_position=max_model_len - 1)
                self.verify_graphs.pool = self.cuda_graphs.pool  # never replayed together
                self.verify_graphs.capture()
            if drafter is not None:
                drafter.capture_cuda_graphs(max_num_seqs, max_blocks, catch_up_sizes=verify_sizes)
        graphs, verify = self.cuda_graphs, self.verify_graphs
        self.planner = StepPlanner(self.dbo, graphs.sizes if graphs else None, graphs.split_sizes if graphs else set(),
                                   min_prompt_tokens=CPU_MIN_PROMPT_TOKENS if device.type == "cpu" else 0,
                                   verify_sizes=verify.sizes if verify else None,
                                   verify_query_len=verify.query_len if verify else 0)
        # Layers whose kernel follows the phase of a token (forward_context.RowPhases).
        models = [model] if drafter is None else [model, drafter.model]
        self._phase_layers = any(getattr(m, "uses_row_phases", False) for net in models for m in net.modules())
        self._track_prompt_lens = self._phase_layers or self.planner.min_prompt_tokens > 0
        self.num_dbo_steps = 0
        # Per step, when a benchmark times steps: its span on the device (CUDA events, or
        # on the step thread host-clock ones).
        self.step_events: list[StepSpan] | None = None
        # Host time of each step's input building, when timing is on (tandem.step_timing).
        self.step_times = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group every step is agreed over (expert parallelism), set by
        the engine; None: this rank plans alone."""
        return self.planner.dp_group

    @dp_group.setter
    def dp_group(self, group: dist.ProcessGroup | None) -> None:
        self.planner.dp_group = group

    @property
    def runs_on_step_thread(self) -> bool:
        """Steps run on the CPU step thread (module docstring)."""
        return self._executor is not None

    def _timing_event(self) -> torch.cuda.Event | WallClockEvent:
        """A recorded timing event: on the GPU's stream, or the host clock of the step thread."""
        ev = torch.cuda.Event(enable_timing=True) if self._is_cuda else WallClockEvent()
        ev.record()
        return ev

    def _h2d(self, data, dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: a blocking host-to-device copy would wait for the in-flight step.
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    # ----------------------------------------------------------------- execute
    def execute_model(self, so: SchedulerOutput) -> AsyncModelRunnerOutput | None:
        """Launch a step; ``result()`` of the returned handle is its ``ModelRunnerOutput``.
        None when ``so`` has constrained sequences: the forward and the logits are
        launched, and :meth:`sample_tokens` (given their bitmask) samples.

        Steps run in submission order; ``result()`` of step N may be called after step
        N+1 was launched.
        """
        if self.stage is not None and not self.stage.is_last:
            handle = self._launch_stage(so)
        elif self._executor is not None:
            if so.structured_output_seq_ids:
                self._deferred = self._executor.submit(self._execute, so)
                return None
            handle = AsyncModelRunnerOutput(self._executor.submit(self._run_to_host, so).result)
        else:
            handle = self._execute(so)
        if so.structured_output_seq_ids:
            self._deferred = handle
            return None
        return handle

    def _launch_stage(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """A pipeline stage before the last: its forward sends the residual stream on (on
        the step thread, which then goes on with the next batch); the driver's handle
        receives the step's results from the last stage on the caller's thread."""
        if self._executor is not None:
            forward = self._executor.submit(self._execute, so).result
        else:
            self._execute(so)
            forward = _empty_output().result
        collect = self.stage.is_driver and not so.is_empty

        def resolve() -> ModelRunnerOutput:
            out = forward()
            return self.stage.collect() if collect else out

        return AsyncModelRunnerOutput(resolve)

    def sample_tokens(self, grammar: GrammarBitmask) -> AsyncModelRunnerOutput:
        """Sample the step whose :meth:`execute_model` returned None (it had constrained
        sequences), with their grammar bitmask applied to the logits first. Returns what
        :meth:`execute_model` returns for other steps."""
        fwd, self._deferred = self._deferred, None
        if isinstance(fwd, AsyncModelRunnerOutput):  # a stage before the last: the last one samples
            return fwd
        if self._executor is not None:
            return AsyncModelRunnerOutput(self._executor.submit(lambda: self._sample_step(fwd.result(), grammar).result()).result)
        return self._sample_step(fwd, grammar)

    def _run_to_host(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._execute(so).result()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput) -> AsyncModelRunnerOutput | _ForwardedStep:
        """Run a step; a step with constrained sequences only up to its logits."""
        t_prep = time.perf_counter()
        # On the step thread the input building is the device's work too: timed from here.
        wall_start = self._timing_event() if self.step_events is not None and not self._is_cuda else None
        self._update_states(so)
        # Decode sequences (one new token) first: backends batch them uniformly. (A step of
        # as many tokens as sequences is all decode: nothing to sort.)
        seqs = so.scheduled if so.num_scheduled_tokens == len(so.scheduled) else \
            sorted(so.scheduled, key=lambda s: s.num_new_tokens != 1)
        inputs, rows = self._prepare_inputs(seqs) if seqs else (None, None)
        # Before the forward is launched: building them launches small copies and gathers,
        # which would otherwise queue behind the forward's kernels.
        sampling = (self._sampling_inputs(seqs, rows, so.num_scheduled_tokens == len(seqs), inputs.query_start_loc)
                    if seqs else None)
        t_prep = time.perf_counter() - t_prep
        decode_only = inputs is not None and inputs.num_decode_reqs() == inputs.num_reqs
        generated = inputs.generated_mask() if inputs is not None else None
        with_prompt = generated is not None and not generated.all()
        plan = self.planner.plan(inputs.num_tokens if inputs is not None else 0, decode_only, with_prompt,
                                 inputs.num_reqs if inputs is not None else 0,
                                 inputs.max_query_len if inputs is not None else 1)
        if plan.split:
            self.num_dbo_steps += 1
        if plan.mode is StepMode.IDLE:
            return _empty_output()
        if inputs is None:
            # Idle data-parallel rank: a dummy batch keeps the MoE collectives matched.
            self._run_padding(plan)
            return _empty_output()
        if self.stage is not None:
            self.stage.begin_step()
        timing = None
        if self.step_events is not None:
            ev_start = wall_start or self._timing_event()
            verifies = sampling.spec is not None and all(s.num_new_tokens - s.num_drafts <= 1 for s in seqs)
            timing = StepSpan(ev_start, inputs.num_reqs, decode_only, int(inputs.seq_lens.sum()),
                              verifies_drafts=verifies)
        input_ids = self._input_ids(inputs)
        if sampling.spec is not None:
            sampling.spec.draft_ids = input_ids[sampling.spec.draft_at]
        out = self._forward(inputs, input_ids, plan)
        if isinstance(out, IntermediateTensors):  # a pipeline stage before the last
            self.stage.send(out)
            return _empty_output()
        hidden, aux = split_aux_hidden_states(self.model, out)
        target_hidden = hidden if aux is None else aux
        fwd = self._logits(so.step_id, seqs, sampling, inputs, hidden, t_prep, timing,
                           generated if self._phase_layers else None)
        if self.drafter is not None:
            fwd.draft = self._draft_inputs(seqs, inputs, input_ids, rows, so.propose_drafts, target_hidden)
        if so.structured_output_seq_ids:
            return fwd  # sampled by sample_tokens
        return self._sample_step(fwd, None)

    def _draft_inputs(self, seqs: list[ScheduledSequence], inputs: StepInputs, input_ids: torch.Tensor,
                      rows: np.ndarray, propose: bool, target_hidden: torch.Tensor) -> _DraftInputs:
        known = np.array([s.num_new_tokens - s.num_drafts for s in seqs], dtype=np.int64)
        if not self.drafter.uses_target_hidden:
            return _DraftInputs(inputs, input_ids, rows, known, propose, [s.seq_id for s in seqs])
        states = self.input_batch.states
        nxt = [states[s.seq_id].known_token(s.num_computed_tokens + s.num_new_tokens) if not s.sample else -1
               for s in seqs]
        return _DraftInputs(inputs, input_ids, rows, known, propose, [s.seq_id for s in seqs], target_hidden,
                            np.array(nxt, dtype=np.int64))

    # ----------------------------------------------------------------- 1. states
    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for sid in so.finished_seq_ids:
            ib.remove_request(sid)
        for sid in so.preempted_seq_ids:
            ib.remove_request(sid)
        if self.drafter is not None:
            self.drafter.forget(so.finished_seq_ids)
            self.drafter.forget(so.preempted_seq_ids)
        for seq in so.scheduled:
            if seq.new_request is not None:
                ib.add_request(seq.new_request)
            if seq.new_block_ids:  # most decode steps append none
                ib.append_blocks(seq.seq_id, seq.new_block_ids)
        ib.flush()

    # ----------------------------------------------------------------- 2. inputs
    def _prepare_inputs(self, seqs: list[ScheduledSequence]) -> tuple[StepInputs, np.ndarray]:
        """The step's inputs, and the input-batch rows ``[len(seqs)]`` int64 of ``seqs``."""
        # One pass over the sequences for every per-sequence value; the rest is numpy.
        states, prev_rows, rejected = self.input_batch.states, self.prev_rows, self.prev_rejected
        q_list, computed_list, row_list, ids, plen_list = [], [], [], [], []
        track_prompt = self._track_prompt_lens
        prev_dst, prev_src = [], []
        width = end = 0
        for s in seqs:
            st = states[s.seq_id]
            row_list.append(st.row)
            if track_prompt:
                plen_list.append(st.prompt_len)
            if st.num_blocks > width:
                width = st.num_blocks
            q_list.append(s.num_new_tokens)
            computed = s.num_computed_tokens
            end += s.num_new_tokens
            ids += s.token_ids
            ids += s.spec_token_ids
            if s.uses_prev_sample:
                # Filled on the device: the previous step's sample, then the drafts
                # proposed after it; the scheduler counted that step's drafts as accepted.
                i, n = prev_rows[s.seq_id], s.num_device_drafts
                if rejected is not None:
                    computed -= rejected[i]
                ids.append(0)
                prev_dst.append(end - 1 - n)
                prev_src.append(i)
                if n:
                    ids += [0] * n
                    first, k = self._prev_drafts_at
                    prev_dst += range(end - n, end)
                    prev_src += range(first + i * k, first + i * k + n)
            computed_list.append(computed)
        n = len(seqs)
        q_lens = np.array(q_list, dtype=np.int64)
        computed = np.array(computed_list, dtype=np.int64)
        rows = np.array(row_list, dtype=np.int64)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        if end == n:  # decode only: one token per sequence, at its first uncomputed position
            row_of_token, positions = rows, computed.copy()
        else:
            row_of_token = rows[np.repeat(np.arange(n), q_lens)]
            positions = np.arange(end, dtype=np.int64) + np.repeat(computed - qsl[:-1], q_lens)
        bs = self.block_size
        slot_mapping = (self.input_batch.block_table_np[row_of_token, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        block_table = self.input_batch.block_table[self._h2d(rows, torch.long), :width]
        prompt_lens = np.array(plen_list, dtype=np.int64) if track_prompt else None
        return StepInputs(np.array(ids, dtype=np.int64), positions, slot_mapping, qsl, computed, computed + q_lens,
                          block_table, prev_dst, prev_src, prompt_lens), rows

    def _input_ids(self, inputs: StepInputs) -> torch.Tensor:
        """``[num_tokens]`` on the device, with the previous step's samples filled in."""
        input_ids = torch.from_numpy(inputs.input_ids).to(self.device, non_blocking=True)
        if inputs.prev_dst:
            input_ids[self._h2d(inputs.prev_dst, torch.long)] = self.prev_sampled[self._h2d(inputs.prev_src, torch.long)]
        return input_ids

    # ----------------------------------------------------------------- 4. forward
    def _forward(self, inputs: StepInputs, input_ids: torch.Tensor, plan: StepPlan
                 ) -> torch.Tensor | IntermediateTensors:
        """The forward of a step as ``plan`` says. Returns ``[num_tokens, H]``; on a pipeline
        stage before the last, the residual stream of the ``plan.padded_tokens`` tokens."""
        n = inputs.num_tokens
        if plan.mode is StepMode.GRAPH:
            graphs = self.cuda_graphs if plan.query_len == 1 else self.verify_graphs
            return graphs.run(inputs.num_reqs, input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
                              inputs.num_computed, inputs.block_table, plan.padded_tokens // plan.query_len,
                              inputs.query_start_loc)
        padded = plan.padded_tokens
        full = pad_step_inputs(inputs, padded, self.block_size)
        if padded > n:
            input_ids = torch.cat([input_ids, torch.zeros(padded - n, dtype=torch.long, device=self.device)])
        positions = torch.from_numpy(full.positions).to(self.device, non_blocking=True)

        def metadata(start: int, stop: int):
            part = full if (start, stop) == (0, padded) else full.slice_tokens(start, stop)
            return part.metadata(self.device)

        generated = full.generated_mask() if self._phase_layers else None
        phases = None if generated is None else lambda start, stop: RowPhases.from_mask(generated[start:stop], self.device)
        intermediate = None if self.stage is None else self.stage.receive(padded)
        out = forward_step(self.model, self.kv_caches, input_ids, positions, padded, plan.ubatches, metadata, phases,
                           intermediate)
        return out if isinstance(out, IntermediateTensors) else out[:n]

    def _run_padding(self, plan: StepPlan) -> None:
        """An idle data-parallel rank's share of the step: padding tokens only."""
        if plan.mode is StepMode.GRAPH:
            self.cuda_graphs.run_padding(plan.padded_tokens)
        else:
            self._forward(empty_step_inputs(), torch.empty(0, dtype=torch.long, device=self.device), plan)

    # ----------------------------------------------------------------- 5. sample
    def _sampling_inputs(self, seqs: list[ScheduledSequence], rows: np.ndarray, all_decode: bool,
                         qsl: np.ndarray) -> _StepSampling:
        """The sequences of ``seqs`` (input-batch ``rows``; ``qsl``: the step's query start
        locations) whose step ends their known tokens, so that they sample (or verify
        their drafts), and their sampler inputs. ``all_decode``: one token per sequence,
        so none has drafts (no second pass)."""
        index = [r for r, s in enumerate(seqs) if s.sample]
        spec_index = [] if all_decode else [r for r in index if seqs[r].num_drafts]
        if spec_index:
            index = [r for r in index if not seqs[r].num_drafts]
        sample_rows = rows if len(index) == len(seqs) else rows[index]
        batch = self.input_batch.sampling_batch(sample_rows) if index else None
        spec = self._spec_inputs(seqs, spec_index, rows[spec_index], qsl) if spec_index else None
        return _StepSampling(index, [seqs[r].seq_id for r in index], sample_rows, batch, spec)

    def _spec_inputs(self, seqs: list[ScheduledSequence], index: list[int], rows: np.ndarray,
                     qsl: np.ndarray) -> _SpecVerify:
        """The rejection sampler's inputs of the sequences ``seqs[i]`` for ``i`` in
        ``index`` (input-batch ``rows``), which have drafts: the last tokens of their
        query. A seeded sequence draws from a generator seeded as the sampler seeds its
        next token."""
        num_drafts = [seqs[r].num_drafts for r in index]
        ends = qsl[1:][index]
        draft_at = self._h2d(np.concatenate([np.arange(e - n, e) for e, n in zip(ends, num_drafts)]), torch.long)
        per_seq = self.input_batch.sampling_batch(rows, bad_words=False)
        generators = {i: torch.Generator(device=self.device).manual_seed(seed) for i, seed in per_seq.seeded}
        drafts = None
        if per_seq.penalty_rows is not None or self.input_batch.has_bad_words_np[rows].any():
            drafts = self._draft_lists([seqs[r] for r in index])
        batch = repeat_rows(replace(per_seq, seeded=[]), [n + 1 for n in num_drafts], drafts)
        if drafts is not None:
            batch = self._with_bad_words(batch, rows, drafts)
        greedy = per_seq.all_greedy or (False if per_seq.all_random else per_seq.greedy_mask)
        return _SpecVerify(index, [seqs[r].seq_id for r in index], rows, num_drafts, draft_at, batch, greedy,
                           generators)

    def _draft_lists(self, seqs: list[ScheduledSequence]) -> list[list[int]]:
        """Each sequence's draft ids on the host (penalties and bad words follow them):
        those proposed on the device are read back (a sync on CUDA; only for sequences
        with penalties or bad words)."""
        first, k = self._prev_drafts_at
        out = []
        for s in seqs:
            if s.num_device_drafts:
                at = first + self.prev_rows[s.seq_id] * k
                out.append(self.prev_sampled[at : at + s.num_device_drafts].tolist())
            else:
                out.append(s.spec_token_ids)
        return out

    def _with_bad_words(self, batch: SamplingBatch, rows: np.ndarray, drafts: list[list[int]]) -> SamplingBatch:
        """``batch`` (one row per verified position) with each position's bad-word masks:
        a word's last token is banned where the sequence's tokens, its drafts before the
        position included, end with the word's prefix."""
        ib = self.input_batch
        parts, start = [], 0
        for row, d in zip(rows.tolist(), drafts):
            if ib.has_bad_words_np[row]:
                for j in range(len(d) + 1):
                    toks, vals = ib.bad_words_bias(row, d[:j])
                    parts.append((torch.full_like(toks, start + j), toks, vals))
            start += len(d) + 1
        if not parts:
            return batch
        if batch.bias is not None:
            parts.insert(0, batch.bias)
        return replace(batch, bias=tuple(torch.cat(p) for p in zip(*parts)))

    def _logits(self, step_id: int, seqs: list[ScheduledSequence], sampling: _StepSampling, inputs: StepInputs,
                hidden: torch.Tensor, t_prep: float, timing: StepSpan | None,
                generated: np.ndarray | None) -> _ForwardedStep:
        """Logits of the sampling sequences, and prompt logprobs. ``generated [num_tokens]``:
        the step's token phases for a quantized LM head (None: not needed)."""
        results = StepResultTensors(prompt_logprobs=self._prompt_logprobs(seqs, inputs.query_start_loc, hidden))
        logits = spec_logits = None
        qsl = inputs.query_start_loc
        if sampling.index:
            rows = qsl[1:][sampling.index] - 1
            logits = self._compute_logits(hidden, rows, None if generated is None else generated[rows])
        if sampling.spec is not None:
            # Each sequence's last 1 + num_drafts positions: its last known token, then its drafts.
            spec = sampling.spec
            ends = qsl[1:][spec.index]
            positions = np.array([p for end, n in zip(ends, spec.num_drafts) for p in range(end - 1 - n, end)])
            spec_logits = self._compute_logits(hidden, positions, None if generated is None else generated[positions])
        return _ForwardedStep(step_id, sampling, logits, spec_logits, None, results, t_prep, timing)

    def _compute_logits(self, hidden: torch.Tensor, rows: np.ndarray, generated: np.ndarray | None) -> torch.Tensor:
        """``model.compute_logits`` of ``hidden``'s ``rows`` (token indices of the step), in
        a forward context giving a quantized LM head each row's token phase (``generated
        [len(rows)]`` bool; None: no context)."""
        h = hidden[torch.from_numpy(rows).to(self.device, non_blocking=True)]
        if generated is None:
            return self.model.compute_logits(h)
        with forward_context(ForwardContext(len(rows), row_phases=RowPhases.from_mask(generated, self.device))):
            return self.model.compute_logits(h)

    @torch.inference_mode()
    def _sample_step(self, fwd: _ForwardedStep, grammar: GrammarBitmask | None) -> AsyncModelRunnerOutput:
        """Sample a forwarded step (``grammar``'s bitmask applied to its rows first), record
        its timing and start the copy of its results to the host."""
        seq_ids, res = fwd.sampling.seq_ids, fwd.results
        if fwd.logits is not None:
            logits = fwd.logits
            if grammar is not None:
                t0 = time.perf_counter()
                self._apply_bitmask(logits, {sid: i for i, sid in enumerate(seq_ids)}, grammar)
                if self.step_times is not None:
                    self.step_times.add(fwd.step_id, "bitmask", time.perf_counter() - t0)
            out: SamplerOutput = sample(logits, fwd.sampling.batch, self.input_batch.output_counts,
                                        self.input_batch.prompt_mask)
            self.input_batch.record_sampled(fwd.sampling.rows, out.sampled)
            res.sampled = out.sampled
            if out.logprobs is not None:
                res.logprobs = SampledLogprobTensors(out.logprob_token_ids, out.logprobs, out.sampled_ranks)
        else:
            res.sampled = torch.empty(0, dtype=torch.long, device=self.device)
        accepted: dict[int, list[int]] = {}
        accepted_lp: dict[int, list[RowLogprobs]] = {}
        num_drafts: dict[int, int] = {}
        last, rejected, drafts = res.sampled, None, None
        if fwd.spec_logits is not None:
            spec = fwd.sampling.spec
            if grammar is not None:
                starts = np.cumsum([0] + [n + 1 for n in spec.num_drafts[:-1]]).tolist()
                self._apply_bitmask(fwd.spec_logits, dict(zip(spec.seq_ids, starts)), grammar)
            first, accepted, accepted_lp = self._verify_drafts(spec, fwd.spec_logits, len(seq_ids))
            res.sampled = torch.cat([res.sampled, first])
            last = torch.cat([last, self._h2d([e[-1] for e in accepted.values()], torch.long)])
            num_drafts = dict(zip(accepted, spec.num_drafts))
            rejected = [0] * len(seq_ids) + [n + 1 - len(e) for n, e in zip(spec.num_drafts, accepted.values())]
            seq_ids = seq_ids + spec.seq_ids
        if fwd.draft is not None:
            drafts = res.draft_token_ids = self._propose_drafts(fwd.draft, fwd.sampling, last, accepted)
        self.prev_rows = {sid: i for i, sid in enumerate(seq_ids)}
        self.prev_rejected = rejected
        if drafts is None:
            self.prev_sampled = last
        else:
            self.prev_sampled = torch.cat([last, drafts.reshape(-1)])
            self._prev_drafts_at = (len(seq_ids), drafts.shape[1])
        if fwd.timing is not None:
            fwd.timing.end = self._timing_event()
            self.step_events.append(fwd.timing)
        if self.step_times is not None:
            self.step_times.add(fwd.step_id, "prepare", fwd.t_prep)
        handle = self._copy_to_host(seq_ids, res, accepted, accepted_lp, num_drafts)
        if self.stage is not None and self.stage.reports:
            return AsyncModelRunnerOutput(lambda: self.stage.report(handle.result()))
        return handle

    def _verify_drafts(self, spec: _SpecVerify, logits: torch.Tensor, first_row: int) -> tuple[
            torch.Tensor, dict[int, list[int]], dict[int, list[tuple[list[int], list[float], int]]]]:
        """Rejection-sample the drafts of ``spec`` against ``logits`` (``[sum(1 +
        num_drafts), V]``) and count the emitted tokens into the input batch (seeds and
        min_tokens follow each sequence's token count). Reads the accepted counts on the
        host (a sync). Returns the first emitted token of each sequence (``[R]`` int64 on
        the device), ``{first_row + i: every token sequence i emitted}`` and, when a
        sequence asks for logprobs, ``{first_row + i: per emitted token (ids [1 + k],
        logprobs [1 + k], rank)}`` as the sampler gives them (of the raw logits)."""
        ib = self.input_batch
        probs, greedy_ids = target_distribution(logits, spec.batch, ib.output_counts, ib.prompt_mask)
        out = rejection_sample(spec.draft_ids, spec.num_drafts, probs, None, spec.greedy,
                               generators=spec.generators, target_greedy_ids=greedy_ids)
        token_ids, num_accepted = out.token_ids.tolist(), out.num_accepted.tolist()
        emitted = [toks[:n + 1] for toks, n in zip(token_ids, num_accepted)]
        ib.record_emitted(spec.rows, emitted)
        logprobs = {}
        if spec.batch.max_num_logprobs >= 0:
            logprobs = {first_row + i: lp for i, lp in enumerate(self._emitted_logprobs(logits, spec, emitted))}
        return out.token_ids[:, 0], {first_row + i: e for i, e in enumerate(emitted)}, logprobs

    def _emitted_logprobs(self, logits: torch.Tensor, spec: _SpecVerify,
                          emitted: list[list[int]]) -> list[list[tuple[list[int], list[float], int]]]:
        """Per verifying sequence, per emitted token: (its id then the top k ids, their
        logprobs, its rank) from the raw ``logits`` of its position (``[sum(1 +
        num_drafts), V]``), as :func:`~tandem.worker.sampler.sample` reports them."""
        starts = np.cumsum([0] + [n + 1 for n in spec.num_drafts[:-1]])
        rows = [int(st) + j for st, e in zip(starts, emitted) for j in range(len(e))]
        lp = logits[self._h2d(rows, torch.long)].log_softmax(dim=-1)
        tok = self._h2d([t for e in emitted for t in e], torch.long)[:, None]
        tok_lp = lp.gather(1, tok)
        ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
        k = spec.batch.max_num_logprobs
        ids, vals = tok, tok_lp
        if k > 0:
            top_lp, top_ids = lp.topk(k, dim=-1)
            ids, vals = torch.cat([tok, top_ids], 1), torch.cat([tok_lp, top_lp], 1)
        flat = list(zip(ids.tolist(), vals.tolist(), ranks))
        bounds = np.cumsum([0] + [len(e) for e in emitted])
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _propose_drafts(self, draft: _DraftInputs, sampling: _StepSampling, last: torch.Tensor,
                        accepted: dict[int, list[int]]) -> torch.Tensor | None:
        """The draft model's catch-up on the step's confirmed tokens, and, when the step
        wants drafts, the next drafts (``[R, K]`` int64 on the device; else None) of the
        step's ``R`` sampling sequences, from each one's last emitted token ``last`` (``[R]``)."""
        keep = draft.known.copy()
        spec_index = sampling.spec.index if sampling.spec is not None else []
        for r, tokens in zip(spec_index, accepted.values()):  # its last known token and accepted drafts
            keep[r] += len(tokens) - 1
        inputs, ib, bs = draft.inputs, self.input_batch, self.block_size
        last_pos = int((inputs.num_computed + keep).max()) + self.drafter.num_speculative_tokens
        width = min(-(-last_pos // bs), ib.block_table.shape[1])
        table = ib.block_table[self._h2d(draft.rows, torch.long), :width]
        return self.drafter.propose(DraftStep(inputs, draft.input_ids, keep,
                                              np.array(sampling.index + spec_index, dtype=np.int64), last,
                                              draft.propose, ib.block_table_np[draft.rows], table,
                                              draft.target_hidden, draft.next_token_ids, draft.seq_ids))

    def _apply_bitmask(self, logits: torch.Tensor, first_row: dict[int, int], grammar: GrammarBitmask) -> None:
        """Mask, in place, the tokens ``grammar`` forbids in the rows of its sequences that
        ``logits`` holds: sequence ``sid``'s first row is ``first_row[sid]``, and a sequence
        with several grammar rows (verified positions) has as many consecutive rows."""
        rows, used, seen = [], [], {}
        for g, sid in enumerate(grammar.seq_ids):
            first = first_row.get(sid)
            if first is not None:
                k = seen[sid] = seen.get(sid, -1) + 1
                rows.append(first + k)
                used.append(g)
        if not rows:
            return
        mask = grammar.bitmask if len(used) == len(grammar.seq_ids) else grammar.bitmask[used]
        # Pinned: a pageable copy could wait for the step's forward to finish.
        mask = mask.pin_memory() if self._is_cuda else mask
        # Every row constrained, in order (all-constrained decode steps): no scatter.
        in_order = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
        apply_token_bitmask(logits, None if in_order else self._h2d(rows, torch.long),
                            mask.to(self.device, non_blocking=True))

    def _prompt_logprobs(self, seqs: list[ScheduledSequence], qsl: np.ndarray,
                         hidden: torch.Tensor) -> dict[int, PromptLogprobTensors]:
        """Logprobs of the prompt tokens following each scheduled prompt position, by
        seq_id (device tensors, copied to the host with the sampled ids: no sync)."""
        found: dict[int, PromptLogprobTensors] = {}
        if not self.input_batch.prompt_logprobs_seq_ids:
            return found
        for r, s in enumerate(seqs):
            st = self.input_batch.states[s.seq_id]
            if not st.compute_prompt_logprobs or s.num_computed_tokens >= st.prompt_len:
                continue
            start = s.num_computed_tokens
            # Positions whose next token is still in the prompt.
            end = min(start + s.num_new_tokens, st.prompt_len - 1)
            if end <= start:
                continue
            lo = int(qsl[r])
            prompt_rows = np.zeros(end - start, dtype=bool) if self._phase_layers else None  # all prompt tokens
            lp = self._compute_logits(hidden, np.arange(lo, lo + end - start), prompt_rows).log_softmax(dim=-1)
            nxt = self._h2d(st.prompt_token_ids[start + 1 : end + 1], torch.long)
            tok_lp = lp.gather(1, nxt[:, None])
            ranks = (lp > tok_lp).sum(-1) + 1
            ids, vals = nxt[:, None], tok_lp
            k = st.params.prompt_logprobs
            if k > 0:
                top_lp, top_ids = lp.topk(k, dim=-1)
                ids, vals = torch.cat([ids, top_ids], 1), torch.cat([vals, top_lp], 1)
            found[s.seq_id] = PromptLogprobTensors(start + 1, ids, vals, ranks)
        return found

    # ----------------------------------------------------------------- 6. to host
    def _copy_to_host(self, seq_ids: list[int], res: StepResultTensors, accepted: dict[int, list[int]],
                      accepted_lp: dict[int, list[RowLogprobs]], num_drafts: dict[int, int]) -> AsyncModelRunnerOutput:
        """Start the device-to-host copy of a step's results (on CUDA: pinned buffers, a
        side stream, one event); the handle's ``result()`` waits for it. ``accepted`` /
        ``accepted_lp`` / ``num_drafts``: ``ModelRunnerOutput.accepted_token_ids`` /
        ``accepted_logprobs`` / ``num_draft_tokens``, already on the host."""
        host, event = res, None
        if self._is_cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                host = res.map(self._pinned_copy)
                event = torch.cuda.Event()
                event.record(self._copy_stream)

        def resolve() -> ModelRunnerOutput:
            if event is not None:
                event.synchronize()
            return host.to_output(seq_ids, accepted, accepted_lp, num_drafts)

        return AsyncModelRunnerOutput(resolve)

    def _pinned_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``t``, queued on the current (copy) stream."""
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        t.record_stream(self._copy_stream)
        return host

    # ----------------------------------------------------------------- startup
    @torch.inference_mode()
    def measure_prefill_split(self, num_tokens: int, iters: int = 3) -> tuple[float, float] | None:
        """Time an eager step of ``num_tokens`` prefill tokens (one dummy request of random
        ids, K/V into the null block) plain and as two ubatches (CUDA events, median of
        ``iters`` after a warm-up of each), and hand the timings to the DBO policy
        (:meth:`DBOPolicy.set_prefill_split`). One request is a long prompt's chunk, whose
        second ubatch also attends to the first's keys: the costliest split, so the policy
        errs towards not splitting a step of short prompts. Every rank whose forwards
        exchange data must call this at the same point with the same ``num_tokens`` (the
        MoE exchanges pair up).

        Returns:
            (plain ms, split ms); None when nothing was measured (DBO off, not CUDA, a
            dense model, or ``num_tokens`` below the prefill threshold).
        """
        if self.dbo is None or not self._is_cuda or num_tokens < self.dbo.prefill_token_threshold:
            return None
        dummy = pad_step_inputs(empty_step_inputs(), num_tokens, self.block_size)
        # Random ids: routing spreads over the experts as in real prompts. A generator of its
        # own leaves the engine's seeded global one untouched.
        gen = torch.Generator(device=self.device).manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (num_tokens,), device=self.device, generator=gen)
        times = []
        for ubatches in (None, ubatch_slices(num_tokens)):
            plan = StepPlan(StepMode.EAGER, num_tokens, num_tokens, ubatches)
            times.append(cuda_median_ms(lambda: self._forward(dummy, ids, plan), warmup=1, iters=iters))
        split = self.dbo.set_prefill_split(times[0], times[1])
        logger.info("dual-batch overlap for steps with prefill tokens: %s (a %d-token step took %.2f ms plain, "
                    "%.2f ms split)", "on" if split else "off", num_tokens, times[0], times[1])
        return times[0], times[1]
