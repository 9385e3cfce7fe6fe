"""The engine core: scheduler, KV cache manager, model runner and the one-step-ahead loop.

As vLLM V1's ``EngineCore``: it takes tokenized, validated :class:`EngineCoreRequest`s (one
per sequence) and turns each model step into :class:`EngineCoreOutput`s (new token ids and
logprobs, token-id finishes). Text never reaches it: detokenization, stop strings and
``RequestOutput``s are the front end's (:mod:`tandem.engine.output_processor`).

With ``async_output_proc`` (vLLM PR #7049, vLLM V1 async scheduling), step N+1 is scheduled
and launched before step N's sampled ids are taken in, so the core's output handling and the
front end's detokenization of step N overlap the model's execution of step N+1 (docs/architecture.md).
With several batches in flight (pipeline parallelism, ``EngineConfig.max_concurrent_batches``)
the loop is vLLM V1's ``step_with_batch_queue``: a batch is scheduled and launched while
others run through the stages, and the oldest is taken in once the queue is full
(:meth:`EngineCore.step`).
The core runs in the front end's process (:class:`tandem.engine.core_client.InprocClient`)
or in its own (:mod:`tandem.engine.core_proc`).
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from collections import deque
from typing import Any

from tandem import envs
from tandem.config import EngineConfig
from tandem.config.resolved import ResolvedConfig
from tandem.core.block_manager import KVCacheManager
from tandem.core.sched_output import SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.distributed import parallel_state as ps
from tandem.engine.messages import EngineCoreOutput, EngineCoreReady, EngineCoreRequest, SchedulerStats
from tandem.model_loader.generation_config import load_generation_defaults
from tandem.model_loader.loader import load_hf_config
from tandem.request import Request, RequestStatus
from tandem.spec_decode.ngram_proposer import NgramProposer
from tandem.step_timing import StepHostTimes
from tandem.structured_output.manager import StructuredOutputManager
from tandem.worker.model_runner import AsyncModelRunnerOutput
from tandem.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the model runner and the scheduler of one data-parallel replica.

    Args:
        config: engine configuration; ``max_model_len`` and the batch limits are resolved
            in place, and everything the core resolved is ``self.resolved``
            (:class:`ResolvedConfig`, sent in :meth:`ready_message`).
        engine_index: the replica's data-parallel rank (set on its outputs).

    Raises:
        ValueError: the model cannot be loaded or the limits are inconsistent.
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        # Before the model's first GEMM: the libraries read these limits once.
        envs.set_library_cache_limits()
        self.config = config
        self.engine_index = engine_index
        model_cfg, cache_cfg, sched_cfg = config.model_config, config.cache_config, config.scheduler_config
        world_size = config.parallel_config.world_size
        if world_size != ps.get_world_size():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {world_size} ranks, "
                             f"but this process "
                             f"is not one of them: build the engine through tandem.entrypoints.llm.LLM or "
                             f"tandem.engine.core_client (they launch the ranks)")
        self.hf_config = load_hf_config(model_cfg.model)
        _resolve_limits(config, self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        # The worker owns this rank's world: the model, the KV cache tensors, the runner.
        self.worker = Worker(config, self.hf_config)
        self.model = self.worker.load_model()
        # The ranks of one replica (its stages and shards) share the driver's block ids:
        # agree on the smallest cache.
        self.num_kv_blocks = ps.replica_min(self.worker.determine_num_kv_blocks())
        self.runner = self.worker.initialize_kv_cache(self.num_kv_blocks)  # may lower max_model_len
        # Every setting left to the engine is decided by now: sent to the front end as it is.
        self.resolved = resolved = _resolved_config(config, self.worker, self.num_kv_blocks)
        self.kv_manager = KVCacheManager(self.num_kv_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.eos_token_ids = self._eos_token_ids()
        # Grammars of constrained requests: compiled here, advanced by the scheduler, and
        # turned into each step's bitmask before sampling.
        self.structured_output = StructuredOutputManager(
            model_cfg.tokenizer or model_cfg.model, self.vocab_size,
            self.eos_token_ids | resolved.generation_defaults.eos_token_ids,
            pin_memory=self.worker.device.type == "cuda")
        self.scheduler = Scheduler(self.kv_manager, resolved.max_num_seqs, resolved.max_num_batched_tokens,
                                   resolved.max_model_len, sched_cfg.enable_chunked_prefill, self.structured_output,
                                   _make_proposer(config), _num_lookahead_tokens(config),
                                   _disable_by_batch_size(config), config.max_concurrent_batches)
        self._inflight: tuple[SchedulerOutput, object] | None = None
        # Several batches in flight: (step, handle) oldest first, and the virtual engine
        # scheduled next (Scheduler, "several batches in flight").
        self.max_concurrent_batches = config.max_concurrent_batches
        self._batch_queue: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput, int]] = deque()
        self._next_engine = 0
        # Finished and preempted sequence ids of steps not launched (empty), for the next one.
        self._unsent: tuple[list[int], list[int]] = ([], [])
        # Steps launched while another batch was in flight.
        self.num_overlapped_steps = 0
        # Pipeline parallelism: each stage's host seconds busy with steps (PipelineStage).
        self.stage_busy_s = [0.0] * config.parallel_config.pipeline_parallel_size
        self.async_output_proc = sched_cfg.async_output_proc
        # Live sequences by request id (the front end's per-sequence id).
        self._seq_ids: dict[str, int] = {}
        # Outputs for requests the core dropped itself (a failed step), sent with the next step.
        self._pending: list[EngineCoreOutput] = []
        self.num_steps = 0
        # Tensor parallelism: the driver sends each step's SchedulerOutput to the other TP
        # ranks before running it (set by tandem.engine.rank_core.build_rank_core).
        self.step_broadcast = None
        self._bitmask_owed = False
        # Host time per step (schedule, the runner's input preparation, update_from_output)
        # while a benchmark records it (start_host_timing).
        self.step_times: StepHostTimes | None = None
        freeze_startup_heap()
        self._heap_frozen = True

    def _eos_token_ids(self) -> set[int]:
        """The model config's EOS ids (the front end adds its tokenizer's and
        generation_config.json's)."""
        eos = getattr(self.hf_config, "eos_token_id", None)
        return set([eos] if isinstance(eos, int) else eos or [])

    def ready_message(self) -> EngineCoreReady:
        """The startup handshake: what this core resolved, and the limits a front end
        validates requests against."""
        from dataclasses import asdict

        info = ps.get_parallel_info()
        return EngineCoreReady(
            engine_index=self.engine_index, resolved=self.resolved, vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            kv_cache_shape_per_block=tuple(self.model.kv_cache_shape_per_block), parallel=asdict(info),
            host=socket.gethostname())

    # ----------------------------------------------------------------- requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue one sequence (already validated by the front end).

        Raises:
            ValueError: ``request_id`` is live in this core.
        """
        if req.request_id in self._seq_ids:
            raise ValueError(f"request_id {req.request_id!r} is already in use by a running request.")
        seq = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time,
                      max_tokens=req.max_tokens)
        self._seq_ids[req.request_id] = seq.seq_id
        if req.sampling_params.structured_outputs is not None:
            self.structured_output.init_request(seq)
        self.scheduler.add_request(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish sequences now and free their blocks; nothing more is emitted for them."""
        for rid in request_ids:
            sid = self._seq_ids.pop(rid, None)
            if sid is not None:
                self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._batch_queue)
                or bool(self._pending))

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine iteration; returns the outputs of the step processed by it.

        Raises:
            Exception: a model step failed (e.g. an exception in one DBO ubatch). The
                requests of the failed step and of the step in flight are aborted (their
                blocks freed, an "abort" output with ``error`` queued for the next call);
                the core stays usable for the others and for new ones.
        """
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        outputs, self._pending = self._pending + self._fail_uncompiled(), []
        if self._inflight is not None and self.scheduler.needs_outputs_to_draft():
            # Host-side drafts follow a sequence's last token: the step in flight is taken in first.
            try:
                outputs += self._finish_inflight()
            except Exception:
                self._pending = outputs + self._pending  # its requests' abort outputs follow
                raise
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        if self.step_times is not None:
            self.step_times.add(so.step_id, "schedule", time.perf_counter() - t0)
        if self.step_broadcast is not None:
            self.step_broadcast(so)
        prev, self._inflight = self._inflight, None
        failed = [so] + ([prev[0]] if prev is not None else [])
        handle = None
        self.num_steps += 1
        try:
            handle = self.runner.execute_model(so)
            # TP followers wait for this step's bitmask until _sample_constrained sends it.
            self._bitmask_owed = handle is None and self.step_broadcast is not None
            if not self.async_output_proc:
                handle = handle or self._sample_constrained(so)
                result = handle.result()
                self._advance_grammars(so, result)
                return outputs + self._take(so, result, grammars_advanced=True)
            # Step N's outputs are processed while step N+1 (just launched) runs. Constrained
            # sequences of step N+1 sample once step N's tokens advanced their grammars, so
            # that advance and N+1's bitmask come first, as soon as N's tokens are on the
            # host, while N+1's forward runs; the rest of N's processing (every row's stop
            # checks and output) then overlaps N+1's sampling instead of delaying it.
            if prev is not None:
                result = prev[1].result()
                self._advance_grammars(prev[0], result)
            handle = handle or self._sample_constrained(so)
            if prev is not None:
                outputs += self._take(prev[0], result, grammars_advanced=True)
            if so.is_empty:
                # Nothing to process later, but an idle DP rank's dummy batch can fail: wait.
                handle.result()
            elif any(s.spec_token_ids for s in so.scheduled) and self.scheduler.needs_outputs_to_draft():
                # The next step's drafts are proposed on the host from this one's tokens: taken in now.
                result = handle.result()
                self._advance_grammars(so, result)
                outputs += self._take(so, result, grammars_advanced=True)
            else:
                self._inflight = (so, handle)
            return outputs
        except Exception as e:
            if self._bitmask_owed:
                self._bitmask_owed = False
                self.step_broadcast(None)  # the followers abandon the step too
            self._pending = outputs
            self._abort_steps(failed, [h for h in (handle, prev[1] if prev is not None else None) if h is not None], e)
            raise

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """One iteration with several batches in flight (vLLM V1's ``step_with_batch_queue``):
        while fewer than ``max_concurrent_batches`` run, schedule a virtual engine with none
        in flight and launch its batch; once the queue is full, or nothing could be
        launched, wait for the oldest batch and take in its outputs. Failures as :meth:`step`."""
        outputs, self._pending = self._pending + self._fail_uncompiled(), []
        launched = False
        if len(self._batch_queue) < self.max_concurrent_batches:
            so, engine = self._schedule_free_engine()
            if so is not None:
                try:
                    self._launch_batch(so, engine)
                    launched = True
                except Exception as e:
                    self._fail_batches(outputs, [so], e)
                    raise
        if self._batch_queue and (not launched or len(self._batch_queue) == self.max_concurrent_batches):
            so, handle, _ = self._batch_queue[0]
            try:
                result = handle.result()
            except Exception as e:
                self._fail_batches(outputs, [], e)
                raise
            self._batch_queue.popleft()
            self._advance_grammars(so, result)
            outputs += self._take(so, result, grammars_advanced=True)
        return outputs

    def _schedule_free_engine(self) -> tuple[SchedulerOutput | None, int]:
        """The step of the first virtual engine (round robin) with no batch in flight and
        sequences to run, and that engine; (None, -1) if none has. The finished and
        preempted sequences of empty steps go with the next step launched: an empty step
        is never launched, as a stage waiting for it could hold up a batch in flight."""
        busy = {engine for _, _, engine in self._batch_queue}
        for i in range(self.max_concurrent_batches):
            engine = (self._next_engine + i) % self.max_concurrent_batches
            if engine in busy:
                continue
            t0 = time.perf_counter()
            so = self.scheduler.schedule(engine)
            if self.step_times is not None:
                self.step_times.add(so.step_id, "schedule", time.perf_counter() - t0)
            finished, preempted = self._unsent
            so.finished_seq_ids, so.preempted_seq_ids = finished + so.finished_seq_ids, preempted + so.preempted_seq_ids
            if so.scheduled:
                self._unsent = ([], [])
                self._next_engine = engine + 1
                return so, engine
            self._unsent = (so.finished_seq_ids, so.preempted_seq_ids)
        return None, -1

    def _launch_batch(self, so: SchedulerOutput, engine: int) -> None:
        """Send ``so`` to the replica's other ranks, launch it and queue it."""
        if self.step_broadcast is not None:
            self.step_broadcast(so)
        self.num_steps += 1
        handle = self.runner.execute_model(so)
        self._bitmask_owed = handle is None and self.step_broadcast is not None
        handle = handle or self._sample_constrained(so)
        if self._batch_queue:
            self.num_overlapped_steps += 1
        self._batch_queue.append((so, handle, engine))

    def _fail_batches(self, outputs: list[EngineCoreOutput], launching: list[SchedulerOutput], err: Exception) -> None:
        """A batch failed: abort the requests of ``launching`` and of every batch in flight."""
        if self._bitmask_owed:
            self._bitmask_owed = False
            self.step_broadcast(None)  # the followers abandon the step too
        self._pending = outputs
        queued, self._batch_queue = list(self._batch_queue), deque()
        self._abort_steps(launching + [so for so, _, _ in queued], [h for _, h, _ in queued], err)

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and take in its outputs (on failure its requests
        are aborted as :meth:`step` does, and the error raised)."""
        so, handle = self._inflight
        self._inflight = None
        try:
            result = handle.result()
            self._advance_grammars(so, result)
            return self._take(so, result, grammars_advanced=True)
        except Exception as e:
            self._abort_steps([so], [handle], e)
            raise

    def _sample_constrained(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Build the bitmask of ``so``'s constrained sequences and sample the step."""
        t0 = time.perf_counter()
        grammar = self.structured_output.grammar_bitmask(so.structured_output_seq_ids, self.scheduler.requests)
        if self.step_times is not None:
            self.step_times.add(so.step_id, "grammar", time.perf_counter() - t0)
        if self.step_broadcast is not None:
            self.step_broadcast(grammar)
            self._bitmask_owed = False
        return self.runner.sample_tokens(grammar)

    def _fail_uncompiled(self) -> list[EngineCoreOutput]:
        """Finish the sequences whose grammar failed to compile ("abort", with the error)."""
        outputs = []
        for req in self.structured_output.take_failed():
            if self._seq_ids.get(req.request_id) != req.seq_id:
                continue  # aborted meanwhile
            err = req.structured_output.error()
            logger.error("request %s: its grammar did not compile: %s", req.request_id, err)
            self.abort_requests([req.request_id])
            outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="abort",
                                            error=f"grammar compilation failed: {err}"))
        return outputs

    def _advance_grammars(self, so: SchedulerOutput, result) -> None:
        if not so.structured_output_seq_ids:
            return  # no constrained row sampled in this step: no per-row scan of the batch
        t0 = time.perf_counter()
        self.scheduler.advance_grammars(result)
        if self.step_times is not None and result.seq_ids:
            self.step_times.add(so.step_id, "grammar", time.perf_counter() - t0)

    def _take(self, so: SchedulerOutput, result, grammars_advanced: bool = False) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        if result.stage_busy_s is not None:
            self.stage_busy_s = [a + b for a, b in zip(self.stage_busy_s, result.stage_busy_s)]
        outs = self.scheduler.update_from_output(result, grammars_advanced)
        for o in outs:
            if o.finish_reason is not None:
                del self._seq_ids[o.request_id]
        if self.step_times is not None and result.seq_ids:
            self.step_times.add(so.step_id, "process", time.perf_counter() - t0)
        return outs

    def start_host_timing(self) -> StepHostTimes:
        """Record the host time of every step from now on (:mod:`tandem.step_timing`)."""
        self.step_times = self.runner.step_times = StepHostTimes()
        return self.step_times

    def stop_host_timing(self) -> StepHostTimes | None:
        times, self.step_times, self.runner.step_times = self.step_times, None, None
        return times

    def _abort_steps(self, steps: list[SchedulerOutput], handles: list, err: Exception) -> None:
        """Abort every request with a sequence in ``steps`` after waiting out their handles.

        Blocks those steps were to fill may be registered in the prefix cache without
        valid K/V; once their requests are aborted they are all idle, and the idle part of
        the prefix cache is dropped.
        """
        for h in handles:
            try:
                h.result()
            except Exception:  # the failure being raised, or a consequence of it
                pass
        for so in steps:
            for seq in so.scheduled:
                req = self.scheduler.requests.get(seq.seq_id)
                if req is not None:
                    logger.error("aborting request %s: its model step failed", req.request_id)
                    self.abort_requests([req.request_id])
                    self._pending.append(EngineCoreOutput(req.request_id, [], finish_reason="abort",
                                                          error=f"model step failed: {err!r}"))
        self.kv_manager.pool.evict_idle_cached_blocks()

    def drain_in_flight(self) -> None:
        """Wait out the steps in flight, their outputs dropped (the engine stops): a
        pipeline's last stage reports each one to the driver before it can stop."""
        while self._batch_queue:
            self._batch_queue.popleft()[1].result()
        if self._inflight is not None:
            _, handle = self._inflight
            self._inflight = None
            handle.result()

    def shutdown(self) -> None:
        self.runner.shutdown()
        self.structured_output.shutdown()
        if self._heap_frozen:
            self._heap_frozen = False
            unfreeze_startup_heap()

    def scheduler_stats(self) -> SchedulerStats:
        s, kv = self.scheduler, self.kv_manager
        return SchedulerStats(num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=kv.usage,
                              num_preemptions=s.num_preemptions, prefix_cache_queries=kv.prefix_queries,
                              prefix_cache_hits=kv.prefix_hits, num_free_blocks=kv.pool.num_free_blocks,
                              num_usable_blocks=kv.num_usable_blocks,
                              spec_decode_num_draft_tokens=s.num_draft_tokens,
                              spec_decode_num_accepted_tokens=s.num_accepted_tokens,
                              spec_decode_num_drafts=s.num_drafts,
                              spec_decode_num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos))

    def debug_stats(self) -> dict[str, Any]:
        """State read between two steps (tests, ``/debug/engine_stats``): the scheduler's
        gauges and counters (spec_decode_num_drafts, spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens included; spec_decode_num_accepted_tokens_per_pos: a
        list, the accepted tokens at each draft position) plus num_unfinished_seqs,
        num_seqs_with_blocks, num_steps, num_overlapped_steps (steps launched while another
        batch was in flight: several batches in flight), pp_stage_busy_s (per pipeline
        stage, its host seconds busy with steps: :mod:`tandem.worker.pipeline_stage`),
        num_dbo_steps."""
        st = self.scheduler_stats()
        s = {f: getattr(st, f) for f in st.__struct_fields__}
        s.update(num_unfinished_seqs=len(self.scheduler.requests), num_seqs_with_blocks=len(self.kv_manager.req_blocks),
                 num_steps=self.num_steps, num_overlapped_steps=self.num_overlapped_steps,
                 pp_stage_busy_s=list(self.stage_busy_s),
                 num_dbo_steps=getattr(self.runner, "num_dbo_steps", 0))
        return s


