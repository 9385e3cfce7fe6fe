"""The engine in a background thread, fed and drained by asyncio (the server's front end).

``AsyncLLM`` splits work the way vLLM's V1 front end / engine core split does, inside one
process:

* the **engine thread** runs ``LLMEngine.step()`` back to back while there is work: it
  schedules, launches the model step, and processes the previous step's outputs (stop
  checks and incremental detokenization overlap the running step, see docs/architecture.md). When no
  request is live it sleeps on a condition variable (no busy spin);
* the **front end** (an asyncio event loop: HTTP parsing, validation, chat templates and
  prompt tokenization) hands requests and aborts to the engine thread through a locked
  queue, applied between two steps, and receives each step's ``RequestOutput``s on a
  per-request ``asyncio.Queue`` filled with ``loop.call_soon_threadsafe`` (one wake-up
  of the loop per step, whatever the number of requests).

A client that stops listening (the async iterator is closed or its task cancelled) aborts
its request: the engine frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.config import EngineConfig
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an internal error in a step)."""


@dataclass
class RequestStats:
    """Latencies of one request as seen by the front end, in seconds.

    ``ttft``: arrival -> first generated token processed; ``e2e``: arrival -> finish;
    ``tpot``: (e2e - ttft) / (generated tokens - 1), None with fewer than 2 tokens.
    """

    num_prompt_tokens: int
    num_generation_tokens: int
    ttft: float | None
    e2e: float
    tpot: float | None
    finish_reason: str | None


class StatListener(Protocol):
    """Receives per-request timings (the Prometheus metrics implement it)."""

    def on_first_token(self, ttft: float) -> None: ...

    def on_inter_token(self, itl: float) -> None: ...

    def on_request_finished(self, stats: RequestStats) -> None: ...


_ADDED = object()


