"""The asyncio front end of the server: engine cores in their own processes.

``AsyncLLM`` splits work as vLLM V1's ``AsyncLLM`` / ``EngineCore`` do:

* each **engine core** (one process per data-parallel replica, :mod:`tandem.engine.core_proc`)
  runs the scheduler and the one-step-ahead model loop back to back while it has work and
  sends one message per step with the new token ids of all its requests; idle, it blocks
  on its input socket (no busy spin);
* the **front end** (this process's asyncio event loop: HTTP, validation, chat templates,
  tokenization) validates and tokenizes a request once, sends its sequences to the least
  loaded replica (:class:`tandem.engine.core_client.AsyncMPClient`), and an output task turns
  each core message into text and ``RequestOutput``s (incremental detokenization, stop
  strings, logprob token strings: :mod:`tandem.engine.output_processor`) put on per-request
  ``asyncio.Queue``s. A stop string found here aborts the sequence in its core.

A client that stops listening (the async iterator is closed or its task cancelled) aborts
its request: its core frees the KV blocks before its next step. A core that dies fails every
live request with :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.config import EngineConfig
from tandem.config.resolved import ResolvedConfig
from tandem.engine.core_client import AsyncMPClient, EngineDeadError
from tandem.engine.launch import CoreProcManager, EngineClientConfig
from tandem.engine.messages import EngineCoreOutputs
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.processor import Processor
from tandem.engine.stat_logger import LOG_STATS_INTERVAL_S, StatsLogger
from tandem.model_loader.loader import load_tokenizer
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def sum_replica_stats(per_replica: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The stats of several data-parallel replicas as one engine's: numbers add, lists and
    tuples (``spec_decode_num_accepted_tokens_per_pos``: counts by draft position) add
    element-wise into a list, the shorter padded with zeros, and ``kv_cache_usage`` (0..1)
    is the replicas' average. Nothing is summed from no replicas (an empty dict)."""
    replicas = list(per_replica)
    s: dict[str, Any] = {}
    for st in replicas:
        for k, v in st.items():
            if isinstance(v, (list, tuple)):
                s[k] = [a + b for a, b in itertools.zip_longest(s.get(k, ()), v, fillvalue=0)]
            else:
                s[k] = s.get(k, 0) + v
    if replicas:
        s["kv_cache_usage"] = s.get("kv_cache_usage", 0.0) / len(replicas)
    return s


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

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Tokens of requests accepted / generated since the last call."""


@dataclass(eq=False)
class RequestStream:
    """The front end's handle on one request: an async iterator of ``RequestOutput``.

    Outputs wait in a plain list with one waiter future at a time (cheaper than an
    ``asyncio.Queue`` per output); :meth:`next_outputs` takes every output that arrived
    since the last call at once, so that a reader behind by several engine steps frames
    them in one pass. Closing the iterator (``aclose()``, ``abort()``, cancelling the task
    that reads it) before the last output aborts the request in the engine.
    """

    request_id: str  # unique engine-side id
    user_request_id: str  # as given to add_request; set on the outputs
    owner: "AsyncLLM"
    arrival_time: float  # time.monotonic()
    num_prompt_tokens: int
    finished: bool = False
    aborted: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    _pending: list = field(default_factory=list)  # RequestOutputs, then possibly one exception
    _waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output (or the exception that ends the stream); event-loop thread only."""
        self._pending.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        await self._wait()
        item = self._pending.pop(0)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return self._deliver(item)

    async def next_outputs(self) -> list[RequestOutput]:
        """Every output that arrived since the last call, in order (waits for the first).

        An exception that ends the stream is raised once the outputs before it are taken.

        Raises:
            StopAsyncIteration: after the last output (or an abort).
        """
        await self._wait()
        items = self._pending
        if len(items) == 1 and not isinstance(items[0], BaseException):  # the common case
            self._pending = []
            return [self._deliver(items[0])]
        cut = next((k for k, x in enumerate(items) if isinstance(x, BaseException)), len(items))
        if cut == 0:
            self.finished = True
            raise items[0]
        self._pending = items[cut:]
        outs = []
        for x in items[:cut]:
            outs.append(self._deliver(x))
            if self.finished:  # nothing follows the last output
                break
        return outs

    async def _wait(self) -> None:
        if self.finished or self.aborted:
            raise StopAsyncIteration
        if self._pending:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        except BaseException:
            # Cancelled (client disconnect) while waiting: stop the request.
            self.abort()
            raise
        finally:
            self._waiter = None

    def _deliver(self, item: RequestOutput) -> RequestOutput:
        item.request_id = self.user_request_id
        self._observe(item)
        if item.finished:
            self.finished = True
        return item

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        cs = out.outputs
        n = len(cs[0].token_ids) if len(cs) == 1 else sum(len(c.token_ids) for c in cs)
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
    """The server's engine front end (see the module docstring).

    Args:
        config: engine configuration (``self.config``, as given);
            ``tensor_parallel_size * data_parallel_size`` rank processes are spawned
            (``data_parallel_size`` engine cores). What replica 0's core resolved from it
            (dtype, limits, generation defaults) is ``self.resolved``.
        client_config: attach to cores another process launched (one of several API
            servers) instead of spawning them.
        log_stats_interval_s: seconds between two stats lines in the log while there is
            work (:mod:`tandem.engine.stat_logger`); None: none. Read by :meth:`start`
            (the ``log_stats_interval_s`` attribute).

    Raises:
        EngineDeadError: a core failed to start.
        ProcessLookupError: a core of ``client_config`` is gone already.
        ValueError: the configuration is invalid.
    """

    def __init__(self, config: EngineConfig | None = None, client_config: EngineClientConfig | None = None,
                 log_stats_interval_s: float | None = LOG_STATS_INTERVAL_S) -> None:
        config = config or EngineConfig()
        # The tokenizer loads here while the cores load the model.
        with ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer-load") as pool:
            tok = pool.submit(load_tokenizer, config.model_config.tokenizer or config.model_config.model)
            self.client = AsyncMPClient(config, CoreProcManager.attach(client_config)
                                        if client_config is not None else None)
            self.tokenizer = tok.result()
        ready = self.client.ready
        self.config = config
        self.resolved: ResolvedConfig = ready.resolved
        self.processor = Processor(self.tokenizer, ready)
        # Its own copy: prompts are tokenized on a worker thread while outputs are
        # detokenized on the event loop, and a Rust tokenizer is not shared across threads.
        self.output_processor = OutputProcessor(copy.deepcopy(self.tokenizer))
        self.vocab_size: int = ready.vocab_size
        self.max_model_len: int = self.resolved.max_model_len
        self.num_kv_blocks: int = sum(r.resolved.num_kv_blocks for r in self.client.readies)
        self.stat_listeners: list[StatListener] = []
        self._streams: dict[str, RequestStream] = {}
        self._counter = itertools.count()
        # Engine-side ids must not collide with another API server's on the shared cores.
        self._id_tag = f"{client_config.client_index}." if client_config is not None else ""
        self._tokens_reported = {"prompt_tokens": 0, "generation_tokens": 0}
        self.num_requests = 0  # accepted by this front end since start
        self._stopped = False
        self._scheduler_stats: dict[int, dict] = {}
        self.log_stats_interval_s = log_stats_interval_s
        self._stats_prefix = f"API server {client_config.client_index}: " if client_config is not None else ""
        self._stats_task: asyncio.Task | None = None

    # ----------------------------------------------------------- front end API
    @property
    def is_running(self) -> bool:
        return not self._stopped and self.client.is_alive

    @property
    def dead_error(self) -> BaseException | None:
        return self.client.dead_error or (EngineDeadError("the engine was shut down") if self._stopped else None)

    def stats(self) -> dict[str, Any]:
        """Engine statistics: the replicas' latest scheduler gauges and counters, summed
        (:func:`sum_replica_stats`: ``kv_cache_usage`` averaged), plus the front end's
        prompt_tokens / generation_tokens and num_live_requests. Keys: num_running,
        num_waiting, kv_cache_usage (0..1), num_preemptions, prefix_cache_queries /
        prefix_cache_hits (tokens), num_free_blocks, num_usable_blocks,
        spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos (a list: accepted tokens by draft position;
        empty without speculation)."""
        s = sum_replica_stats(self._scheduler_stats.values())
        s.update(self.output_processor.stats)
        s["num_live_requests"] = len(self.output_processor.parents)
        return s

    def replica_stats(self) -> dict[int, dict]:
        """Each replica's latest scheduler gauges, by data-parallel rank."""
        return {e: dict(st) for e, st in sorted(self._scheduler_stats.items())}

    async def engine_stats(self) -> dict[str, Any]:
        """State read in every core between two steps, summed over replicas
        (:func:`sum_replica_stats`; tests, ``/debug/engine_stats``): the scheduler's gauges
        and counters (the spec_decode_* ones included, spec_decode_num_accepted_tokens_per_pos
        a list by draft position), num_unfinished_seqs, num_seqs_with_blocks,
        num_free_blocks, num_usable_blocks, num_steps, num_dbo_steps, plus the front end's
        num_live_requests and ``replicas`` (each replica's own, unsummed).

        Raises:
            EngineDeadError: a core is not running.
        """
        self._check_running()
        self.start()
        per = await self.client.debug_stats()
        s = sum_replica_stats(per)
        s["num_live_requests"] = len(self.output_processor.parents)
        s["replicas"] = per
        return s

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")

    def start(self) -> None:
        """Start the output task, and the stats line's, on the running event loop
        (idempotent; the first request starts them too)."""
        self.client.start(self._on_outputs, self._on_dead)
        task, loop = self._stats_task, asyncio.get_running_loop()
        if self.log_stats_interval_s and (task is None or task.done() or task.get_loop() is not loop):
            self._stats_task = loop.create_task(self._log_stats(self.log_stats_interval_s))

    async def _log_stats(self, interval_s: float) -> None:
        device = "GPU" if self.resolved.device.startswith("cuda") else "CPU"
        stat_logger = StatsLogger(self.stats, device, self._stats_prefix)
        while True:
            await asyncio.sleep(interval_s)
            stat_logger.log()

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a tokenized request on the least loaded replica.

        ``request_id`` may repeat across requests (a user-supplied header): the cores see
        it with a unique suffix (``RequestStream.request_id``).

        Raises:
            ValueError: the request is invalid (the message says why: context length,
                vocabulary, sampling values).
            EngineDeadError: the engine is not running.
        """
        self._check_running()
        self.start()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        rid = f"{request_id}#{self._id_tag}{next(self._counter)}"
        text, reqs = self.processor.process_inputs(rid, list(prompt_token_ids), params, arrival)
        stream = RequestStream(rid, request_id, self, arrival, len(prompt_token_ids))
        self.output_processor.add_request(rid, text, reqs)
        self._streams[rid] = stream
        self.client.add_requests(reqs)
        self.num_requests += 1
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add a request (text, tokenized here, or token ids) and yield its outputs;
        leaving the loop early (``break``, ``aclose()``, task cancelled) aborts it.

        Raises:
            ValueError: the request is invalid.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        stream = await self.add_request(request_id, ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort_all(self, reason: str) -> None:
        """End every live request with ``EngineDeadError(reason)`` and abort its sequences in
        the cores (the server is stopping)."""
        err = EngineDeadError(reason)
        for rid, stream in list(self._streams.items()):
            core_ids = self.output_processor.abort(rid)
            stream.put(err)
            if core_ids and self.is_running:
                self.client.abort_requests(core_ids)
        self._streams.clear()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the cores; live requests end with ``EngineDeadError``."""
        if self._stopped:
            return
        self._stopped = True
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._cancel_stats_task()
        self.client.shutdown(timeout)

    # ---------------------------------------------------------------- internals
    def _cancel_stats_task(self) -> None:
        task = self._stats_task
        if task is None or task.done() or task.get_loop().is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # no running loop in this thread
            running = None
        if running is task.get_loop():
            task.cancel()
        else:
            task.get_loop().call_soon_threadsafe(task.cancel)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        core_ids = self.output_processor.abort(request_id)
        if core_ids and self.is_running:
            try:
                self.client.abort_requests(core_ids)
            except EngineDeadError:
                pass

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.scheduler_stats is not None:
            st = msg.scheduler_stats
            self._scheduler_stats[msg.engine_index] = {f: getattr(st, f) for f in st.__struct_fields__}
        if not msg.outputs:
            return
        res = self.output_processor.process_outputs(msg.outputs)
        for out in res.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)
        for rid, err in res.errors.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(EngineDeadError(f"request failed in its engine core: {err}"))
        if res.reqs_to_abort:
            self.client.abort_requests(res.reqs_to_abort)
        self._report_tokens()

    def _report_tokens(self) -> None:
        st, done = self.output_processor.stats, self._tokens_reported
        dp, dg = st["prompt_tokens"] - done["prompt_tokens"], st["generation_tokens"] - done["generation_tokens"]
        if dp or dg:
            done.update(st)
            for ls in self.stat_listeners:
                ls.on_tokens(dp, dg)

    def _on_dead(self, err: BaseException) -> None:
        self._fail_all(err if isinstance(err, EngineDeadError) else EngineDeadError(repr(err)))

    def _fail_all(self, err: EngineDeadError) -> None:
        for rid, stream in list(self._streams.items()):
            self.output_processor.abort(rid)
            stream.put(err)
        self._streams.clear()
