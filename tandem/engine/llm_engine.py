"""The engine: schedule -> execute -> process outputs, optionally one step ahead.

With ``async_output_proc`` (after vLLM PR #7049 and vLLM V1 async scheduling), step N+1
is scheduled and launched before step N's outputs are processed, so the output
processing of step N overlaps the model's execution of step N+1. See docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tandem.config import EngineConfig
from tandem.core.block_manager import KVCacheManager
from tandem.core.sched_output import SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.distributed import parallel_state as ps
from tandem.engine.output_processor import OutputProcessor
from tandem.model_loader.generation_config import load_generation_defaults
from tandem.model_loader.loader import build_model, load_hf_config, load_tokenizer
from tandem.outputs import RequestOutput
from tandem.request import Request
from tandem.sampling_params import SamplingParams, child_seed
from tandem.step_timing import StepHostTimes
from tandem.attention.selector import get_attention_backend
from tandem.layers.quantization.config import get_quantization_config
from tandem.layers.quantization.fp8 import check_fp8_supported
from tandem.worker.model_runner import ModelRunner
from tandem.worker.step_plan import DBOPolicy

logger = logging.getLogger(__name__)

# Most top logprobs per position a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class LLMEngine:
    """Owns the model runner, the scheduler and the output processor.

    Args:
        config: engine configuration.

    Raises:
        ValueError: the model cannot be loaded or the limits are inconsistent.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.world_size != ps.get_world_size():
            raise ValueError(f"tensor_parallel_size x data_parallel_size = {config.world_size} ranks, but this process "
                             f"is not one of them: build the engine through tandem.entrypoints.llm.LLM or "
                             f"tandem.engine.dp_engine (they launch the ranks)")
        device, dtype = config.torch_device, config.torch_dtype
        self.hf_config = load_hf_config(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.generation_defaults = load_generation_defaults(config.model, config.generation_config)
        model_max = getattr(self.hf_config, "max_position_embeddings", 2048)
        config.resolve_limits(model_max)
        if config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context length ({model_max}).")
        backend = get_attention_backend(device, config.max_model_len)
        quant_config = get_quantization_config(self.hf_config, config.quantization, config.load_format)
        if quant_config is not None:
            check_fp8_supported(device, f"quantization={quant_config.method!r}")
        kv_dtype = config.kv_cache_torch_dtype
        if kv_dtype != dtype:
            check_fp8_supported(device, f"kv_cache_dtype={config.kv_cache_dtype!r}")
        self.model = build_model(self.hf_config, config.model, config.load_format, backend, dtype, device,
                                 max_positions=config.max_model_len, seed=config.seed, quant_config=quant_config,
                                 **self._moe_kwargs())
        torch.manual_seed(config.seed)
        self.vocab_size = self.hf_config.vocab_size
        num_kv_heads, head_dim = self.model.kv_cache_shape_per_block
        # Planes per layer cache: 2 (keys, values); 1 for models caching one compressed
        # latent per token (MLA: [1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]).
        planes = getattr(self.model, "kv_cache_num_planes", 2)
        num_layers = len(self.model.layers)
        num_blocks = config.num_kv_blocks or self._num_kv_blocks(num_layers, num_kv_heads, head_dim, kv_dtype, device,
                                                                 planes)
        # The TP ranks of one replica share the driver's block ids: agree on the smallest cache.
        num_blocks = ps.tp_min(num_blocks)
        self.num_kv_blocks = num_blocks
        kv_caches = [torch.zeros(planes, num_blocks, config.block_size, num_kv_heads, head_dim, dtype=kv_dtype,
                                 device=device) for _ in range(num_layers)]
        capacity = (num_blocks - 1) * config.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, config.max_model_len)
            config.max_model_len = capacity
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, kv_caches, config.block_size, self.vocab_size, config.max_num_seqs, device,
                                  max_model_len=config.max_model_len, enforce_eager=config.enforce_eager,
                                  dbo=DBOPolicy(config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold,
                                                config.dbo_measure_split)
                                  if config.enable_dbo else None)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, config.max_model_len)
        if ps.get_ep_size() > 1:
            # Expert parallelism: every DP rank's forward takes part in the EP collectives, so
            # the runner agrees on each step (and runs dummy batches) over the DP group.
            self.runner.dp_group = ps.get_dp_group()
        if config.enable_dbo and config.dbo_measure_split:
            # The largest step, as profiled for memory above.
            self.runner.measure_prefill_split(min(config.max_num_batched_tokens, config.max_model_len))
        self.eos_token_ids = self._eos_token_ids()
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self.async_output_proc = config.async_output_proc
        # Tensor parallelism: the driver sends each step's SchedulerOutput to the other TP
        # ranks before running it (set by tandem.engine.dp_engine).
        self.step_broadcast = None
        self.step_times: StepHostTimes | None = None

    def _moe_kwargs(self) -> dict:
        """The dispatch/combine backend of MoE layers (dense models take none)."""
        cfg = self.config
        if not getattr(self.hf_config, "num_experts", None) and not getattr(self.hf_config, "n_routed_experts", None) \
                and not getattr(self.hf_config, "num_local_experts", None):
            if cfg.enable_dbo:
                logger.warning("--enable-dbo has no effect on the dense model %s", self.hf_config.model_type)
            return {}
        ep = ps.get_ep_size()
        name = cfg.all2all_backend
        if name == "auto":
            name = "local" if ep == 1 else "allgather_reducescatter"
        if ep > 1 or name in ("allgather_reducescatter", "all_to_all"):
            from tandem.distributed.all2all_factory import make_all2all_factory

            return {"all2all": make_all2all_factory(name, group=ps.get_ep_group(), ep_size=ep, ep_rank=ps.get_ep_rank())}
        if name == "simulated":
            from tandem.distributed.all2all import LinkModel, SimulatedAll2All

            link = LinkModel(cfg.simulated_link_gbps, cfg.simulated_link_latency_us, cfg.simulated_ep_size)
            if cfg.simulated_ep_rank_experts:
                logger.warning("--simulated-ep-rank-experts: MoE layers compute one EP rank's share of the experts; "
                               "outputs are not the model's (timing only)")
            return {"all2all": lambda num_experts: SimulatedAll2All(num_experts, link=link, record=False,
                                                                    rank_experts=cfg.simulated_ep_rank_experts)}
        from tandem.distributed.all2all_factory import get_all2all_backend

        return {"all2all": lambda num_experts: get_all2all_backend(name, num_experts)}

    def _eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS token, the config's and generation_config.json's EOS ids
        (transformers' ``generate`` stops on any of the generation config's)."""
        ids = set(self.generation_defaults.eos_token_ids)
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling values a request gets for the fields it leaves unset (vLLM's
        ``LLM.get_default_sampling_params``): the model's generation_config.json, else
        vLLM's defaults."""
        return SamplingParams().with_defaults(self.generation_defaults.sampling)

    def _num_kv_blocks(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       planes: int = 2) -> int:
        bytes_per_block = planes * num_layers * self.config.block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        if device.type == "cuda":
            activations = self._profile_activation_bytes(num_layers, kv_heads, head_dim, dtype, device, planes)
            free, total = torch.cuda.mem_get_info(device)
            non_torch = total - free - torch.cuda.memory_reserved(device)
            weights = torch.cuda.memory_allocated(device)
            budget = total * self.config.gpu_memory_utilization - non_torch - weights - activations
            logger.info("GPU memory: %.1f GiB weights, %.1f GiB peak activations, %.1f GiB for the KV cache",
                        weights / 2**30, activations / 2**30, budget / 2**30)
        else:
            budget = self.config.kv_cache_memory_gib * 1024**3
        n = int(budget // bytes_per_block)
        if n < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory limits")
        return n

    @torch.inference_mode()
    def _profile_activation_bytes(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                  device: torch.device, planes: int = 2) -> int:
        """Peak memory of the largest step: a prefill of ``max_num_batched_tokens`` tokens,
        plus the sampler's working set for ``max_num_seqs`` rows of logits."""
        from tandem.attention.metadata import AttentionMetadata

        cfg = self.config
        t = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        bs = cfg.block_size
        nb = -(-t // bs) + 1
        caches = [torch.zeros(planes, nb, bs, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        i32 = dict(dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], **i32), seq_lens=torch.tensor([t], **i32),
            num_computed_tokens=torch.tensor([0], **i32), block_tables=torch.arange(1, nb, **i32)[None],
            slot_mapping=torch.arange(bs, bs + t, device=device), max_query_len=t, max_seq_len=t,
            query_start_loc_cpu=[0, t], seq_lens_cpu=[t], num_decode_reqs=0,
        )
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        from tandem.distributed.forward_context import ForwardContext, forward_context

        # Every rank profiles the same t tokens: expert-parallel exchanges pair up.
        with forward_context(ForwardContext(max_tokens_per_rank=t)):
            hidden = self.model(torch.zeros(t, dtype=torch.long, device=device), torch.arange(t, device=device), caches,
                                meta)
        rows = min(cfg.max_num_seqs, t)
        logits = self.model.compute_logits(hidden[:rows])
        logits.sort(dim=-1)  # top-k/top-p sort, the sampler's largest temporary
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del caches, hidden, logits
        torch.cuda.empty_cache()
        # Softmax, noise and logprob copies of the logits beside the sort.
        return peak + 4 * rows * self.vocab_size * 4

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (text prompt or token ids).

        Raises:
            ValueError: empty prompt, prompt + max_tokens over the context, token ids
                outside the vocabulary, request_id already live, bad sampling values.
        """
        defaults = self.generation_defaults.sampling
        params = (params or SamplingParams()).with_defaults(defaults)
        params.verify_vocab(self.vocab_size)
        params.update_from_tokenizer(self.tokenizer)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}.")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        # Text too: a tokenizer larger than the model's vocabulary (e.g. --tokenizer beside a
        # dummy config) must not crash the engine.
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
        if not ids:
            raise ValueError("prompt must contain at least one token.")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                             f"{len(ids)} tokens, which leaves no room for completion tokens.")
        if params.max_tokens is None:  # up to the context, or the model's max_new_tokens
            max_tokens = min(max_len - len(ids), defaults.get("max_tokens", max_len))
        elif len(ids) + params.max_tokens > max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                             f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
                             f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion.")
        else:
            max_tokens = params.max_tokens
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        if not params.ignore_eos:
            params.all_stop_token_ids = set(self.eos_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        reqs = []
        for i in range(params.n):
            child = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else child_seed(params.seed, i))
            reqs.append(Request(request_id, ids, child, arrival, index=i, max_tokens=max_tokens))
        self.output_processor.add_request(request_id, text, reqs)
        for r in reqs:
            self.scheduler.add_request(r)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests: their blocks are freed now, nothing more is emitted for them."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the outputs produced by it.

        Raises:
            Exception: a model step failed (e.g. an exception in one DBO ubatch). The
                requests of the failed step and of the step in flight are aborted (their
                blocks freed); the engine stays usable for the others and for new ones.
        """
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        if self.step_times is not None:
            self.step_times.add(so.step_id, "schedule", time.perf_counter() - t0)
        if self.step_broadcast is not None:
            self.step_broadcast(so)
        prev, self._inflight = self._inflight, None
        failed = [so] + ([prev[0]] if prev is not None else [])
        handle = None
        try:
            handle = self.runner.execute_model(so)
            if not self.async_output_proc:
                return self._process(so, handle.result())
            # Step N's outputs are processed while step N+1 (just launched) runs.
            outputs = self._process(prev[0], prev[1].result()) if prev is not None else []
            if so.is_empty:
                # Nothing to process later, but an idle DP rank's dummy batch can fail: wait.
                handle.result()
            else:
                self._inflight = (so, handle)
            return outputs
        except Exception:
            self._abort_steps(failed, [h for h in (handle, prev[1] if prev is not None else None) if h is not None])
            raise

    def _process(self, so: SchedulerOutput, result) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self.output_processor.process(result)
        if self.step_times is not None and result.seq_ids:
            self.step_times.add(so.step_id, "process", time.perf_counter() - t0)
        return outputs

    def start_host_timing(self) -> StepHostTimes:
        """Record the host time of every step from now on (:mod:`tandem.step_timing`)."""
        self.step_times = self.runner.step_times = StepHostTimes()
        return self.step_times

    def stop_host_timing(self) -> StepHostTimes | None:
        times, self.step_times, self.runner.step_times = self.step_times, None, None
        return times

    def _abort_steps(self, steps: list[SchedulerOutput], handles: list) -> None:
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
                entry = self.output_processor.seqs.get(seq.seq_id)
                if entry is not None:
                    logger.error("aborting request %s: its model step failed", entry[0].request_id)
                    self.output_processor.abort(entry[0].request_id)
        self.kv_manager.pool.evict_idle_cached_blocks()

    def shutdown(self) -> None:
        self.runner.shutdown()

    def stats(self) -> dict[str, float]:
        s = self.scheduler.stats()
        kv = self.kv_manager
        s["prefix_cache_queries"] = kv.prefix_queries
        s["prefix_cache_hits"] = kv.prefix_hits
        s.update(self.output_processor.stats)
        return s
