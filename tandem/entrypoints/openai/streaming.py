"""The SSE body of a streamed completion or chat completion: one skeleton
(:class:`ChunkStream`) for both endpoints, which say only what a choice's chunk holds.

Each engine output of a choice becomes one chunk, a ``protocol`` stream struct encoded by
the one msgspec encoder here; the chunks of the outputs that arrived together go out as
one write. After the last output come the usage chunk (``stream_options.include_usage``)
and ``[DONE]``; a failure ends the body with an error event before ``[DONE]``, so that a
client reads why rather than a cut stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

import msgspec

from tandem.engine.async_llm import EngineDeadError, RequestStream
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.errors import error_body
from tandem.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()

_DONE = "data: [DONE]\n\n"


def sse(data: msgspec.Struct | dict) -> str:
    """``data`` as one SSE event."""
    return f"data: {_encoder.encode(data).decode()}\n\n"


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[list[tuple[int, list[RequestOutput]]]]:
    """Interleave several request streams as ``(stream index, its outputs)``, in arrival
    order, in batches: each batch holds every output that arrived since the last one (at
    least one)."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            while True:
                try:
                    outs = await s.next_outputs()
                except StopAsyncIteration:
                    break
                q.put_nowait((i, outs))
        except BaseException as e:  # noqa: BLE001 - forwarded to the reader
            q.put_nowait((i, e))
            return
        q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            batch: list[tuple[int, list[RequestOutput]]] = []
            item = await q.get()
            while True:
                i, x = item
                if x is done:
                    remaining -= 1
                elif isinstance(x, BaseException):
                    if batch:
                        yield batch
                    raise x
                else:
                    batch.append((i, x))
                if q.empty():
                    break
                item = q.get_nowait()
            if batch:
                yield batch
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class SSEStream:
    """A streaming response body (SSE lines) and the engine requests behind it.

    ``abort()`` stops the requests even if the body was never iterated (a client gone
    before the first chunk); the HTTP layer calls it when the response ends, however.
    """

    def __init__(self, body: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        self.body = body
        self.streams = list(streams)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.body.__aiter__()

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


class ChunkStream(SSEStream, ABC):
    """The SSE body of one streamed response: the :meth:`head` choices' chunks, then one
    chunk per engine output of a choice (:meth:`choice`), then the usage chunk and
    ``[DONE]``.

    Choice ``i * n + c.index`` is completion ``c`` of the ``i``-th request (one per
    prompt). Under ``continuous_usage_stats`` each chunk carries its choice's usage so
    far: its prompt's tokens and the tokens it sent (none where ``counts_tokens`` is
    false: completions' ``echo`` with ``max_tokens`` 0, whose one token is not sent).

    Args:
        streams: the engine requests, one per prompt.
        rid: the response id.
        model: the model name reported.
        prompt_lens: the number of tokens of each request's prompt.
        n: choices per request.
        include_usage: send the usage chunk.
        continuous_usage: usage in every chunk.
    """

    chunk_type: ClassVar[type[P.CompletionStreamResponse] | type[P.ChatCompletionStreamResponse]]
    what: ClassVar[str]  # the response, as the log names it when its stream fails

    def __init__(self, streams: Sequence[RequestStream], rid: str, model: str, prompt_lens: list[int], n: int,
                 include_usage: bool, continuous_usage: bool) -> None:
        super().__init__(self._body(), streams)
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.prompt_lens = prompt_lens
        self.n = n
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.counts_tokens = True
        self.num_gen = [0] * (len(prompt_lens) * n)  # per choice: tokens sent so far
        self.last_token: list[int | None] = [None] * (len(prompt_lens) * n)  # per choice: the last one sent

    def head(self) -> list[msgspec.Struct]:
        """Choices sent before any output (chat's role and echo)."""
        return []

    @abstractmethod
    def choice(self, i: int, index: int, out: RequestOutput, c: CompletionOutput) -> msgspec.Struct | None:
        """The choice ``index`` of output ``c`` of request ``i`` (``out``), its tokens
        already counted; None: nothing to send."""

    def _usage(self, index: int) -> P.UsageInfo:
        prompt, gen = self.prompt_lens[index // self.n], self.num_gen[index]
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)

    async def _body(self) -> AsyncIterator[str]:
        # Per output: closures over locals, one stream awaited directly (no async generator
        # between it and this loop): these are the front end's per-token costs.
        frames: list[str] = []
        n, num_gen, last_token, choice_of = self.n, self.num_gen, self.last_token, self.choice
        chunk_type, rid, created, model = self.chunk_type, self.rid, self.created, self.model
        continuous, counts_tokens, encode = self.continuous_usage, self.counts_tokens, _encoder.encode

        # One chunk for the stream, each choice (and usage) set in place rather than a
        # struct and a list built per token; each is encoded at once, before the next.
        chunk = chunk_type(id=rid, created=created, model=model, choices=[None], usage=None)
        choices = chunk.choices

        def frame(choice: msgspec.Struct) -> str:
            choices[0] = choice
            if continuous:
                chunk.usage = self._usage(choice.index)
            return f"data: {encode(chunk).decode()}\n\n"

        def frame_outputs(i: int, outs: list[RequestOutput]) -> None:
            for out in outs:
                for c in out.outputs:
                    index = i * n + c.index
                    if counts_tokens and (toks := c.token_ids):
                        num_gen[index] += len(toks)
                        last_token[index] = toks[-1]
                    if (choice := choice_of(i, index, out, c)) is not None:
                        frames.append(frame(choice))

        try:
            if head := self.head():
                yield "".join(frame(choice) for choice in head)
            if len(self.streams) == 1:
                next_outputs = self.streams[0].next_outputs
                while True:
                    try:
                        outs = await next_outputs()
                    except StopAsyncIteration:
                        break
                    frame_outputs(0, outs)
                    if frames:
                        yield "".join(frames)
                        frames.clear()
            else:
                async for batch in merge_streams(self.streams):
                    for i, outs in batch:
                        frame_outputs(i, outs)
                    if frames:
                        yield "".join(frames)
                        frames.clear()
            if self.include_usage:
                prompt, gen = sum(self.prompt_lens), sum(num_gen)
                usage = P.UsageInfo(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen)
                yield sse(chunk_type(id=rid, created=created, model=model, choices=[], usage=usage))
        except EngineDeadError as e:
            yield "".join(frames) + sse(error_body(str(e), 500, "InternalServerError"))
        except Exception as e:  # noqa: BLE001 - report, then close the stream
            logger.exception("streaming %s failed", self.what)
            yield "".join(frames) + sse(error_body(f"internal error: {e!r}", 500, "InternalServerError"))
        finally:
            self.abort()
        yield _DONE
