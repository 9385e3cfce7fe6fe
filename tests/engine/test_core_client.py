"""The engine-core clients over zmq (tandem.engine.core_client) on the embedded model's
spawned core: the protocol between a launching and an attached client, and how a core that
fails to start or dies is reported."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from tandem.engine.arg_utils import EngineArgs
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_client import EngineConfigError, EngineDeadError, SyncMPClient
from tandem.engine.launch import CoreProcManager
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import RequestOutputKind, SamplingParams


def _config(**kw):
    return EngineArgs(num_kv_blocks=64, max_model_len=256, device="cpu", **kw).create_engine_config()


def _gone(pids: list[int], timeout: float) -> list[psutil.Process]:
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _generate(engine: LLMEngine, rid: str, max_tokens: int) -> list[int]:
    engine.add_request(rid, [42] * 4, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids


def test_an_attached_client_shares_the_cores_and_leaves_them_running():
    """As ``tandem serve --api-server-count 1``: the launching client spawns the core with a
    slot for an attached client; that one gets its requests' outputs and its utility answers,
    and its shutdown leaves the core to the launcher, whose shutdown stops it."""
    config = _config()
    launcher = SyncMPClient(config, CoreProcManager.launch(config, api_server_count=1), wait_ready=False)
    pids = launcher.cores.pids
    try:
        (attach,) = launcher.cores.api_server_configs()
        attached = SyncMPClient(config, CoreProcManager.attach(attach))
        launcher.wait_ready()
        assert (attached.client_index, launcher.client_index) == (0, 1)
        engine = LLMEngine(config, attached)
        assert len(_generate(engine, "a", 3)) == 3
        assert attached.outstanding == [0] and attached.debug_stats()[0]["num_steps"] >= 3
        attached.shutdown()
        launcher.poll_outputs()  # the steps' stats reach every client
        assert launcher.is_alive and launcher.reported_load == [0] and launcher.engine_of == {}
    finally:
        launcher.shutdown()
    assert launcher.final_stats["num_steps"] >= 3
    assert _gone(pids, 10) == []


def test_a_killed_core_is_reported_to_every_call():
    engine = LLMEngine(_config(), SyncMPClient(_config()))
    client = engine.client
    try:
        proc = client.cores.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert not client.is_alive
        with pytest.raises(EngineDeadError, match=r"exited: 0 \(pid \d+, signal 9 \(SIGKILL: .*out-of-memory killer"):
            engine.add_request("late", [42] * 4, SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError, match="exited"):
            client.get_output()
    finally:
        start = time.monotonic()
        engine.shutdown()
    assert time.monotonic() - start < 5.0


def _ranks() -> list[int]:
    """This process's spawned children (its multiprocessing resource tracker aside)."""
    return [p.pid for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]


def test_a_rank_that_fails_on_bad_input_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    before = set(_ranks())
    with pytest.raises(EngineConfigError, match="safetensors") as err:
        SyncMPClient(EngineArgs(model=str(tmp_path), device="cpu").create_engine_config())
    assert "Traceback" not in str(err.value)
    assert _gone([p for p in _ranks() if p not in before], 10) == []
    with pytest.raises(ValueError):  # before any rank starts
        SyncMPClient(EngineArgs(model=str(tmp_path / "nope"), device="cpu").create_engine_config())


def test_death_found_by_a_liveness_check_fails_live_requests():
    """Whichever path notices a dead core first (here a liveness check; the sentinel
    monitor is switched off), every live request ends with ``EngineDeadError``."""
    own = AsyncLLM(EngineArgs(num_kv_blocks=256, max_model_len=1024, device="cpu").create_engine_config())
    own.client._monitor = lambda: None
    try:
        async def main():
            stream = await own.add_request("long", [42] * 4, SamplingParams(
                max_tokens=1000, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            await stream.__anext__()
            proc = own.client.cores.procs[0]
            proc.kill()
            proc.join(10)
            assert not own.is_running

            async def drain():
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError, match="exited"):
                await asyncio.wait_for(drain(), 10)

        asyncio.run(main())
    finally:
        own.shutdown()
