"""What an engine core resolved (:class:`ResolvedConfig`): decided once by the core where the
device and the model are known, carried by its ready message, and read as it is by the
front end and the speed line of ``tandem generate``."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from tandem.config.resolved import ResolvedConfig
from tandem.engine.messages import CoreMessage, MsgpackDecoder, MsgpackEncoder
from tandem.model_loader.generation_config import GenerationDefaults


def _resolved(**kw) -> ResolvedConfig:
    fields = dict(dtype="bfloat16", quantization=None, all2all_backend=None, device="cpu", max_model_len=256,
                  max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=64,
                  generation_defaults=GenerationDefaults())
    return ResolvedConfig(**(fields | kw))


@pytest.mark.parametrize("kw, expected", [
    ({"quantization": "gguf"}, "gguf quantized + bfloat16"),
    ({"quantization": "gguf", "dtype": "float32"}, "gguf quantized + float32"),
    ({"quantization": "compressed-tensors"}, "compressed-tensors"),
    ({"quantization": "fp8"}, "fp8"),
    ({"dtype": "float32"}, "float32"),
])
def test_weights_mode_is_the_resolved_quantization_and_dtype(kw, expected):
    assert _resolved(**kw).weights_mode == expected


def test_it_is_frozen():
    with pytest.raises(AttributeError):
        _resolved().max_model_len = 1


@pytest.mark.parametrize("kw, quantization", [({}, "gguf"), ({"dtype": "float32"}, None),
                                              ({"quantization": "none", "dtype": "bfloat16"}, None)])
def test_the_ready_message_carries_what_the_core_resolved(embedded_model_path, kw, quantization):
    """The embedded GGUF on the CPU: quantized at dtype auto, dequantized at an explicit
    dtype or with quantization none; the CPU's batch limits; the limits and the cache as set;
    the same after the trip through msgpack (a spawned core's handshake)."""
    import torch

    from tandem.engine.arg_utils import EngineArgs
    from tandem.engine.core_client import InprocClient
    from tandem.platform import auto_dtype

    config = EngineArgs(model=embedded_model_path, device="cpu", num_kv_blocks=64, max_model_len=256,
                        **kw).create_engine_config()
    client = InprocClient(config)
    try:
        ready = client.ready
        dtype = kw.get("dtype") or str(auto_dtype(torch.device("cpu"), embedded_model_path)).removeprefix("torch.")
        assert ready.resolved == ResolvedConfig(
            dtype=dtype, quantization=quantization, all2all_backend=None, device="cpu", max_model_len=256,
            max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=64, generation_defaults=GenerationDefaults())
        assert client.core.scheduler.max_model_len == 256  # the scheduler runs with what was sent
        assert MsgpackDecoder(CoreMessage).decode(MsgpackEncoder().encode(ready)) == ready
    finally:
        client.shutdown()


def test_the_front_end_reads_the_ready_message_not_its_config(embedded_model_path):
    """Limits and generation defaults come from the core's message (here other than the
    model's files say); the config stays as it was given, unresolved."""
    from tandem.engine.arg_utils import EngineArgs
    from tandem.engine.llm_engine import LLMEngine

    config = EngineArgs(model=embedded_model_path, device="cpu").create_engine_config()
    defaults = GenerationDefaults(frozenset({7}), {"temperature": 0.25}, "/elsewhere/generation_config.json")
    resolved = _resolved(max_model_len=100, generation_defaults=defaults)
    ready = SimpleNamespace(resolved=resolved, vocab_size=49152, eos_token_ids=[2], parallel={},
                            kv_cache_shape_per_block=(3, 64))
    engine = LLMEngine(config, client=SimpleNamespace(ready=ready, readies=[ready]))
    assert engine.resolved is resolved and engine.config is config
    assert config.model_config.max_model_len is None and config.scheduler_config.max_num_seqs is None
    assert engine.get_default_sampling_params().temperature == 0.25
    assert 7 in engine.eos_token_ids and engine.processor.max_model_len == 100
    assert engine.num_kv_blocks == 64


def test_generation_defaults_cross_processes_as_data():
    defaults = GenerationDefaults(frozenset({1, 2}), {"temperature": 0.6, "max_tokens": 32}, "/m/generation_config.json")
    resolved = _resolved(generation_defaults=defaults)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(resolved), type=ResolvedConfig) == resolved
