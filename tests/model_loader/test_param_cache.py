"""The parameter cache of GGUF models: hit, miss, invalidation, unreadable files rebuilt,
and a model loaded from it equal to one loaded from the checkpoint."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import LlamaConfig

from tandem.attention.torch_backend import TorchAttentionBackend
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
    that parameter files written by the test stay out of the real cache."""
    real = gguf_cache.converted_folder(embedded_model_path)
    entry = tmp_path / "entry"
    entry.mkdir()
    for name in os.listdir(real):
        if not name.startswith("params-"):
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

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("the checkpoint was read although the parameter cache holds the model")

    with monkeypatch.context() as m:
        m.setattr(loader, "iterate_gguf_weights_cached", no_checkpoint)
        _assert_same(build(), reference)

    with open(path, "r+b") as f:  # damaged: rebuilt from the checkpoint, not crashed on
        f.truncate(1000)
    _assert_same(build(), reference)
    with monkeypatch.context() as m:
        m.setattr(loader, "iterate_gguf_weights_cached", no_checkpoint)
        _assert_same(build(), reference)


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
