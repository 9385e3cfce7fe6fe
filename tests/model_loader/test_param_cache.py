"""The parameter cache of GGUF models: hit, miss, invalidation, unreadable files rebuilt,
and a model loaded from it equal to one loaded from the checkpoint; with GGUF int4 layers,
their packed planes cached with the other tensors and mapped, not rebuilt."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import LlamaConfig

from tandem import platform
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.layers.quantization import gguf as gguf_int4
from tandem.layers.quantization import gguf_blocks
from tandem.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFEmbedding
from tandem.model_loader import gguf_cache, loader
from tandem.model_loader.param_cache import load_cached_parameters, params_file, save_parameters
from tandem.models.llama import LlamaForCausalLM

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _model(dtype: torch.dtype = torch.float32, seed: int | None = 0, **overrides) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, **overrides}), TorchAttentionBackend()).to(dtype)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_same(model, state) -> None:
    got = dict(model.named_parameters())
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hit_maps_the_saved_parameters(tmp_path, dtype):
    saved = _model(dtype)
    save_parameters(saved, str(tmp_path), dtype)
    fresh = _model(dtype, seed=1)
    assert load_cached_parameters(fresh, str(tmp_path), dtype)
    _assert_same(fresh, _state(saved))
    assert fresh.embed_tokens.weight.data_ptr() % 64 == 0
    with torch.no_grad():  # the mapping is private: writes do not reach the file
        fresh.embed_tokens.weight.add_(1)
    again = _model(dtype, seed=2)
    assert load_cached_parameters(again, str(tmp_path), dtype)
    _assert_same(again, _state(saved))


def test_miss_leaves_the_model_untouched(tmp_path):
    model = _model()
    before = _state(model)
    assert not load_cached_parameters(model, str(tmp_path), torch.float32)
    save_parameters(_model(torch.bfloat16), str(tmp_path), torch.bfloat16)
    assert not load_cached_parameters(model, str(tmp_path), torch.float32)  # another dtype's file
    _assert_same(model, before)


def test_other_layout_is_not_used(tmp_path, caplog):
    save_parameters(_model(), str(tmp_path), torch.float32)
    wider = _model(seed=1, intermediate_size=256)
    before = _state(wider)
    with caplog.at_level(logging.WARNING, logger="tandem.model_loader.param_cache"):
        assert not load_cached_parameters(wider, str(tmp_path), torch.float32)
    assert "another model layout" in caplog.text
    _assert_same(wider, before)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_file_is_a_miss_and_rewritten(tmp_path, caplog, damage):
    saved = _model()
    save_parameters(saved, str(tmp_path), torch.float32)
    path = params_file(str(tmp_path), torch.float32)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write({"truncated": data[:len(data) // 2], "garbage": b"\x00garbage" * 100, "empty": b""}[damage])
    fresh = _model(seed=1)
    with caplog.at_level(logging.WARNING, logger="tandem.model_loader.param_cache"):
        assert not load_cached_parameters(fresh, str(tmp_path), torch.float32)
    assert "unreadable" in caplog.text
    save_parameters(saved, str(tmp_path), torch.float32)
    assert load_cached_parameters(fresh, str(tmp_path), torch.float32)
    _assert_same(fresh, _state(saved))


def test_unwritable_folder_is_skipped(tmp_path):
    missing = tmp_path / "no_such_folder"
    save_parameters(_model(), str(missing), torch.float32)  # logged, not raised
    assert not missing.exists()


@pytest.fixture
def entry_copy(tmp_path, embedded_model_path, monkeypatch):
    """The embedded model's converted folder, its files linked into a temporary entry, so
    that parameter files written by the test stay out of the real cache (and without the fp32
    checkpoint an earlier reader may have asked the real entry for)."""
    real = gguf_cache.converted_folder(embedded_model_path)
    entry = tmp_path / "entry"
    entry.mkdir()
    for name in os.listdir(real):
        if not name.startswith("params-") and name != gguf_cache.WEIGHTS_FILE:
            os.symlink(os.path.join(real, name), entry / name)
    monkeypatch.setattr(loader, "converted_folder", lambda path: str(entry))
    return entry


def test_gguf_load_writes_then_maps_the_cache(entry_copy, embedded_model_path, monkeypatch):
    cfg = loader.load_hf_config(embedded_model_path)
    build = lambda: loader.build_model(cfg, embedded_model_path, "auto", TorchAttentionBackend(),  # noqa: E731
                                       torch.bfloat16, torch.device("cpu"), max_positions=256)
    first = build()
    path = params_file(str(entry_copy), torch.bfloat16)
    assert os.path.isfile(path)
    reference = _state(first)

    with monkeypatch.context() as m:
        _no_checkpoint(m)
        _assert_same(build(), reference)

    with open(path, "r+b") as f:  # damaged: rebuilt from the checkpoint, not crashed on
        f.truncate(1000)
    _assert_same(build(), reference)
    with monkeypatch.context() as m:
        _no_checkpoint(m)
        _assert_same(build(), reference)


def _no_checkpoint(m: pytest.MonkeyPatch) -> None:
    """Make reading the GGUF file or an fp32 checkpoint, or building int4 planes, fail."""
    def read(*args, **kwargs):
        raise AssertionError("the checkpoint was read although the parameter cache holds the model")

    for name in ("open_gguf", "iterate_safetensors_weights", "quantize_gguf_linears"):
        m.setattr(loader, name, read)
    for name in ("int4_planes", "pack_int4_planes"):
        m.setattr(gguf_int4, name, read)


def test_changed_gguf_file_misses(tmp_path, monkeypatch):
    """The parameters live in the converted entry, whose key covers the GGUF file: a
    changed file gets a new entry without them."""
    monkeypatch.setenv("TANDEM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "_convert", lambda path, out: None)
    gguf_cache._converted_folder.cache_clear()
    src = tmp_path / "m.gguf"
    src.write_bytes(b"v1")
    first = gguf_cache.converted_folder(str(src))
    assert first.startswith(str(tmp_path / "cache" / "gguf"))
    save_parameters(_model(), first, torch.float32)
    assert load_cached_parameters(_model(seed=1), first, torch.float32)
    src.write_bytes(b"v2")
    second = gguf_cache.converted_folder(str(src))
    assert second != first and not os.path.exists(first)
    assert not load_cached_parameters(_model(seed=1), second, torch.float32)
    gguf_cache._converted_folder.cache_clear()


def _build_int4(path: str):
    from tandem.layers.quantization.config import GGUFQuantConfig

    return loader.build_model(loader.load_hf_config(path), path, "auto", TorchAttentionBackend(), torch.bfloat16,
                              torch.device("cpu"), max_positions=256, quant_config=GGUFQuantConfig(path))


def _assert_same_model(model, reference) -> None:
    """The same modules (types, names) and the same tensors, bit for bit."""
    assert [(n, type(m)) for n, m in model.named_modules()] == [(n, type(m)) for n, m in reference.named_modules()]
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("blocks", [False, True], ids=["int4-head", "block-head"])
def test_gguf_int4_load_caches_its_planes_and_maps_them(entry_copy, embedded_model_path, monkeypatch, blocks):
    """The default CPU load (bf16, GGUF int4 layers) caches what the model holds, packed
    planes included, in one file (no dense parameter file, no fp32 checkpoint); a later load
    maps it without reading the GGUF file or building a plane, and holds the same model; with
    and without the block kernel (their files are apart)."""
    if blocks and not gguf_blocks.available():
        pytest.skip("the GGUF block kernel needs AVX512-VNNI")
    monkeypatch.setattr(gguf_blocks, "available", lambda: blocks)
    first = _build_int4(embedded_model_path)
    # every layer and the LM head (the tied Q8_0 embedding) blocks where the block kernel runs, else int4 planes
    form = GGUFBlockLinear if blocks else gguf_int4.GGUFInt4Linear
    assert sum(isinstance(m, form) for m in first.modules()) == 30 * 4 + 1
    assert isinstance(first.lm_head_quant, form)
    path = params_file(str(entry_copy), torch.bfloat16, int4=True)
    assert os.path.isfile(path)
    assert not os.path.exists(params_file(str(entry_copy), torch.bfloat16))
    assert not os.path.exists(entry_copy / gguf_cache.WEIGHTS_FILE)
    with monkeypatch.context() as m:
        _no_checkpoint(m)
        warm = _build_int4(embedded_model_path)
    _assert_same_model(warm, first)
    head = warm.lm_head_quant
    if blocks:  # every row on the repacked blocks: no dense weight; the embedding shares the head's tiles
        assert head.dense is None and isinstance(warm.embed_tokens, GGUFEmbedding)
        assert warm.embed_tokens.repacked.data_ptr() == head.repacked.data_ptr()
    else:
        assert head.dense.data_ptr() == warm.embed_tokens.weight.data_ptr()  # the tied head's weight saved once
    assert (head.repacked if blocks else head.packed).data_ptr() % 64 == 0


def test_int4_file_is_one_per_cpu_capability(tmp_path, monkeypatch):
    """The kernel's packing differs between AVX512 and AVX2 (and the portable build): a
    cache shared by two machines keeps one int4 file for each; and one with, one without the
    block kernel (VNNI), whose layers differ."""
    names = set()
    for capability in ("AVX512", "AVX2", "DEFAULT"):
        for vnni in (False, True):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            monkeypatch.setattr(gguf_blocks, "available", lambda v=vnni: v)
            names.add(params_file(str(tmp_path), torch.bfloat16, int4=True))
    assert len(names) == 6 and params_file(str(tmp_path), torch.bfloat16) not in names


@pytest.mark.skipif(not platform.cpu_has_native_bf16(), reason="GGUF int4 is the default on CPUs with native bf16")
def test_default_load_cold_and_warm_give_the_same_logits(tmp_path, embedded_model_path, monkeypatch):
    """The default load of the embedded model, first in an empty cache then from it: the same
    greedy tokens and log-probabilities (prompt and generated tokens) bit for bit; the entry
    holds config, tokenizer and one parameter file, a warm load builds no plane."""
    from tandem import LLM, SamplingParams
    from tests.conftest import PROMPTS

    monkeypatch.setenv("TANDEM_CACHE_ROOT", str(tmp_path / "cache"))
    gguf_cache._converted_folder.cache_clear()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5)

    def run() -> list:
        llm = LLM(model=embedded_model_path, num_kv_blocks=64, max_model_len=512)
        try:
            assert any(isinstance(m, gguf_int4.GGUFInt4Linear | GGUFBlockLinear) for m in llm.engine.model.modules())
            outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
                 [d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]) for o in outs]

    try:
        cold = run()
        (entry,) = [e for e in os.listdir(tmp_path / "cache" / "gguf") if e != gguf_cache.HASHES_DIR]
        files = os.listdir(tmp_path / "cache" / "gguf" / entry)
        assert [f for f in files if f.startswith("params-")] == [os.path.basename(
            params_file("", torch.bfloat16, int4=True))] and gguf_cache.WEIGHTS_FILE not in files
        with monkeypatch.context() as m:
            _no_checkpoint(m)
            warm = run()
    finally:
        gguf_cache._converted_folder.cache_clear()
    assert warm == cold
