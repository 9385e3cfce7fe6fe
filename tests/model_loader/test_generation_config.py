"""generation_config.json and the tokenizer files of a Hugging Face folder are honoured as
transformers honours them: every EOS id of the generation config stops a request (the list
form too), its sampling values are the defaults of unset request fields (not with
``generation_config="vllm"``), and prompts, BOS, added special tokens and the chat template
come out as transformers' tokenizer makes them.

The folder: a tiny random Llama (transformers' own init, saved as safetensors) with the
SmolLM2 tokenizer files."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.entrypoints.llm import LLM
from tandem.model_loader.generation_config import load_generation_defaults
from tandem.sampling_params import UNSET_DEFAULTS, SamplingParams

PROMPT = "The capital of France is"
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=16)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, smol_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)
    return d


def write_generation_config(folder, **values) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **values}))


def hf_greedy(folder, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy completion; it reads generation_config.json itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def test_every_eos_id_of_the_generation_config_stops_like_transformers(hf_folder):
    """``"eos_token_id": [2, 0]``: token 0 is not the tokenizer's EOS (2), yet Tandem stops
    on it where transformers stops (it used to run on to max_tokens). The random model with
    tied embeddings repeats the last prompt token, so a prompt ending in 0 emits 0."""
    write_generation_config(hf_folder, eos_token_id=[2, 0])
    llm = LLM(str(hf_folder), **ENGINE)
    free = llm.generate([[8, 9, 10, 0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    assert 0 in free.outputs[0].token_ids and len(free.outputs[0].token_ids) == 12  # ignore_eos: all of them
    for prompt in ([8, 9, 10, 0], [8, 9, 10, 11]):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        want = hf_greedy(hf_folder, prompt, 12)
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if want[-1] in (0, 2) else "length")
    assert llm.generate([[8, 9, 10, 0]], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0].finish_reason == "stop"


def test_sampling_defaults_apply_to_unset_fields_only(hf_folder):
    write_generation_config(hf_folder, eos_token_id=2, temperature=0.0, top_p=0.9, top_k=20, min_p=0.05,
                            repetition_penalty=1.1, max_new_tokens=7)
    llm = LLM(str(hf_folder), **ENGINE)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty) == (0.0, 0.9, 20, 0.05, 1.1)
    unset = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, top_p=0.9, top_k=20, min_p=0.05,
                                                 repetition_penalty=1.1, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0]
    assert unset.outputs[0].token_ids == greedy.outputs[0].token_ids
    # A field the request sets wins: temperature 1 over the model's 0 (random model: the
    # sampled tokens differ from the greedy ones).
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0]
    assert sampled.outputs[0].token_ids != greedy.outputs[0].token_ids
    # max_new_tokens is the default of an unset max_tokens.
    capped = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(capped.outputs[0].token_ids) == 7


def test_generation_config_vllm_keeps_eos_and_ignores_sampling_values(hf_folder):
    write_generation_config(hf_folder, eos_token_id=[2, 5], temperature=0.0, top_k=20)
    llm = LLM(str(hf_folder), generation_config="vllm", **ENGINE)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k) == (UNSET_DEFAULTS["temperature"], UNSET_DEFAULTS["top_k"])
    assert {2, 5} <= llm.engine.eos_token_ids


def test_load_generation_defaults(tmp_path):
    assert load_generation_defaults(str(tmp_path)).source is None  # no file: nothing
    write_generation_config(tmp_path, eos_token_id=[2, 0], temperature=0.6, top_p=0.95, do_sample=True)
    g = load_generation_defaults(str(tmp_path))
    assert g.eos_token_ids == {0, 2} and g.sampling == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "config.json").write_text("{}")
    assert load_generation_defaults(str(tmp_path / "config.json")) == g  # a bare config.json: its folder
    assert load_generation_defaults(str(tmp_path), "vllm").sampling == {}
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, eos_token_id=7, top_k=5)
    assert load_generation_defaults(str(tmp_path), str(other)).sampling == {"top_k": 5}
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(str(tmp_path), str(tmp_path / "missing"))
    write_generation_config(tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(str(tmp_path))
    write_generation_config(tmp_path, eos_token_id="</s>")
    with pytest.raises(ValueError, match="eos_token_id"):
        load_generation_defaults(str(tmp_path))


def test_sampling_params_tell_unset_from_set():
    p = SamplingParams(top_k=1)
    assert p.temperature is None and p.top_k == 1
    r = p.with_defaults({"temperature": 0.0, "top_k": 40})
    assert (r.temperature, r.top_k, r.top_p) == (0.0, 1, UNSET_DEFAULTS["top_p"])
    assert SamplingParams().with_defaults().temperature == 1.0 and not SamplingParams().greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().with_defaults({"top_p": 0.0})


def test_tokenizer_files_are_honoured_like_transformers(hf_folder):
    """Prompt ids (BOS as tokenizer_config's add_bos_token makes transformers add it, added
    special tokens as one id) and the chat template of the folder's tokenizer files (no
    second BOS) equal transformers' tokenizer's."""
    from transformers import AutoTokenizer

    write_generation_config(hf_folder)
    conf_path = hf_folder / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    conf["add_bos_token"] = True
    conf_path.write_text(json.dumps(conf))
    try:
        ref = AutoTokenizer.from_pretrained(hf_folder)
        from tandem.model_loader.loader import load_tokenizer

        load_tokenizer.cache_clear()
        llm = LLM(str(hf_folder), **ENGINE)
        prompt = "Hi<|im_start|>there"
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        assert out.prompt_token_ids == ref(prompt).input_ids
        assert ref.convert_tokens_to_ids("<|im_start|>") in out.prompt_token_ids  # an added special token: one id
        msgs = [{"role": "user", "content": "Hello"}]
        chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert chat.prompt_token_ids == list(want)
        assert chat.prompt == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    finally:
        conf["add_bos_token"] = False
        conf_path.write_text(json.dumps(conf))
        load_tokenizer.cache_clear()
