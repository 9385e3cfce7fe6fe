"""``LLM.beam_search`` on the embedded model in fp32: the beams and scores of transformers'
beam search, the same with asynchronous output processing on and off and under
preemption, beams reading their shared prefix from the prefix cache, and bad input."""

from __future__ import annotations

import os

import pytest
import torch

from tandem import BeamSearchParams
from tests.conftest import PROMPTS, assert_all_blocks_free, make_llm

WIDTH, STEPS = 3, 8
PARAMS = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True, length_penalty=0.0)
CASES = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]


@pytest.fixture(scope="module")
def llm():
    m = make_llm()
    yield m
    m.engine.shutdown()


@pytest.fixture(scope="module")
def results(llm):
    return llm.beam_search(CASES, PARAMS)


def _beams(outs) -> list[list[tuple[list[int], float]]]:
    return [[(s.tokens, round(s.cum_logprob, 3)) for s in o.sequences] for o in outs]


def test_beams_and_scores_equal_transformers(llm, results, embedded_model_path):
    """transformers' beam search (EOS off, length_penalty 0: its score is the sum of the
    logprobs) returns the same beams, in the same order, with the same scores."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(embedded_model_path),
                                               gguf_file=os.path.basename(embedded_model_path)).eval()
    ref.generation_config.eos_token_id = None
    tok = llm.get_tokenizer()
    for prompt, out in zip(CASES, results):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            g = ref.generate(ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH, num_return_sequences=WIDTH,
                             max_new_tokens=STEPS, do_sample=False, length_penalty=0.0, pad_token_id=tok.eos_token_id,
                             output_scores=True, return_dict_in_generate=True)
        want = [seq[ids.shape[1]:].tolist() for seq in g.sequences]
        assert [s.tokens[ids.shape[1]:] for s in out.sequences] == want, prompt
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(g.sequences_scores.tolist(), abs=2e-3)
        assert [s.text for s in out.sequences] == tok.batch_decode(want, skip_special_tokens=True)
        assert all(s.finish_reason == "length" for s in out.sequences)


def test_async_output_processing_off_and_preemption_give_the_same_beams(results):
    """Off, and with a KV cache of 11 usable blocks for 9 beams (preempted, recomputed)."""
    for kwargs in (dict(async_output_proc=False), dict(num_kv_blocks=12, block_size=16)):
        other = make_llm(**kwargs)
        assert _beams(other.beam_search(CASES, PARAMS)) == _beams(results), kwargs
        assert_all_blocks_free(other.engine)
        other.engine.shutdown()


def test_beams_read_their_prefix_from_the_prefix_cache(llm, monkeypatch):
    """From the second round on, every beam's request finds all its full blocks but the
    last token's in the prefix cache: beams share their prompt's and parent's KV blocks,
    nothing is copied or computed again."""
    rounds = []
    generate = llm.generate

    def recording(prompts, params, use_tqdm=True):
        outs = generate(prompts, params, use_tqdm)
        rounds.append([(len(o.prompt_token_ids), o.num_cached_tokens) for o in outs])
        return outs
    monkeypatch.setattr(llm, "generate", recording)
    llm.beam_search(["A long shared system prompt for beams. " * 6 + "Question:"], PARAMS)
    block = llm.engine.config.cache_config.block_size
    assert len(rounds) == STEPS and all(len(r) == WIDTH for r in rounds[1:])
    for r in rounds[1:]:
        assert all(cached == (n - 1) // block * block for n, cached in r), r
    assert_all_blocks_free(llm.engine)


def test_eos_ends_a_hypothesis(llm):
    """With EOS on, a chat answer ends: the best sequence stops at EOS ("stop"), its text
    without the EOS token unless include_stop_str_in_output."""
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                     add_generation_prompt=True)
    params = BeamSearchParams(beam_width=2, max_tokens=24)
    (out,) = llm.beam_search({"prompt_token_ids": tok.encode(prompt, add_special_tokens=False)}, params)
    best = out.sequences[0]
    assert best.finish_reason == "stop" and best.tokens[-1] == tok.eos_token_id
    assert tok.eos_token not in best.text and best.text.strip()


@pytest.mark.parametrize("params, match", [
    ("not params", "^params must be a BeamSearchParams"),
    (BeamSearchParams(beam_width=11, max_tokens=4), "^beam_width must be at most 10"),
])
def test_bad_input_is_a_value_error(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.beam_search("Hello", params)


def test_a_prompt_without_room_is_refused(llm):
    with pytest.raises(ValueError, match="leaves no room"):
        llm.beam_search({"prompt_token_ids": [1] * 1024}, BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match=r"^max_tokens is too large: 1020 tokens in the prompt \+ max_tokens 10 "):
        llm.beam_search({"prompt_token_ids": [1] * 1020}, BeamSearchParams(beam_width=2, max_tokens=10))
    assert_all_blocks_free(llm.engine)


def test_tiny_random_llama_beams_equal_transformers(tmp_path, smol_tokenizer):
    """The same check on a random-weight Llama (fp32, 300-token vocabulary), token-id
    prompts, beam width 4 and a length penalty: no EOS, so every beam has one length and
    transformers' and vLLM's normalisations rank alike."""
    from transformers import LlamaConfig

    from tandem.entrypoints.llm import LLM
    from tests.models.paged_parity import random_hf_reference

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ref = random_hf_reference(cfg)
    ref.save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    ref.generation_config.eos_token_id = None
    prompts = [[5, 17, 230, 41, 99], [7] * 3 + [120, 250, 33, 8, 61, 2, 77]]
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True, length_penalty=1.0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            g = ref.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=4,
                             max_new_tokens=6, do_sample=False, length_penalty=0.0, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        assert [s.tokens for s in out.sequences] == g.sequences.tolist()
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(g.sequences_scores.tolist(), abs=1e-4)
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()
