"""``dtype="auto"``: which model dtype each device and checkpoint get, and the CPU bf16
default checked against transformers in bf16; the batch limits each device gets."""

from __future__ import annotations

import json

import pytest
import torch

from tandem import platform
from tandem.engine.arg_utils import EngineArgs

CPU = torch.device("cpu")


def _folder(tmp_path, dtype: str | None) -> str:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 128, "vocab_size": 256}
    if dtype is not None:
        cfg["torch_dtype"] = dtype
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("declared, half", [("bfloat16", True), ("float16", True), ("float32", False), (None, False)])
def test_cpu_auto_dtype_follows_checkpoint_and_cpu(tmp_path, monkeypatch, native, declared, half):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: native)
    want = torch.bfloat16 if native and half else torch.float32
    assert platform.auto_dtype(CPU, _folder(tmp_path, declared)) == want


@pytest.mark.parametrize("native", [True, False])
def test_gguf_on_cpu_is_bf16_only_with_native_bf16(embedded_model_path, monkeypatch, native):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: native)
    cfg = EngineArgs(model=embedded_model_path, device="cpu").create_engine_config()
    assert cfg.torch_dtype == (torch.bfloat16 if native else torch.float32)
    cfg = EngineArgs(model=embedded_model_path, device="cpu", dtype="float32").create_engine_config()
    assert cfg.torch_dtype == torch.float32


def test_cuda_auto_is_bf16(tmp_path):
    assert platform.auto_dtype(torch.device("cuda"), _folder(tmp_path, "float32")) == torch.bfloat16


@pytest.mark.skipif(not platform.cpu_has_native_bf16(), reason="the CPU has no native bf16 arithmetic")
def test_bf16_default_prompt_logprobs_match_transformers_bf16(embedded_model_path):
    """Tandem's default on this CPU (bf16) against transformers with the same weights in
    bf16: every prompt token's log-probability within 0.3 nats with int4 layers (measured: at
    most 0.18; bf16 against fp32 differs by up to 0.21, mean 0.04, a wrong weight by several
    nats). With AVX512-VNNI the layers are GGUF blocks, whose kernel rounds each input row to
    int8 per 32 values as llama.cpp does: within 1.0 nat, 0.1 on average over the 73 tokens
    (measured: at most 0.64, mean 0.074, 95th percentile 0.21)."""
    from transformers import AutoModelForCausalLM

    from tandem import LLM, SamplingParams
    from tandem.layers.quantization import gguf_blocks
    from tandem.model_loader.gguf_cache import checkpoint_folder
    from tests.conftest import PROMPTS

    llm = LLM(model=embedded_model_path, num_kv_blocks=256, max_model_len=1024)
    try:
        assert llm.engine.config.torch_dtype == torch.bfloat16
        tok = llm.get_tokenizer()
        seqs = [tok.encode(p) for p in PROMPTS]
        outs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_folder(embedded_model_path), dtype=torch.bfloat16).eval()
    blocks = gguf_blocks.available()
    diffs = []
    for ids, out in zip(seqs, outs):
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
        got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        diffs += [abs(g - want[i, ids[i + 1]].item()) for i, g in enumerate(got)]
    assert max(diffs) < (1.0 if blocks else 0.3), max(diffs)
    if blocks:
        assert sum(diffs) / len(diffs) < 0.1, sum(diffs) / len(diffs)


@pytest.mark.parametrize("name, gib, usage, want", [
    ("NVIDIA H200", 139.8, "llm_class", (1024, 16384)),
    ("NVIDIA H100 80GB HBM3", 79.1, "openai_api_server", (1024, 16384)),
    ("NVIDIA A100-SXM4-80GB", 79.2, "llm_class", (256, 8192)),
    ("NVIDIA L4", 22.0, "openai_api_server", (256, 2048)),
])
def test_gpu_batch_limits_follow_its_memory_and_use(monkeypatch, name, gib, usage, want):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=int(gib * 2**30)))
    assert platform.default_batch_limits(torch.device("cuda"), usage) == want


@pytest.mark.parametrize("usage", ["llm_class", "openai_api_server"])
def test_cpu_batch_limits(usage):
    assert platform.default_batch_limits(CPU, usage) == (256, 2048)
