"""Load progress: a bar on a terminal, periodic INFO lines elsewhere, and a closing line with
the time, for weight loading, GGUF conversion and its fp32 checkpoint (tandem.progress)."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import torch

from tandem import progress as progress_mod
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.model_loader import gguf_cache, loader
from tandem.progress import Progress

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random Llama saved as safetensors (no tokenizer: only weights are loaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(d)
    return str(d)


@pytest.fixture
def terminal(monkeypatch):
    """stderr taken for a terminal: progress draws its bar."""
    monkeypatch.setattr(progress_mod, "stderr_is_terminal", lambda: True)


def _build(folder: str):
    return loader.build_model(loader.load_hf_config(folder), folder, "auto", TorchAttentionBackend(), torch.float32,
                              torch.device("cpu"), max_positions=256)


def _num_tensors(folder: str) -> int:
    return loader.count_safetensors_weights(folder)


def test_weight_loading_logs_the_tensors_and_the_time(hf_folder, caplog):
    caplog.set_level(logging.INFO, logger="tandem.model_loader.loader")
    _build(hf_folder)
    n = _num_tensors(hf_folder)
    assert n > 0
    assert any(re.fullmatch(rf"Loading model weights took \d+\.\d\d s \({n} tensors\)", m) for m in caplog.messages), \
        caplog.messages


def test_weight_loading_draws_a_bar_on_a_terminal(hf_folder, terminal, capsys):
    _build(hf_folder)
    n = _num_tensors(hf_folder)
    err = capsys.readouterr().err
    assert "Loading model weights: 100%" in err and f"{n}/{n}" in err, err


def test_periodic_lines_while_a_step_runs(caplog):
    """Off a terminal, a line every interval says how far the step is and what it does,
    also while a stage blocks without counting."""
    log = logging.getLogger("tandem.test_progress")
    caplog.set_level(logging.INFO, logger=log.name)
    with Progress("Reading", log, total=4, unit="items", interval_s=0.01) as p:
        p.stage("opening")
        p.update()
        deadline = time.monotonic() + 10
        while not any(m.startswith("Reading: 1/4 items (25%), opening, ") for m in caplog.messages):
            assert time.monotonic() < deadline, caplog.messages
            time.sleep(0.01)
        p.update(3)
    assert re.fullmatch(r"Reading took \d+\.\d\d s \(4 items\)", caplog.messages[-1])


def test_a_failed_step_writes_no_closing_line(caplog):
    log = logging.getLogger("tandem.test_progress")
    caplog.set_level(logging.INFO, logger=log.name)
    with pytest.raises(RuntimeError), Progress("Reading", log, show=False):
        raise RuntimeError("boom")
    assert not any("took" in m for m in caplog.messages)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A small GGUF file of three fp32 tensors, whose config and tokenizer stand in for
    transformers' reading of GGUF metadata (seconds for a real file)."""
    from gguf import GGUFWriter
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (300, 64)), ("output_norm.weight", (64,)),
                        ("blk.0.ffn_up.weight", (128, 64))):
        w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    class Tokenizer:
        def save_pretrained(self, out: str) -> None:
            pass

    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: LlamaConfig(**TINY))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    monkeypatch.setenv("TANDEM_CACHE_ROOT", str(tmp_path / "cache"))
    gguf_cache._converted_folder.cache_clear()
    yield str(path)
    gguf_cache._converted_folder.cache_clear()


def test_gguf_conversion_logs_the_time(tiny_gguf, caplog):
    caplog.set_level(logging.INFO, logger="tandem.model_loader.gguf_cache")
    assert gguf_cache.converted_folder(tiny_gguf) is not None
    assert any(re.fullmatch(r"Converting tiny\.gguf took \d+\.\d\d s", m) for m in caplog.messages), caplog.messages


def test_gguf_checkpoint_logs_the_tensors_and_draws_a_bar_on_a_terminal(tiny_gguf, terminal, capsys, caplog):
    caplog.set_level(logging.INFO, logger="tandem.model_loader.gguf_cache")
    assert gguf_cache.checkpoint_folder(tiny_gguf) is not None
    err = capsys.readouterr().err
    assert "Dequantizing tiny.gguf: 100%" in err and "3/3" in err, err
    assert any(re.fullmatch(r"Dequantizing tiny\.gguf took \d+\.\d\d s \(3 tensors\)", m) for m in caplog.messages), \
        caplog.messages