def _make_proposer(config: EngineConfig) -> NgramProposer | None:
    """The host-side draft proposer of ``config.speculative_config``; None without one (a
    draft model's drafts come from the model runner)."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def _disable_by_batch_size(config: EngineConfig) -> int | None:
    spec = config.speculative_config
    return None if spec is None else spec.disable_by_batch_size


def _num_lookahead_tokens(config: EngineConfig) -> int:
    """KV slots each sampling step reserves past its tokens for the drafts' K/V (a draft
    model's or an EAGLE head's)."""
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None and spec.uses_model else 0


def _resolved_config(config: EngineConfig, worker: Worker, num_kv_blocks: int) -> ResolvedConfig:
    """What this core runs with, once its worker loaded the model and sized the KV cache
    (``config``'s limits resolved in place by then, :func:`_resolve_limits`)."""
    model_cfg, sched_cfg = config.model_config, config.scheduler_config
    quant = worker.quant_config
    return ResolvedConfig(
        dtype=str(worker.dtype).removeprefix("torch."), quantization=quant.method if quant is not None else None,
        all2all_backend=worker.all2all_backend, device=str(worker.device), max_model_len=model_cfg.max_model_len,
        max_num_seqs=sched_cfg.max_num_seqs, max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        generation_defaults=load_generation_defaults(model_cfg.model, model_cfg.generation_config))


def _resolve_limits(config: EngineConfig, hf_config) -> None:
    """Fill the engine's length and batch limits from the model's context length.

    Raises:
        ValueError: ``max_model_len`` exceeds the model's context, or the limits are
            inconsistent (:meth:`EngineConfig.resolve_limits`).
    """
    model_max = getattr(hf_config, "max_position_embeddings", 2048)
    config.resolve_limits(model_max)
    if config.model_config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.model_config.max_model_len}) exceeds the model's context length "
                         f"({model_max}).")


# Engine cores of this process that froze the heap and still run.
_num_frozen = 0


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive (the model, the libraries' modules and
    caches) out of the collector's generations, as vLLM's engine core does: a full
    collection while serving otherwise traverses all of them, a pause of hundreds of ms
    in one step at a thousand sequences (benchmarks/RESULTS.md, session 7). Undone by
    :func:`unfreeze_startup_heap` when the last engine core of the process shuts down."""
    global _num_frozen
    gc.collect()
    gc.freeze()
    _num_frozen += 1


def unfreeze_startup_heap() -> None:
    """One engine core stopped: once none runs, the frozen objects rejoin the collector
    (a released engine's reference cycles can be freed again)."""
    global _num_frozen
    _num_frozen -= 1
    if _num_frozen == 0:
        gc.unfreeze()


__all__ = ["EngineCore", "freeze_startup_heap", "unfreeze_startup_heap"]
