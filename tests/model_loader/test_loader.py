"""A model without tokenizer files fails at once, saying to pass --tokenizer; a converted
GGUF folder's config and tokenizer equal transformers' without importing its config class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem.model_loader.loader import load_tokenizer


@pytest.mark.parametrize("as_file", [False, True])
def test_missing_tokenizer_names_the_flag(tmp_path, as_file):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    path = tmp_path / "config.json" if as_file else tmp_path
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(path))


def test_a_config_file_finds_the_tokenizer_beside_it(tmp_path, embedded_model_path):
    """``--model DIR/config.json`` (dummy weights) loads the tokenizer files in DIR."""
    load_tokenizer(embedded_model_path).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok = load_tokenizer(str(tmp_path / "config.json"))
    assert tok("Hello")["input_ids"] == load_tokenizer(embedded_model_path)("Hello")["input_ids"]


_NOT_READ = {"_name_or_path", "use_cache", "transformers_version"}  # Tandem reads none of them


def _full_configs(embedded_model_path):
    from transformers import AutoConfig, LlamaConfig, Qwen2Config, Qwen3Config

    from tandem.model_loader.gguf_cache import converted_folder

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    return {
        "embedded": AutoConfig.from_pretrained(converted_folder(embedded_model_path)),
        "llama3-rope": LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=32),
    }


def test_converted_config_holds_the_full_classs_values(tmp_path, embedded_model_path):
    """A converted GGUF folder's config, read without its class, gives the model the same
    values as the class does (the folder's config.json is saved from the class)."""
    from tandem.layers.rotary import compute_inv_freq
    from tandem.model_loader.loader import converted_config
    from tandem.models.llama import DecoderSpec

    for name, full in _full_configs(embedded_model_path).items():
        full.save_pretrained(tmp_path / name)
        light = converted_config(str(tmp_path / name))
        for key in full.to_dict().keys() - _NOT_READ:
            assert getattr(light, key) == getattr(full, key), (name, key)
        assert DecoderSpec.from_hf_config(light) == DecoderSpec.from_hf_config(full)
        spec = DecoderSpec.from_hf_config(full)
        for a, b in zip(compute_inv_freq(light, spec.head_dim), compute_inv_freq(full, spec.head_dim)):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), name


def test_gguf_tokenizer_from_the_converted_folder_equals_autotokenizer(embedded_model_path):
    from transformers import AutoTokenizer

    from tandem.model_loader.gguf_cache import converted_folder

    ours = load_tokenizer(embedded_model_path)
    ref = AutoTokenizer.from_pretrained(converted_folder(embedded_model_path))
    assert type(ours) is type(ref)
    text = "Hello <|im_start|>user\nünïcode 日本語 tabs\tand  spaces<|im_end|>"
    assert ours.encode(text) == ref.encode(text)
    assert ours.chat_template == ref.chat_template and ours.special_tokens_map == ref.special_tokens_map
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_gguf_config_and_tokenizer_import_no_model_config_class(embedded_model_path):
    """Reading a converted GGUF's config and tokenizer imports no model-specific config
    module (LlamaConfig's pulls in torch.distributed.tensor: a second of a CLI start)."""
    code = ("import sys; from tandem.model_loader.loader import load_hf_config, load_tokenizer; "
            f"load_hf_config({embedded_model_path!r}); load_tokenizer({embedded_model_path!r}); "
            "print([m for m in ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_truncated_safetensors_file_is_one_value_error_naming_it(tmp_path):
    from safetensors.torch import save_file

    from tandem.model_loader.loader import count_safetensors_weights, iterate_safetensors_weights

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:100])
    for read in (count_safetensors_weights, lambda folder: list(iterate_safetensors_weights(folder))):
        with pytest.raises(ValueError, match=f"cannot read {path}"):
            read(str(tmp_path))
