"""``tandem serve`` with several engine cores over gloo (tiny random-weight models, CPU):
greedy completions through the ``openai`` client equal the single-process offline ones for
DP=2 (a dense Llama; a Qwen3-MoE with expert parallelism and dual-batch overlap, whose
replicas step in lockstep), TP=2, PP=2 and DP=2 x PP=2; streamed text equals the non-streamed text;
requests are spread over both replicas; streams cut mid-way give every replica's KV
blocks back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.distributed.conftest import CONFIGS, ENGINE, PROMPTS, make_llm

MAX_TOKENS = 10
LAYOUTS = {
    "dp2-llama": ("llama", ["--data-parallel-size", "2"]),
    "dp2-ep-dbo-qwen3_moe": ("qwen3_moe", ["--data-parallel-size", "2", "--enable-expert-parallel", "--enable-dbo",
                                           "--all2all-backend", "all_to_all", "--dbo-decode-token-threshold", "2",
                                           "--dbo-prefill-token-threshold", "8"]),
    "tp2-llama": ("llama", ["--tensor-parallel-size", "2"]),
    "pp2-llama": ("llama", ["--pipeline-parallel-size", "2"]),
    "dp2-pp2-llama": ("llama", ["--data-parallel-size", "2", "-pp", "2"]),
}


def _engine_args(model: str) -> list[str]:
    from tandem.config import embedded_default_model

    return [model, "--tokenizer", embedded_default_model(), "--load-format", "dummy", "--block-size", "8",
            "--num-kv-blocks", "256", "--max-model-len", str(ENGINE["max_model_len"]), "--dtype", "float32",
            "--device", "cpu"]


def _offline_texts(model: str, prompts) -> list[str]:
    from tandem.sampling_params import SamplingParams

    llm = make_llm(model, num_kv_blocks=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].text for o in outs]


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/debug/engine_stats", timeout=30).json()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_serve_equals_single_process(tmp_path, layout, monkeypatch):
    from tandem.entrypoints.openai.testing import RemoteServer

    family, flags = LAYOUTS[layout]
    model = tmp_path / family
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS[family]))
    prompts = PROMPTS * 2
    want = _offline_texts(str(model), prompts)
    with RemoteServer([*_engine_args(str(model)), *flags], env={"TANDEM_STARTUP_TIMEOUT_S": "300"}) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        extra = {"ignore_eos": True}

        async def concurrent() -> list[str]:
            ac = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
            res = await asyncio.gather(*(ac.completions.create(
                model=srv_model(client), prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
                for p in prompts))
            return [r.choices[0].text for r in res]

        assert asyncio.run(concurrent()) == want
        dp = 2 if "--data-parallel-size" in flags else 1
        replicas = _stats(srv.url)["replicas"]
        assert len(replicas) == dp
        if dp == 2:
            assert all(r["num_steps"] > 0 for r in replicas), replicas  # both replicas served

        stream = client.completions.create(model=srv_model(client), prompt=prompts[3], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want[3]

        # Streams cut after their first chunk: every replica's blocks come back.
        s = cut_streams_and_wait_freed(srv.url, srv_model(client), prompts)
        assert s["num_unfinished_seqs"] == 0 and s["num_seqs_with_blocks"] == 0, s
        assert all(r["num_free_blocks"] == r["num_usable_blocks"] for r in s["replicas"]), s


def cut_streams_and_wait_freed(url: str, model: str, prompts: list[str]) -> dict:
    """Stream each prompt on its own connection (so several API servers each get some) and
    cut it after its first chunk; returns ``/debug/engine_stats`` once nothing is live and no
    sequence holds blocks, or after 60 s."""
    async def one(p) -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": p, "max_tokens": 100, "stream": True, "ignore_eos": True, "model": model}
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break

    async def cut() -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    asyncio.run(cut())
    deadline = time.monotonic() + 60
    while True:
        s = _stats(url)
        if (s["num_live_requests"] == 0 and s["num_seqs_with_blocks"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def srv_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
