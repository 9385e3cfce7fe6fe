"""The config groups reject bad values with a ValueError naming the field, when the config
is made (every entry point makes one before loading); ``EngineConfig`` checks the rules
that span groups."""

from __future__ import annotations

import pytest

from tandem.config import (CacheConfig, DBOConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                           SimulatedLinkConfig)
from tandem.engine.arg_utils import EngineArgs


def make(**kw) -> EngineConfig:
    return EngineArgs(model="m", **kw).create_engine_config()


def test_simulated_ep_fields_are_checked():
    with pytest.raises(ValueError, match="simulated_ep_rank_experts"):
        make(simulated_ep_rank_experts=True)
    with pytest.raises(ValueError, match="simulated_ep_size"):
        make(all2all_backend="simulated", simulated_ep_size=0)
    cfg = make(all2all_backend="simulated", simulated_ep_rank_experts=True)
    assert cfg.simulated_link_config.simulated_ep_rank_experts
    assert cfg.dbo_config.dbo_measure_split  # split decode graphs only where measured faster, by default


@pytest.mark.parametrize("kw, field", [
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=24), "block_size"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(kv_cache_memory_gib=0), "kv_cache_memory_gib"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(master_port=70000), "master_port"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(dbo_decode_token_threshold=1), "dbo_decode_token_threshold"),
    (dict(simulated_link_gbps=0), "simulated_link_gbps"),
    (dict(device="tpu"), "device"),
    (dict(device="cuda:99"), "cuda"),
    (dict(generation_config="/nonexistent"), "generation_config"),
    (dict(load_format="pt"), "load_format"),
    (dict(dtype="int8"), "dtype"),
    (dict(all2all_backend="nccl"), "all2all_backend"),
])
def test_values_are_checked_when_the_config_is_made(kw, field):
    """Every entry point (LLM, the CLI, the server) builds an EngineConfig before loading."""
    with pytest.raises(ValueError, match=field):
        make(**kw)


@pytest.mark.parametrize("group, kw, field", [
    (ModelConfig, dict(model="m", max_model_len=0), "max_model_len"),
    (CacheConfig, dict(block_size=0), "block_size"),
    (SchedulerConfig, dict(max_num_seqs=0), "max_num_seqs"),
    (ParallelConfig, dict(all2all_backend="nccl"), "all2all_backend"),
    (DBOConfig, dict(dbo_prefill_token_threshold=0), "dbo_prefill_token_threshold"),
    (SimulatedLinkConfig, dict(simulated_ep_size=0), "simulated_ep_size"),
])
def test_each_group_checks_its_own_fields(group, kw, field):
    with pytest.raises(ValueError, match=field):
        group(**kw)


def test_device_cuda_without_cuda_says_what_to_do(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cpu"):
        make(device="cuda")


def test_fp8_fields_are_checked():
    import torch

    with pytest.raises(ValueError, match="quantization must be one of"):
        make(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make(kv_cache_dtype="fp16")
    assert make(device="cpu").kv_cache_torch_dtype == torch.float32
    assert make(device="cpu", kv_cache_dtype="fp8").kv_cache_torch_dtype == torch.float8_e4m3fn


def test_dtype_names_resolve():
    import torch

    assert make(device="cpu").torch_dtype == torch.float32  # auto on the CPU
    assert make(device="cpu", dtype="bf16").torch_dtype == torch.bfloat16
    assert make(device="cpu", dtype="half").torch_dtype == torch.float16


def test_model_none_is_the_embedded_default():
    from tandem.config import embedded_default_model

    assert EngineConfig().model_config.model == embedded_default_model()


def test_limits_resolve_across_groups():
    cfg = make(enable_chunked_prefill=False)
    cfg.resolve_limits(4096)
    assert cfg.model_config.max_model_len == 4096 and cfg.scheduler_config.max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(enable_chunked_prefill=False, max_num_batched_tokens=1024).resolve_limits(4096)
    cfg = make(max_model_len=512)
    cfg.resolve_limits(4096)
    assert cfg.model_config.max_model_len == 512 and cfg.scheduler_config.max_num_batched_tokens == 2048
    assert cfg.scheduler_config.max_num_seqs == 256  # the CPU's default (tandem.platform)


@pytest.mark.parametrize("usage, tokens", [("llm_class", 16384), ("openai_api_server", 8192)])
def test_unset_limits_take_the_device_defaults_and_set_ones_stay(monkeypatch, usage, tokens):
    from tandem import platform

    monkeypatch.setattr(platform, "default_batch_limits",
                        lambda device, usage_context: (1024, {"llm_class": 16384, "openai_api_server": 8192}[usage_context]))
    cfg = EngineArgs(model="m").create_engine_config(usage)
    assert cfg.scheduler_config.usage_context == usage
    cfg.resolve_limits(4096)
    assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (1024, tokens)
    cfg = EngineArgs(model="m", max_num_seqs=8, max_num_batched_tokens=512).create_engine_config(usage)
    cfg.resolve_limits(4096)
    assert (cfg.scheduler_config.max_num_seqs, cfg.scheduler_config.max_num_batched_tokens) == (8, 512)

