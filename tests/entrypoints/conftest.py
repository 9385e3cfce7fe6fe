"""One ``tandem serve`` (embedded SmolLM2, CPU) shared by the server tests of this folder."""

from __future__ import annotations

import pytest

MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def server():
    from tandem.entrypoints.openai.testing import RemoteServer

    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gib", "0.5", "--dtype", "float32",
            "--device", "cpu", "--served-model-name", MODEL_NAME]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture
def offline_hub(monkeypatch):
    """lm-eval and datasets without the network (the test data is local)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
