"""One rank's world: its model, its KV cache and the model runner over them.

As vLLM's ``Worker`` (``load_model`` / ``determine_available_memory`` / ``initialize_cache``)
and nano-vllm's ``ModelRunner``: the engine core builds a :class:`Worker` and calls, in order,

1. :meth:`Worker.load_model`: the MoE dispatch/combine backend, the weights (and a
   speculative config's draft model);
2. :meth:`Worker.determine_num_kv_blocks`: the KV cache's size in blocks (profiled on CUDA);
   the ranks of a replica (its stages and TP ranks) then agree on the smallest (the core does, :func:`ps.replica_min`);
3. :meth:`Worker.initialize_kv_cache`: the cache tensors and the :class:`ModelRunner`.

The core keeps the scheduler, the KV block manager and the grammars; the worker knows
nothing of requests.

On the CPU all of a rank's torch work (loading, the cache, every step) runs on one thread,
the worker's ``step_thread``, which the model runner then runs its steps on
(:mod:`tandem.worker.model_runner`). libgomp gives each thread that runs a parallel region a
team of its own, and once it manages more threads than there are CPUs its workers sleep
after ~100 spins instead of ``GOMP_SPINCOUNT`` (:mod:`tandem.envs`): a model loaded on the
caller's thread and run on the step thread made every one of a decode step's thousands of
small parallel kernels wait for a worker's wake-up (benchmarks/RESULTS.md, "one OpenMP team").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from tandem import envs
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.selector import get_attention_backend
from tandem.config import EngineConfig
from tandem.distributed import parallel_state as ps
from tandem.distributed.pipeline import IntermediateTensors
from tandem.layers import fused_ops
from tandem.layers.quantization.config import GGUFQuantConfig, get_gguf_config, get_quantization_config
from tandem.layers.quantization.fp8 import check_fp8_supported
from tandem.model_loader.loader import build_model, load_hf_config
from tandem.models.llama import split_aux_hidden_states
from tandem.spec_decode.draft_model import DraftModelProposer, check_draft_model
from tandem.spec_decode.eagle import EagleProposer, load_eagle_head
from tandem.worker.kv_cache import allocate_kv_caches
from tandem.worker.model_runner import ModelRunner, cpu_step_thread
from tandem.worker.pipeline_stage import PipelineStage
from tandem.worker.step_plan import DBOPolicy

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Worker:
    """Loads one rank's model, sizes and allocates its KV cache and builds its runner.

    Args:
        config: engine configuration with its limits resolved
            (:meth:`EngineConfig.resolve_limits`); :meth:`initialize_kv_cache` may lower
            ``model_config.max_model_len`` to what the cache holds.
        hf_config: the model's HF config (:func:`tandem.model_loader.loader.load_hf_config`).

    Attributes:
        dtype: the weights' and activations' dtype (``dtype`` resolved for the device).
        quant_config: the linear weights' FP8 or GGUF scheme, or None (after :meth:`load_model`).
        all2all_backend: the MoE layers' backend, None for a dense model (likewise).
        model: the loaded model (likewise).
        draft_model: the speculative config's draft model or EAGLE head, or None (likewise).
        model_runner: the runner over the model and its cache (after :meth:`initialize_kv_cache`).
        num_kv_blocks: the cache's size in blocks, block 0 the null block (likewise).
    """

    def __init__(self, config: EngineConfig, hf_config) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = config.device_config.torch_device
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype
        self.vocab_size: int = hf_config.vocab_size
        self.quant_config = None
        self.all2all_backend: str | None = None
        self.model: torch.nn.Module | None = None
        self.draft_model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.num_kv_blocks: int | None = None
        self.step_thread = (ThreadPoolExecutor(1, thread_name_prefix="tandem-step")
                            if cpu_step_thread(self.device) else None)

    def _on_step_thread(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, run on the step thread when there is one (module docstring)."""
        return fn() if self.step_thread is None else self.step_thread.submit(fn).result()

    # ----------------------------------------------------------------- the model
    def load_model(self) -> torch.nn.Module:
        """Build the model on the device (weights loaded, MoE layers on their all-to-all
        backend), then seed torch's global generator with ``model_config.seed``.

        Raises:
            ValueError: the model, its quantization or the KV cache dtype is not supported
                here (e.g. FP8 on a GPU without FP8).
        """
        return self._on_step_thread(self._load_model)

    def _load_model(self) -> torch.nn.Module:
        cfg, model_cfg = self.config, self.config.model_config
        logger.info("Deterministic (batch-invariant) execution: %s", "on" if model_cfg.deterministic else "off")
        # The fused-ops mode, decided once for this device: every model built below (the
        # target, a draft model, an EAGLE head) keeps it in its layers, and the attention
        # backend its C++ decode kernel.
        fused_mode = fused_ops.resolve_mode(envs.TANDEM_FUSED_OPS, self.device)
        logger.info("Fused ops: %s", fused_mode)
        # The one place the deterministic mode is handed over: the backend holds it, and every
        # model built over the backend (build_model, the EAGLE head below) takes it from there.
        backend = get_attention_backend(self.device, model_cfg.max_model_len, deterministic=model_cfg.deterministic,
                                        cpu_kernels=fused_mode == "cpu")
        load_format = cfg.load_config.load_format
        self.quant_config = get_quantization_config(self.hf_config, model_cfg.quantization, load_format,
                                                    model_cfg.deterministic)
        if self.quant_config is not None:
            check_fp8_supported(self.device, f"quantization={self.quant_config.method!r}")
        else:
            self.quant_config = self._gguf_scheme()
        if self.kv_dtype != self.dtype:
            check_fp8_supported(self.device, f"kv_cache_dtype={cfg.cache_config.kv_cache_dtype!r}")
        self.all2all_backend = self._resolve_all2all_backend()
        self.model = build_model(self.hf_config, model_cfg.model, cfg.load_config.load_format, backend, self.dtype,
                                 self.device, max_positions=model_cfg.max_model_len, seed=model_cfg.seed,
                                 quant_config=self.quant_config, fused_ops_mode=fused_mode, **self._moe_kwargs())
        spec = cfg.speculative_config
        if spec is not None:
            limit = spec.disable_by_batch_size
            logger.info("speculative decoding: %s, %d drafts per step, %s (disable_by_batch_size)", spec.method,
                        spec.num_speculative_tokens, "at any batch size" if limit is None else
                        f"while at most {limit} request{'s are' if limit > 1 else ' is'} running")
        if spec is not None and spec.method == "draft_model":
            self.draft_model = self._load_draft_model(spec.model, backend, fused_mode)
        elif spec is not None and spec.uses_model:
            with fused_ops.building(fused_mode):  # load_eagle_head builds in the caller's fused-ops mode
                self.draft_model = load_eagle_head(spec.method, spec.model, self.model, backend, self.dtype,
                                                   self.device, model_cfg.max_model_len, cfg.load_config.load_format,
                                                   model_cfg.seed)
        torch.manual_seed(model_cfg.seed)
        return self.model

    def _load_draft_model(self, path: str, backend, fused_ops_mode: str) -> torch.nn.Module:
        """The draft model at ``path``, in the target's dtype, load format and fused-ops mode;
        a GGUF file runs quantized as a GGUF target does by default (dequantized with
        ``quantization="none"``).

        Raises:
            ValueError: its vocabulary or context is not the target's (:func:`check_draft_model`),
                or ``path`` is not a model (naming ``speculative_config.model``).
        """
        model_cfg = self.config.model_config
        try:
            draft_hf = load_hf_config(path)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        load_format = self.config.load_config.load_format
        # Random weights (tests) have no tokenizer of their own to compare.
        check_draft_model(self.hf_config, draft_hf, model_cfg.tokenizer or model_cfg.model, path,
                          model_cfg.max_model_len, compare_tokenizers=load_format != "dummy")
        # "none" dequantizes a GGUF draft too; otherwise a GGUF draft runs as a GGUF target would by default.
        quant_config = get_gguf_config(path, "none" if model_cfg.quantization == "none" else None, self.device.type, load_format, model_cfg.dtype,
                                       model_cfg.deterministic)
        return build_model(draft_hf, path, load_format, backend, self.dtype, self.device,
                           max_positions=model_cfg.max_model_len, seed=model_cfg.seed, quant_config=quant_config,
                           fused_ops_mode=fused_ops_mode)

    def _gguf_scheme(self) -> GGUFQuantConfig | None:
        """The GGUF scheme of this run (:func:`get_gguf_config`). A GGUF that would run
        quantized on one rank but is split over several runs dequantized: the first rank
        says so, since a user who asked for nothing else would not know why it is slower."""
        cfg, model_cfg = self.config, self.config.model_config
        args = (model_cfg.model, model_cfg.quantization, self.device.type, cfg.load_config.load_format,
                model_cfg.dtype, model_cfg.deterministic)
        scheme = get_gguf_config(*args, one_rank=cfg.parallel_config.model_on_one_rank)
        if scheme is None and get_gguf_config(*args, one_rank=True) is not None and ps.get_parallel_info().rank == 0:
            logger.warning("the GGUF weights run dequantized to %s: their int4 layers are not split over ranks "
                           "(tensor/pipeline/expert parallelism); on one rank they run quantized, faster on the CPU",
                           str(self.dtype).removeprefix("torch."))
        return scheme

    def _resolve_all2all_backend(self) -> str | None:
        """The MoE layers' dispatch/combine backend (``auto``: ``local`` on one EP rank, else
        ``allgather_reducescatter``); None for a dense model."""
        cfg, hf = self.config, self.hf_config
        if not getattr(hf, "num_experts", None) and not getattr(hf, "n_routed_experts", None) \
                and not getattr(hf, "num_local_experts", None):
            if cfg.dbo_config.enable_dbo:
                logger.warning("--enable-dbo has no effect on the dense model %s", hf.model_type)
            return None
        name = cfg.parallel_config.all2all_backend
        if name == "auto":
            name = "local" if ps.get_ep_size() == 1 else "allgather_reducescatter"
        return name

    def _moe_kwargs(self) -> dict:
        """The MoE layers' backend (:attr:`all2all_backend`) as ``build_model`` takes it
        (dense models take none)."""
        cfg, name = self.config, self.all2all_backend
        if name is None:
            return {}
        ep = ps.get_ep_size()
        if ep > 1 or name in ("allgather_reducescatter", "all_to_all"):
            from tandem.distributed.all2all_factory import make_all2all_factory

            factory = make_all2all_factory(name, group=ps.get_ep_group(), ep_size=ep, ep_rank=ps.get_ep_rank())
            return {"all2all": factory}
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

    # ----------------------------------------------------------------- the KV cache
    @property
    def _cache_geometry(self) -> tuple[int, int, int, int]:
        """(layers, planes, KV heads, head dim) of this rank's cache. Planes per layer: 2
        (keys, values); 1 for models caching one compressed latent per token (MLA:
        ``[1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]``)."""
        return _cache_geometry(self._loaded_model())

    def _bytes_per_block(self) -> int:
        """Bytes of one KV block over every layer, the draft model's cache included."""
        models = [self._loaded_model()] + ([self.draft_model] if self.draft_model is not None else [])
        bits = torch.finfo(self.kv_dtype).bits
        return sum(int(np.prod(_cache_geometry(m))) * self.config.cache_config.block_size * bits // 8 for m in models)

    def determine_num_kv_blocks(self) -> int:
        """This rank's KV cache size in blocks: ``cache_config.num_kv_blocks`` if set; else
        what fits in ``kv_cache_memory_gib`` on the CPU, or on CUDA in
        ``gpu_memory_utilization`` of the device after the weights and the peak activations
        of the largest step (profiled by running it: every rank whose forwards exchange data
        must call this at the same point).

        Raises:
            ValueError: fewer than 2 blocks fit.
        """
        cache_cfg = self.config.cache_config
        if cache_cfg.num_kv_blocks:
            return cache_cfg.num_kv_blocks
        bytes_per_block = self._bytes_per_block()
        if self.device.type == "cuda":
            start = time.perf_counter()
            activations = self.profile_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            non_torch = total - free - torch.cuda.memory_reserved(self.device)
            weights = torch.cuda.memory_allocated(self.device)
            budget = total * cache_cfg.gpu_memory_utilization - non_torch - weights - activations
            logger.info("GPU memory: %.1f GiB weights, %.1f GiB peak activations, %.1f GiB for the KV cache "
                        "(memory profiling took %.2f s)", weights / 2**30, activations / 2**30, budget / 2**30,
                        time.perf_counter() - start)
        else:
            budget = cache_cfg.kv_cache_memory_gib * 1024**3
        n = int(budget // bytes_per_block)
        if n < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or raise the memory limits")
        return n

    @torch.inference_mode()
    def profile_activation_bytes(self) -> int:
        """Peak CUDA memory in bytes of the largest step: a prefill of
        ``max_num_batched_tokens`` tokens in sequences of at most ``max_model_len`` (as
        vLLM's profile run splits it), plus the sampler's working set for ``max_num_seqs``
        rows of logits. The step's own KV cache is freed before returning."""
        cfg, device, model = self.config, self.device, self._loaded_model()
        num_layers, planes, kv_heads, head_dim = self._cache_geometry
        t = cfg.scheduler_config.max_num_batched_tokens
        meta, nb = profile_step_metadata(t, cfg.model_config.max_model_len, cfg.cache_config.block_size, device)
        caches = [torch.zeros(planes, nb, cfg.cache_config.block_size, kv_heads, head_dim, dtype=self.kv_dtype,
                              device=device) for _ in range(num_layers)]
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        from tandem.distributed.forward_context import ForwardContext, forward_context

        # Every rank profiles the same t tokens: expert-parallel exchanges pair up.
        positions = torch.cat([torch.arange(n, device=device) for n in meta.seq_lens_cpu])
        # A pipeline stage profiles alone: a stand-in for the previous stage's tensors.
        info = ps.get_parallel_info()
        stage_in = {} if info.is_first_stage else {"intermediate": IntermediateTensors(
            *torch.zeros(2, t, self.hf_config.hidden_size, dtype=self.dtype, device=device))}
        with forward_context(ForwardContext(max_tokens_per_rank=t)):
            out = model(torch.zeros(t, dtype=torch.long, device=device), positions, caches, meta, **stage_in)
        if not info.is_last_stage:  # no logits here
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            del caches, out, stage_in
            torch.cuda.empty_cache()
            return peak
        rows = min(cfg.scheduler_config.max_num_seqs, t)
        hidden, _ = split_aux_hidden_states(model, out)
        logits = model.compute_logits(hidden[:rows])
        logits.sort(dim=-1)  # top-k/top-p sort, the sampler's largest temporary
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del caches, out, hidden, logits, stage_in
        torch.cuda.empty_cache()
        # Softmax, noise and logprob copies of the logits beside the sort.
        return peak + 4 * rows * self.vocab_size * 4

    def initialize_kv_cache(self, num_blocks: int) -> ModelRunner:
        """Allocate a cache of ``num_blocks`` blocks (the same number on every TP rank of
        the replica) and build the model runner over it. A cache holding fewer tokens than
        ``max_model_len`` lowers ``config.model_config.max_model_len`` to its capacity
        (logged). With expert parallelism the runner agrees on each step over the DP group;
        with DBO's ``dbo_measure_split`` it times the largest prefill step plain and split
        (every rank at this point).

        Raises:
            RuntimeError: :meth:`load_model` was not called.
        """
        return self._on_step_thread(lambda: self._initialize_kv_cache(num_blocks))

    def _initialize_kv_cache(self, num_blocks: int) -> ModelRunner:
        model_cfg, cache_cfg = self.config.model_config, self.config.cache_config
        num_layers, planes, kv_heads, head_dim = self._cache_geometry
        kv_caches = allocate_kv_caches(num_layers, (planes, num_blocks, cache_cfg.block_size, kv_heads, head_dim),
                                       self.kv_dtype, self.device)
        self.num_kv_blocks = num_blocks
        capacity = (num_blocks - 1) * cache_cfg.block_size
        if capacity < model_cfg.max_model_len:
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, model_cfg.max_model_len)
            model_cfg.max_model_len = capacity
        drafter = self._build_drafter(num_blocks)
        logger.info("model %s: %s, quantization %s; KV cache: %d blocks of %d tokens (%d usable tokens: one "
                    "null block), %.2f GiB%s, %s",
                    model_cfg.model, self.dtype, self.quant_config.method if self.quant_config is not None else "none",
                    num_blocks, cache_cfg.block_size, capacity,
                    sum(c.nbytes for c in kv_caches + (drafter.kv_caches if drafter else [])) / 2**30,
                    " (the draft model's or EAGLE head's included)" if drafter else "", self.kv_dtype)
        self.model_runner = self._build_model_runner(kv_caches, drafter)
        return self.model_runner

    def _build_drafter(self, num_blocks: int) -> DraftModelProposer | None:
        """The draft model's (or EAGLE head's) proposer over its own cache of ``num_blocks``
        blocks (the target's block ids address both), or None without one."""
        if self.draft_model is None:
            return None
        cache_cfg = self.config.cache_config
        num_layers, planes, kv_heads, head_dim = _cache_geometry(self.draft_model)
        caches = allocate_kv_caches(num_layers, (planes, num_blocks, cache_cfg.block_size, kv_heads, head_dim),
                                    self.kv_dtype, self.device)
        spec = self.config.speculative_config
        cls = DraftModelProposer if spec.method == "draft_model" else EagleProposer
        return cls(self.draft_model, caches, spec.num_speculative_tokens, cache_cfg.block_size,
                   self.config.model_config.max_model_len, self.device)

    def _build_model_runner(self, kv_caches: list[torch.Tensor], drafter: DraftModelProposer | None) -> ModelRunner:
        cfg, model_cfg, sched_cfg, dbo_cfg = (self.config, self.config.model_config, self.config.scheduler_config,
                                              self.config.dbo_config)
        dbo = (DBOPolicy(dbo_cfg.dbo_decode_token_threshold, dbo_cfg.dbo_prefill_token_threshold,
                         dbo_cfg.dbo_measure_split) if dbo_cfg.enable_dbo else None)
        runner = ModelRunner(self.model, kv_caches, cfg.cache_config.block_size, self.vocab_size,
                             sched_cfg.max_num_seqs, self.device, max_model_len=model_cfg.max_model_len,
                             enforce_eager=model_cfg.enforce_eager, dbo=dbo, drafter=drafter,
                             step_thread=self.step_thread, speculative_config=cfg.speculative_config,
                             stage=PipelineStage(self.hf_config.hidden_size, self.dtype, self.device)
                             if ps.get_pp_size() > 1 else None)
        if ps.get_ep_size() > 1:
            # Expert parallelism: every DP rank's forward takes part in the EP collectives, so
            # the runner agrees on each step (and runs dummy batches) over the DP group.
            runner.dp_group = ps.get_dp_group()
        if dbo_cfg.enable_dbo and dbo_cfg.dbo_measure_split:
            # The largest step, as profiled for memory in determine_num_kv_blocks.
            runner.measure_prefill_split(min(sched_cfg.max_num_batched_tokens, model_cfg.max_model_len))
        return runner

    def _loaded_model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("Worker.load_model() must run before the KV cache is sized or allocated")
        return self.model


def _cache_geometry(model: torch.nn.Module) -> tuple[int, int, int, int]:
    num_kv_heads, head_dim = model.kv_cache_shape_per_block
    # A pipeline stage caches its own layers only.
    layers = getattr(model, "num_stage_layers", len(model.layers))
    return layers, getattr(model, "kv_cache_num_planes", 2), num_kv_heads, head_dim


def profile_step_metadata(num_tokens: int, max_model_len: int, block_size: int,
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


__all__ = ["Worker", "profile_step_metadata"]
