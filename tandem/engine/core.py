"""The engine core: scheduler, KV cache manager, model runner and the one-step-ahead loop.

As vLLM V1's ``EngineCore``: it takes tokenized, validated :class:`EngineCoreRequest`s (one
per sequence) and turns each model step into :class:`EngineCoreOutput`s (new token ids and
logprobs, token-id finishes). Text never reaches it: detokenization, stop strings and
``RequestOutput``s are the front end's (:mod:`tandem.engine.output_processor`).

With ``async_output_proc`` (vLLM PR #7049, vLLM V1 async scheduling), step N+1 is scheduled
and launched before step N's sampled ids are taken in, so the core's output handling and the
front end's detokenization of step N overlap the model's execution of step N+1 (docs/architecture.md).
The core runs in the front end's process (:class:`tandem.engine.core_client.InprocClient`)
or in its own (:mod:`tandem.engine.core_proc`).
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.selector import get_attention_backend
from tandem.config import EngineConfig
from tandem.core.block_manager import KVCacheManager
from tandem.core.sched_output import SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.distributed import parallel_state as ps
from tandem.engine.messages import EngineCoreOutput, EngineCoreReady, EngineCoreRequest, SchedulerStats
from tandem.layers.quantization.config import get_quantization_config
from tandem.layers.quantization.fp8 import check_fp8_supported
from tandem.model_loader.generation_config import load_generation_defaults
from tandem.model_loader.loader import build_model, load_hf_config
from tandem.request import Request, RequestStatus
from tandem.step_timing import StepHostTimes
from tandem.structured_output.manager import StructuredOutputManager
from tandem.worker.kv_cache import allocate_kv_caches
from tandem.worker.model_runner import AsyncModelRunnerOutput, ModelRunner
from tandem.worker.step_plan import DBOPolicy

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the model runner and the scheduler of one data-parallel replica.

    Args:
        config: engine configuration; ``max_model_len`` and ``max_num_batched_tokens`` are
            resolved in place.
        engine_index: the replica's data-parallel rank (set on its outputs).

    Raises:
        ValueError: the model cannot be loaded or the limits are inconsistent.
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index
        model_cfg, cache_cfg, sched_cfg, dbo_cfg = (config.model_config, config.cache_config, config.scheduler_config,
                                                    config.dbo_config)
        world_size = config.parallel_config.world_size
        if world_size != ps.get_world_size():
            raise ValueError(f"tensor_parallel_size x data_parallel_size = {world_size} ranks, but this process "
                             f"is not one of them: build the engine through tandem.entrypoints.llm.LLM or "
                             f"tandem.engine.core_client (they launch the ranks)")
        device, dtype = config.device_config.torch_device, config.torch_dtype
        self.hf_config = load_hf_config(model_cfg.model)
        model_max = getattr(self.hf_config, "max_position_embeddings", 2048)
        config.resolve_limits(model_max)
        if model_cfg.max_model_len > model_max:
            raise ValueError(f"max_model_len ({model_cfg.max_model_len}) exceeds the model's context length "
                             f"({model_max}).")
        backend = get_attention_backend(device, model_cfg.max_model_len)
        quant_config = get_quantization_config(self.hf_config, model_cfg.quantization, config.load_config.load_format)
        if quant_config is not None:
            check_fp8_supported(device, f"quantization={quant_config.method!r}")
        kv_dtype = config.kv_cache_torch_dtype
        if kv_dtype != dtype:
            check_fp8_supported(device, f"kv_cache_dtype={cache_cfg.kv_cache_dtype!r}")
        self.model = build_model(self.hf_config, model_cfg.model, config.load_config.load_format, backend, dtype, device,
                                 max_positions=model_cfg.max_model_len, seed=model_cfg.seed, quant_config=quant_config,
                                 **self._moe_kwargs())
        torch.manual_seed(model_cfg.seed)
        self.vocab_size = self.hf_config.vocab_size
        num_kv_heads, head_dim = self.model.kv_cache_shape_per_block
        # Planes per layer cache: 2 (keys, values); 1 for models caching one compressed
        # latent per token (MLA: [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]).
        planes = getattr(self.model, "kv_cache_num_planes", 2)
        num_layers = len(self.model.layers)
        num_blocks = cache_cfg.num_kv_blocks or self._num_kv_blocks(num_layers, num_kv_heads, head_dim, kv_dtype,
                                                                    device, planes)
        # The TP ranks of one replica share the driver's block ids: agree on the smallest cache.
        num_blocks = ps.tp_min(num_blocks)
        self.num_kv_blocks = num_blocks
        kv_caches = allocate_kv_caches(num_layers, (planes, num_blocks, cache_cfg.block_size, num_kv_heads, head_dim),
                                       kv_dtype, device)
        capacity = (num_blocks - 1) * cache_cfg.block_size
        logger.info("model %s: %s, quantization %s, KV cache %s, %d tokens", model_cfg.model, dtype,
                    quant_config.method if quant_config is not None else "none", kv_dtype, capacity)
        if capacity < model_cfg.max_model_len:
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, model_cfg.max_model_len)
            model_cfg.max_model_len = capacity
        self.kv_manager = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.eos_token_ids = self._eos_token_ids()
        # Grammars of constrained requests: compiled here, advanced by the scheduler, and
        # turned into each step's bitmask before sampling.
        generation_eos = load_generation_defaults(model_cfg.model, model_cfg.generation_config).eos_token_ids
        self.structured_output = StructuredOutputManager(
            model_cfg.tokenizer or model_cfg.model, self.vocab_size, self.eos_token_ids | set(generation_eos),
            pin_memory=device.type == "cuda")
        self.scheduler = Scheduler(self.kv_manager, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens,
                                   model_cfg.max_model_len, sched_cfg.enable_chunked_prefill, self.structured_output)
        self.runner = ModelRunner(self.model, kv_caches, cache_cfg.block_size, self.vocab_size, sched_cfg.max_num_seqs,
                                  device, max_model_len=model_cfg.max_model_len, enforce_eager=model_cfg.enforce_eager,
                                  dbo=DBOPolicy(dbo_cfg.dbo_decode_token_threshold, dbo_cfg.dbo_prefill_token_threshold,
                                                dbo_cfg.dbo_measure_split)
                                  if dbo_cfg.enable_dbo else None)
        if ps.get_ep_size() > 1:
            # Expert parallelism: every DP rank's forward takes part in the EP collectives, so
            # the runner agrees on each step (and runs dummy batches) over the DP group.
            self.runner.dp_group = ps.get_dp_group()
        if dbo_cfg.enable_dbo and dbo_cfg.dbo_measure_split:
            # The largest step, as profiled for memory above.
            self.runner.measure_prefill_split(min(sched_cfg.max_num_batched_tokens, model_cfg.max_model_len))
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self.async_output_proc = sched_cfg.async_output_proc
        # Live sequences by request id (the front end's per-sequence id).
        self._seq_ids: dict[str, int] = {}
        # Outputs for requests the core dropped itself (a failed step), sent with the next step.
        self._pending: list[EngineCoreOutput] = []
        self.num_steps = 0
        # Tensor parallelism: the driver sends each step's SchedulerOutput to the other TP
        # ranks before running it (set by the launcher, tandem.engine.dp_engine).
        self.step_broadcast = None
        self._bitmask_owed = False
        # Host time per step (schedule, the runner's input preparation, update_from_output)
        # while a benchmark records it (start_host_timing).
        self.step_times: StepHostTimes | None = None
        freeze_startup_heap()
        self._heap_frozen = True

    def _moe_kwargs(self) -> dict:
        """The dispatch/combine backend of MoE layers (dense models take none)."""
        cfg = self.config
        if not getattr(self.hf_config, "num_experts", None) and not getattr(self.hf_config, "n_routed_experts", None) \
                and not getattr(self.hf_config, "num_local_experts", None):
            if cfg.dbo_config.enable_dbo:
                logger.warning("--enable-dbo has no effect on the dense model %s", self.hf_config.model_type)
            return {}
        ep = ps.get_ep_size()
        name = cfg.parallel_config.all2all_backend
        if name == "auto":
            name = "local" if ep == 1 else "allgather_reducescatter"
        if ep > 1 or name in ("allgather_reducescatter", "all_to_all"):
            from tandem.distributed.all2all_factory import make_all2all_factory

            return {"all2all": make_all2all_factory(name, group=ps.get_ep_group(), ep_size=ep, ep_rank=ps.get_ep_rank())}
        if name == "simulated":
            from tandem.distributed.all2all import LinkModel, SimulatedAll2All

            sim = cfg.simulated_link_config
            link = LinkModel(sim.simulated_link_gbps, sim.simulated_link_latency_us, sim.simulated_ep_size)
            if sim.simulated_ep_rank_experts:
                logger.warning("--simulated-ep-rank-experts: MoE layers compute one EP rank's share of the experts; "
                               "outputs are not the model's (timing only)")
            return {"all2all": lambda num_experts: SimulatedAll2All(num_experts, link=link, record=False,
                                                                    rank_experts=sim.simulated_ep_rank_experts)}
        from tandem.distributed.all2all_factory import get_all2all_backend

        return {"all2all": lambda num_experts: get_all2all_backend(name, num_experts)}

    def _eos_token_ids(self) -> set[int]:
        """The model config's EOS ids (the front end adds its tokenizer's and
        generation_config.json's)."""
        eos = getattr(self.hf_config, "eos_token_id", None)
        return set([eos] if isinstance(eos, int) else eos or [])

    def _num_kv_blocks(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       planes: int = 2) -> int:
        cache_cfg = self.config.cache_config
        bytes_per_block = planes * num_layers * cache_cfg.block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        if device.type == "cuda":
            activations = self._profile_activation_bytes(num_layers, kv_heads, head_dim, dtype, device, planes)
            free, total = torch.cuda.mem_get_info(device)
            non_torch = total - free - torch.cuda.memory_reserved(device)
            weights = torch.cuda.memory_allocated(device)
            budget = total * cache_cfg.gpu_memory_utilization - non_torch - weights - activations
            logger.info("GPU memory: %.1f GiB weights, %.1f GiB peak activations, %.1f GiB for the KV cache",
                        weights / 2**30, activations / 2**30, budget / 2**30)
        else:
            budget = cache_cfg.kv_cache_memory_gib * 1024**3
        n = int(budget // bytes_per_block)
        if n < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory limits")
        return n

    @torch.inference_mode()
    def _profile_activation_bytes(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                  device: torch.device, planes: int = 2) -> int:
        """Peak memory of the largest step: a prefill of ``max_num_batched_tokens`` tokens in
        sequences of at most ``max_model_len`` (as vLLM's profile run splits it), plus the
        sampler's working set for ``max_num_seqs`` rows of logits."""
        cfg = self.config
        t = cfg.scheduler_config.max_num_batched_tokens
        meta, nb = _profile_step_metadata(t, cfg.model_config.max_model_len, cfg.cache_config.block_size, device)
        caches = [torch.zeros(planes, nb, cfg.cache_config.block_size, kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        from tandem.distributed.forward_context import ForwardContext, forward_context

        # Every rank profiles the same t tokens: expert-parallel exchanges pair up.
        positions = torch.cat([torch.arange(n, device=device) for n in meta.seq_lens_cpu])
        with forward_context(ForwardContext(max_tokens_per_rank=t)):
            hidden = self.model(torch.zeros(t, dtype=torch.long, device=device), positions, caches, meta)
        rows = min(cfg.scheduler_config.max_num_seqs, t)
        logits = self.model.compute_logits(hidden[:rows])
        logits.sort(dim=-1)  # top-k/top-p sort, the sampler's largest temporary
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del caches, hidden, logits
        torch.cuda.empty_cache()
        # Softmax, noise and logprob copies of the logits beside the sort.
        return peak + 4 * rows * self.vocab_size * 4

    def ready_message(self) -> EngineCoreReady:
        """The startup handshake a front end validates requests against."""
        from dataclasses import asdict

        info = ps.get_parallel_info()
        return EngineCoreReady(
            engine_index=self.engine_index, max_model_len=self.config.model_config.max_model_len,
            max_num_batched_tokens=self.config.scheduler_config.max_num_batched_tokens, vocab_size=self.vocab_size,
            num_kv_blocks=self.num_kv_blocks, eos_token_ids=sorted(self.eos_token_ids),
            kv_cache_shape_per_block=tuple(self.model.kv_cache_shape_per_block), parallel=asdict(info),
            config=asdict(self.config))

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
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._pending)

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[EngineCoreOutput]:
        """Run one engine iteration; returns the outputs of the step processed by it.

        Raises:
            Exception: a model step failed (e.g. an exception in one DBO ubatch). The
                requests of the failed step and of the step in flight are aborted (their
                blocks freed, an "abort" output with ``error`` queued for the next call);
                the core stays usable for the others and for new ones.
        """
        outputs, self._pending = self._pending + self._fail_uncompiled(), []
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
                              num_usable_blocks=kv.num_usable_blocks)

    def debug_stats(self) -> dict[str, float]:
        """State read between two steps (tests, ``/debug/engine_stats``): the scheduler's
        gauges plus num_unfinished_seqs, num_seqs_with_blocks, num_steps, num_dbo_steps."""
        st = self.scheduler_stats()
        s = {f: getattr(st, f) for f in st.__struct_fields__}
        s.update(num_unfinished_seqs=len(self.scheduler.requests), num_seqs_with_blocks=len(self.kv_manager.req_blocks),
                 num_steps=self.num_steps, num_dbo_steps=getattr(self.runner, "num_dbo_steps", 0))
        return s


def _profile_step_metadata(num_tokens: int, max_model_len: int, block_size: int,
                           device: torch.device) -> tuple[AttentionMetadata, int]:
    """Metadata of a prefill of ``num_tokens`` fresh tokens in sequences of ``max_model_len``
    (the last one shorter), each in its own consecutive blocks after the null block 0;
    and the number of blocks the cache needs."""
    full, rest = divmod(num_tokens, max_model_len)
    lens = [max_model_len] * full + ([rest] if rest else [])
    per_seq = -(-max(lens) // block_size)
    i32 = dict(dtype=torch.int32, device=device)
    block_tables = torch.arange(1, 1 + len(lens) * per_seq, **i32).view(len(lens), per_seq)
    slots = (block_tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).view(len(lens), -1)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, **i32), seq_lens=torch.tensor(lens, **i32),
        num_computed_tokens=torch.zeros(len(lens), **i32), block_tables=block_tables,
        slot_mapping=torch.cat([slots[i, :n] for i, n in enumerate(lens)]), max_query_len=max(lens),
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens, num_decode_reqs=0,
    )
    return meta, 1 + len(lens) * per_seq


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