@dataclass(eq=False)
class RequestStream:
    """The front end's handle on one request: an async iterator of ``RequestOutput``.

    Closing the iterator (``aclose()``, ``abort()``, cancelling the task that reads it)
    before the last output aborts the request in the engine.
    """

    request_id: str  # unique engine-side id
    user_request_id: str  # as given to add_request; set on the outputs
    owner: "AsyncLLM"
    loop: asyncio.AbstractEventLoop
    arrival_time: float  # time.monotonic()
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    aborted: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.aborted:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:
            # Cancelled (client disconnect) while waiting: stop the request.
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        item.request_id = self.user_request_id
        self._observe(item)
        if item.finished:
            self.finished = True
        return item

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        n = sum(len(c.token_ids) for c in out.outputs)
        listeners = self.owner.stat_listeners
        if n:
            if self.first_token_time is None:
                self.first_token_time = now
                if out.finished and out.metrics.get("first_token_time"):
                    # One final output (non-streaming): the engine's own timestamp.
                    self.first_token_time = out.metrics["first_token_time"]
                for ls in listeners:
                    ls.on_first_token(self.first_token_time - self.arrival_time)
            elif self.last_token_time is not None:
                for ls in listeners:
                    ls.on_inter_token(now - self.last_token_time)
            self.last_token_time = now
            self.num_generation_tokens += n
        if out.finished:
            e2e = now - self.arrival_time
            ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
            ntok = self.num_generation_tokens
            tpot = (e2e - ttft) / (ntok - 1) if ttft is not None and ntok > 1 else None
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            st = RequestStats(self.num_prompt_tokens, ntok, ttft, e2e, tpot, reasons[-1] if reasons else None)
            for ls in listeners:
                ls.on_request_finished(st)

    def abort(self) -> None:
        """Stop the request (idempotent; nothing after its last output)."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self.owner._abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class AsyncLLM:
    """An ``LLMEngine`` stepped by a dedicated thread, driven from asyncio.

    Args:
        config: engine configuration (ignored when ``engine`` is given).
        engine: an already built ``LLMEngine`` (tests).

    The front end tokenizes with its own copy of the tokenizer (``self.tokenizer``), so
    that it never contends with the engine thread's detokenizer.
    """

    def __init__(self, config: EngineConfig | None = None, engine=None) -> None:
        if engine is None:
            from tandem.engine.llm_engine import LLMEngine

            engine = LLMEngine(config or EngineConfig())
        self.engine = engine
        self.config = engine.config
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # pragma: no cover - a tokenizer that cannot be copied
            self.tokenizer = engine.tokenizer
        self.vocab_size: int = engine.vocab_size
        self.max_model_len: int = engine.config.max_model_len
        self.stat_listeners: list[StatListener] = []
        self._cv = threading.Condition()
        self._ops: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._counter = itertools.count()
        self._stop = False
        self._dead: BaseException | None = None
        self._stats: dict[str, float] = self._collect_stats()
        self._num_steps = 0
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- front end API
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stop and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def stats(self) -> dict[str, float]:
        """Snapshot of engine statistics, refreshed by the engine thread after each step.

        Keys: num_running, num_waiting, kv_cache_usage (0..1), num_preemptions,
        prefix_cache_queries / prefix_cache_hits (tokens), prompt_tokens and
        generation_tokens (cumulative), num_unfinished_seqs, num_seqs_with_blocks,
        num_free_blocks, num_usable_blocks, num_live_requests, num_steps.
        """
        return dict(self._stats)

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a tokenized request; returns once the engine accepted it.

        ``request_id`` may repeat across requests (a user-supplied header): the engine
        sees it with a unique suffix (``RequestStream.request_id``).

        Raises:
            ValueError: the engine rejected the request (the message says why: context
                length, vocabulary, sampling values).
            EngineDeadError: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")
        loop = asyncio.get_running_loop()
        stream = RequestStream(f"{request_id}#{next(self._counter)}", request_id, self, loop,
                               time.monotonic() if arrival_time is None else arrival_time, len(prompt_token_ids))
        self._push(("add", stream, list(prompt_token_ids), params))
        try:
            first = await stream.queue.get()
        except BaseException:
            stream.abort()
            raise
        if first is not _ADDED:
            stream.finished = True
            raise first
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request (text, tokenized here, or token ids) and yield its outputs;
        leaving the loop early (``break``, ``aclose()``, task cancelled) aborts it.

        Raises:
            ValueError: the engine rejected the request.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        stream = await self.add_request(request_id, ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def call_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between two steps; return its result."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._push(("call", fn, loop, fut))
        return await fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; live requests end with ``EngineDeadError``."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        try:
            self.engine.shutdown()
        except Exception:  # pragma: no cover
            logger.exception("engine shutdown failed")

    # ---------------------------------------------------------------- internals
    def _push(self, op: tuple) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def _abort(self, engine_request_id: str) -> None:
        if self.is_running:
            self._push(("abort", engine_request_id))

    @staticmethod
    def _deliver(items: list[tuple[Any, Any]]) -> None:
        for target, item in items:
            if isinstance(target, asyncio.Future):
                if not target.done():
                    if isinstance(item, BaseException):
                        target.set_exception(item)
                    else:
                        target.set_result(item)
            else:
                target.queue.put_nowait(item)

    def _send(self, batches: dict[asyncio.AbstractEventLoop, list]) -> None:
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

    def _collect_stats(self) -> dict[str, float]:
        e = self.engine
        s = dict(e.stats())
        kv = e.kv_manager
        s["num_unfinished_seqs"] = len(e.scheduler.requests)
        s["num_seqs_with_blocks"] = len(kv.req_blocks)
        s["num_free_blocks"] = kv.pool.num_free_blocks
        s["num_usable_blocks"] = kv.num_usable_blocks
        s["num_live_requests"] = len(e.output_processor.parents)
        s["num_steps"] = getattr(self, "_num_steps", 0)
        return s

    def _apply_ops(self, ops: list[tuple], out: dict) -> None:
        engine = self.engine
        for op in ops:
            kind = op[0]
            if kind == "add":
                _, stream, ids, params = op
                if stream.aborted:
                    continue
                try:
                    engine.add_request(stream.request_id, ids, params, arrival_time=stream.arrival_time)
                except Exception as e:  # ValueError for bad input; anything else is reported too
                    if not isinstance(e, ValueError):
                        logger.exception("add_request failed")
                    out[stream.loop].append((stream, e))
                    continue
                self._streams[stream.request_id] = stream
                out[stream.loop].append((stream, _ADDED))
            elif kind == "abort":
                if self._streams.pop(op[1], None) is not None:
                    engine.abort_request(op[1])
            elif kind == "call":
                _, fn, loop, fut = op
                try:
                    res = fn(engine)
                except Exception as e:
                    res = e
                out[loop].append((fut, res))

    def _fail_all(self, err: BaseException, ops: list[tuple]) -> None:
        out: dict = defaultdict(list)
        for s in self._streams.values():
            out[s.loop].append((s, err))
        self._streams.clear()
        for op in ops:
            if op[0] == "add":
                out[op[1].loop].append((op[1], err))
            elif op[0] == "call":
                out[op[2]].append((op[3], err))
        self._send(out)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._ops and not self._stop and not engine.has_unfinished_requests():
                    self._cv.wait()
                ops, self._ops = self._ops, []
                stop = self._stop
            if stop:
                self._dead = EngineDeadError("the engine was shut down")
                self._fail_all(self._dead, ops)
                return
            out: dict = defaultdict(list)
            try:
                self._apply_ops(ops, out)
                ops = []
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._num_steps += 1
                    for o in outputs:
                        stream = self._streams.get(o.request_id)
                        if stream is None:
                            continue
                        if o.finished:
                            del self._streams[o.request_id]
                        out[stream.loop].append((stream, o))
                self._stats = self._collect_stats()
            except BaseException as e:  # an engine bug: fail every live request, stop serving
                logger.exception("engine step failed; the engine stops")
                self._send(out)
                self._dead = EngineDeadError(f"engine error: {e!r}")
                with self._cv:
                    ops += self._ops
                    self._ops = []
                self._fail_all(self._dead, ops)
                return
            self._send(out)
