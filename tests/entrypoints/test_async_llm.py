"""``AsyncLLM``: the asyncio front end of an engine core in its own process."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tandem.engine.arg_utils import EngineArgs
from tandem.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(EngineArgs(num_kv_blocks=256, max_model_len=1024, device="cpu").create_engine_config())
    yield llm
    llm.shutdown()


async def _all_free(llm: AsyncLLM) -> dict:
    s = await llm.engine_stats()
    return {"seqs": s["num_unfinished_seqs"], "holding": s["num_seqs_with_blocks"], "live": s["num_live_requests"],
            "free": s["num_free_blocks"] == s["num_usable_blocks"]}


async def _wait_idle(llm: AsyncLLM, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = await _all_free(llm)
        if state == {"seqs": 0, "holding": 0, "live": 0, "free": True} or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


def test_delta_stream_joins_to_final_output(llm):
    async def main():
        greedy = dict(temperature=0.0, max_tokens=12, n=2, seed=3)
        deltas: dict[int, str] = {}
        tokens: dict[int, list] = {}
        async for out in llm.generate("The capital of France is", SamplingParams(
                output_kind=RequestOutputKind.DELTA, **greedy), "req"):
            assert out.request_id == "req"
            for c in out.outputs:
                deltas[c.index] = deltas.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(c.token_ids)
        finals = [o async for o in llm.generate("The capital of France is", SamplingParams(
            output_kind=RequestOutputKind.FINAL_ONLY, **greedy), "req")]
        return deltas, tokens, finals

    deltas, tokens, finals = asyncio.run(main())
    assert len(finals) == 1 and finals[0].finished
    assert {c.index: c.text for c in finals[0].outputs} == deltas
    assert {c.index: c.token_ids for c in finals[0].outputs} == tokens


def test_leaving_the_loop_aborts_and_frees_blocks(llm):
    async def main():
        params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gens = [llm.generate(f"Story number {i}:", params, f"r{i}") for i in range(6)]
        for g in gens:
            n = 0
            async for _ in g:
                n += 1
                if n == 2:
                    break
            await g.aclose()
        # a task cancelled while waiting for outputs aborts too
        async def consume():
            async for _ in llm.generate("Cancel me", params, "c"):
                pass

        t = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return await _wait_idle(llm)

    assert asyncio.run(main()) == {"seqs": 0, "holding": 0, "live": 0, "free": True}


def test_rejected_request_raises_value_error(llm):
    async def main():
        with pytest.raises(ValueError, match="maximum context length is 1024"):
            await llm.add_request("big", [42] * 8, SamplingParams(max_tokens=1020))
        with pytest.raises(ValueError, match="vocabulary"):
            await llm.add_request("bias", [42], SamplingParams(logit_bias={10**7: 1.0}))
        return await _wait_idle(llm)

    assert asyncio.run(main())["live"] == 0


def test_engine_core_sleeps_when_idle(llm):
    async def main():
        await _wait_idle(llm)
        before = (await llm.engine_stats())["num_steps"]
        await asyncio.sleep(0.5)
        return before, (await llm.engine_stats())["num_steps"]

    before, after = asyncio.run(main())
    assert before == after  # no steps without work (the core blocks on its input socket)


class _Owner:
    """What a ``RequestStream`` needs of its ``AsyncLLM``: listeners and the abort hook."""

    def __init__(self) -> None:
        self.stat_listeners: list = []
        self.aborted: list[str] = []

    def _abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("core-id", None, [1], [CompletionOutput(0, text, [7], finish_reason="length" if finished
                                                                 else None)], finished)


def test_stream_batches_what_arrived_and_ends_at_the_last_output():
    """``next_outputs`` takes every output that arrived since the last call (the user's id
    set on each), waits when there is none, and nothing after the last one; outputs
    before an exception come first, the exception on the next call."""
    async def main():
        owner = _Owner()
        s = RequestStream("core-id", "user-id", owner, time.monotonic(), 1)
        s.put(_out("a"))
        s.put(_out("b"))
        first = await s.next_outputs()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, s.put, _out("c", finished=True))
        second = await s.next_outputs()  # waits for it
        with pytest.raises(StopAsyncIteration):
            await s.next_outputs()
        assert [o.request_id for o in first + second] == ["user-id"] * 3
        e = RequestStream("core-2", "u2", owner, time.monotonic(), 1)
        e.put(_out("x"))
        e.put(EngineDeadError("gone"))
        got = await e.next_outputs()
        with pytest.raises(EngineDeadError, match="gone"):
            await e.next_outputs()
        w = RequestStream("core-3", "u3", owner, time.monotonic(), 1)
        t = asyncio.create_task(w.next_outputs())
        await asyncio.sleep(0.01)
        t.cancel()  # a reader cancelled while waiting aborts its request
        with pytest.raises(asyncio.CancelledError):
            await t
        return [o.outputs[0].text for o in first + second], [o.outputs[0].text for o in got], owner.aborted

    assert asyncio.run(main()) == (["a", "b", "c"], ["x"], ["core-3"])


def test_stats_line_logged_while_there_is_work_then_quiet(llm, caplog, monkeypatch):
    """The periodic stats line runs with the front end: lines while a request generates,
    none once the engine has been idle for a whole interval."""
    monkeypatch.setattr(llm, "log_stats_interval_s", 0.1)
    caplog.set_level(logging.INFO, logger="tandem.engine.stat_logger")

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        async for _ in llm.generate("The capital of France is", params, "stats"):
            pass
        deadline = time.monotonic() + 20
        while not (caplog.messages and "Running: 0 reqs, Waiting: 0 reqs" in caplog.messages[-1]):
            assert time.monotonic() < deadline, caplog.messages  # the log ends on the idle state
            await asyncio.sleep(0.05)
        logged = len(caplog.messages)
        await asyncio.sleep(0.5)  # five idle intervals
        return logged

    logged = asyncio.run(main())
    assert len(caplog.messages) == logged, caplog.messages
    assert any("Avg generation throughput" in m and "Running: 1 reqs" in m for m in caplog.messages), caplog.messages


def test_shutdown_fails_new_requests(llm):
    """Runs last in this module: it stops the shared engine core."""
    llm.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await llm.add_request("x", [1, 2], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not llm.is_running
